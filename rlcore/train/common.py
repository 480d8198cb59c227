"""What SFT and RL training share: device and seeds, loading a model, AdamW with its
learning-rate schedule, gradient clipping, and checkpoints.

A checkpoint is a Hugging Face directory (model and tokenizer via `save_pretrained`, the
run's config as `train_config.json`); an RL checkpoint adds `trainer_state.pt`, the step,
optimizer, scheduler, sampler and random states, all as tensors and plain values, read
back with `torch.load(weights_only=True)` so that a crafted file cannot run code.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
from pathlib import Path

import numpy as np
import torch

from rlcore.train.config import OptimizerConfig, flatten_settings, save_config

TRAINER_STATE = "trainer_state.pt"


def resolve_device(name: str) -> torch.device:
    """`auto` -> cuda when available else cpu; `cuda` without a GPU is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "device='cuda' was asked for but no CUDA GPU is available; use auto or cpu"
        )
    if name not in ("cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, got {name!r}")
    return torch.device(name)


def describe_device(device: torch.device) -> str:
    """`cuda:0 (NVIDIA H200)` or `cpu`: what a run's log says it trains on."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return f"cuda:{index} ({torch.cuda.get_device_name(index)})"
    return str(device)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


# The attention kernels a training pass may use on CUDA. Not cuDNN's: it builds an
# execution plan for every new batch shape on the host (15-20 ms forward, ~14 ms backward,
# seen in the torch profiler on an H200), and a step's micro-batches come in new shapes
# every step (docs/BENCHMARKS.md, "cuDNN attention's plans").
TRAINING_ATTENTION = (
    torch.nn.attention.SDPBackend.FLASH_ATTENTION,
    torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION,
    torch.nn.attention.SDPBackend.MATH,
)


@contextlib.contextmanager
def autocast(device: torch.device):
    """bf16 autocast on CUDA (weights stay fp32 for the optimizer), attention by
    TRAINING_ATTENTION's kernels; nothing on CPU."""
    if device.type != "cuda":
        yield
        return
    with (
        torch.autocast(device_type="cuda", dtype=torch.bfloat16),
        torch.nn.attention.sdpa_kernel(list(TRAINING_ATTENTION)),
    ):
        yield


def model_path(model: str) -> str:
    """`tiny`, `tiny-bpe`, `tiny-bpe-3l` and `tiny-master` -> their directories
    (tiny.builtin_model_path); any other name unchanged."""
    from rlcore.policy.tiny import builtin_model_path

    return builtin_model_path(model)


def load_model_and_tokenizer(model: str, device: torch.device):
    """A trainable fp32 causal LM and its tokenizer from `tiny`, a directory or a hub id."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = model_path(model)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        network = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"cannot load model {model!r} (looked for {path!r}): accepted are `tiny`, `tiny-bpe`, "
            "`tiny-bpe-3l`, `tiny-master`, a checkpoint directory with config.json, or a Hugging "
            f"Face hub id ({exc})"
        ) from exc
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return network.to(device), tokenizer


def lr_factor(update: int, *, warmup_steps: int, total_steps: int, schedule: str, min_ratio: float):
    """Learning-rate multiplier for optimizer update `update` (0-based)."""
    if warmup_steps and update < warmup_steps:
        return (update + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (update - warmup_steps) / decay_steps)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_optimizer(model, cfg: OptimizerConfig, total_updates: int):
    """AdamW and its LambdaLR schedule (warm-up, then cfg.lr_schedule) for `cfg`."""
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        betas=(0.9, 0.95),
        eps=cfg.adam_eps,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda update: lr_factor(
            update,
            warmup_steps=cfg.warmup_steps,
            total_steps=total_updates,
            schedule=cfg.lr_schedule,
            min_ratio=cfg.min_lr_ratio,
        ),
    )
    return optimizer, scheduler


def clip_gradients(model, max_norm: float) -> torch.Tensor:
    """Clip the global gradient norm (0: only measure it) and return the norm before, a
    0-dim tensor on the parameters' device (reading it waits for the GPU)."""
    params = [p for p in model.parameters() if p.grad is not None]
    return torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))


def pad_batch(sequences: list[list[int]], pad_value: int, multiple: int = 1) -> torch.Tensor:
    """The sequences right-padded with `pad_value` to the longest, rounded up to `multiple`."""
    width = -(-max(len(s) for s in sequences) // multiple) * multiple
    return torch.from_numpy(padded_rows(sequences, width, np.int64, pad_value))


def padded_rows(values: list[list], width: int, dtype, fill, skip: int = 0) -> np.ndarray:
    """Each list from index `skip` on as one row of a (len(values), width) array of `dtype`,
    right-padded with `fill`: one array filled a row at a time, where a tensor a row and a
    pad each cost a batch of 256 sequences tens of milliseconds of host time."""
    rows = np.full((len(values), width), fill, dtype=dtype)
    for row, value in enumerate(values):
        if len(value) > skip:
            rows[row, : len(value) - skip] = value[skip:]
    return rows


# ---------------------------------------------------------------------------------------
# Checkpoints


def save_checkpoint(model, tokenizer, cfg, path: str | Path) -> str:
    """Model and tokenizer via save_pretrained, plus the run's config as train_config.json
    (config.json in a checkpoint is the model's own config)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    save_config(cfg, path, name="train_config.json")
    return str(path)


def checkpoint_dir(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / f"step_{step:06d}"


def saves_after(step: int, save_every: int, last_step: int) -> bool:
    """Whether a run saving every `save_every` steps saves after `step` (the final save,
    after `last_step`, aside)."""
    return bool(save_every) and step % save_every == 0 and step < last_step


def random_states() -> dict:
    """The python, numpy and torch random states as tensors and plain numbers only, so
    `torch.load(weights_only=True)` can read them back (pickled numpy arrays and the like
    would need the unpickler that runs code)."""
    version, internal, gauss_next = random.getstate()
    algorithm, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    states = {
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
        "numpy": {
            "algorithm": str(algorithm),
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(position),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore_random_states(states: dict) -> None:
    python = states["python"]
    random.setstate((python["version"], tuple(python["internal"]), python["gauss_next"]))
    numpy = states["numpy"]
    np.random.set_state(
        (
            numpy["algorithm"],
            numpy["keys"].numpy().astype(np.uint32),
            numpy["pos"],
            numpy["has_gauss"],
            numpy["cached_gaussian"],
        )
    )
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


TRAINER_STATE_KEYS = {"step", "optimizer", "scheduler", "sampler", "random"}


def save_trainer_state(path, step, optimizer, scheduler, sampler_state, random_state) -> None:
    """What a resumed run needs besides the weights, next to them in checkpoint `path`."""
    state = {
        "step": step,
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "sampler": sampler_state,
        "random": random_state,
    }
    torch.save(state, Path(path) / TRAINER_STATE)


def load_trainer_state(path: str | Path) -> dict:
    """The trainer state of checkpoint `path`, read with `weights_only=True`: a checkpoint
    directory may come from anywhere (an upload, a shared folder), and a full unpickle runs
    whatever code the file names. A file that needs more than tensors and plain values is
    refused, not run."""
    state_path = Path(path) / TRAINER_STATE
    if not state_path.is_file():
        raise ValueError(
            f"resume_from={str(path)!r} is not an RL checkpoint (no {TRAINER_STATE}); "
            "accepted: a step_NNNNNN/ or final/ directory written by an RL run"
        )
    try:
        state = torch.load(state_path, map_location="cpu", weights_only=True)
    except Exception as exc:  # UnpicklingError, or whatever a damaged file makes torch raise
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(
            f"refusing to load {str(state_path)!r}: it is not a trainer state this version "
            "writes (tensors and plain values, loadable with weights_only=True); it may hold "
            f"code to run, or come from an older version ({type(exc).__name__}: {reason})"
        ) from None
    missing = TRAINER_STATE_KEYS - set(state if isinstance(state, dict) else ())
    if missing:
        raise ValueError(
            f"{str(state_path)!r} is not a trainer state: it lacks {sorted(missing)}; "
            "accepted: the file an RL run writes in each checkpoint"
        )
    return state


def changed_settings(path: str | Path, cfg, resumable: set[str]) -> list[str]:
    """The settings of `cfg` (dotted) that differ from those checkpoint `path` was
    trained with, less the `resumable` ones a resumed run may change."""
    saved = flatten_settings(json.loads((Path(path) / "train_config.json").read_text()))
    current = flatten_settings(cfg.to_dict())
    return sorted(k for k in current if k not in resumable and saved.get(k) != current[k])


class Milestones:
    """What a long run says in its log besides its metrics: a line at its first step, about
    every tenth of the run and at its last (step, the `keys` it reported, seconds a step),
    and a closing summary of how those moved (the mean of the first tenth of the steps
    against the last tenth's). `keys` may end in "*": every metric with that prefix."""

    def __init__(self, sink, prefix: str, first_step: int, total_steps: int, keys: list[str]):
        self.sink, self.prefix, self.keys = sink, prefix, keys
        self.first_step, self.total_steps = first_step, total_steps
        self.every = max(1, (total_steps - first_step + 1) // 10)
        self.first: dict[str, list[float]] = {}
        self.last: dict[str, list[float]] = {}
        self.steps, self.seconds = 0, 0.0

    def _picked(self, metrics: dict) -> dict[str, float]:
        return {
            name: value
            for name, value in metrics.items()
            for key in self.keys
            if name == key or (key.endswith("*") and name.startswith(key[:-1]))
        }

    def step(self, step: int, metrics: dict, seconds: float) -> None:
        picked = self._picked(metrics)
        self.steps += 1
        self.seconds += seconds
        for name, value in picked.items():
            if self.steps <= self.every:
                self.first.setdefault(name, []).append(value)
            window = self.last.setdefault(name, [])
            window.append(value)
            del window[: -self.every]
        if step == self.first_step or step % self.every == 0 or step == self.total_steps:
            values = " ".join(f"{name}={value:.4g}" for name, value in picked.items())
            self.sink.log(
                f"{self.prefix}: step {step}/{self.total_steps}: {values} ({seconds:.2f} s/step)"
            )

    def summary(self) -> None:
        moved = ", ".join(
            f"{name} {np.mean(self.first[name]):.4g} -> {np.mean(values):.4g}"
            for name, values in self.last.items()
            if name in self.first
        )
        mean = self.seconds / max(self.steps, 1)
        self.sink.log(
            f"{self.prefix}: done: {self.steps} steps in {self.seconds:.1f} s ({mean:.2f} s/step); "
            f"first tenth -> last tenth: {moved or 'no metrics'}"
        )
