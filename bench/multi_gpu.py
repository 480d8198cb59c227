"""Seconds per RL step on one GPU, on two GPUs with generation and training split, and on
two GPUs data-parallel, for the tiny model and a ~0.5 B model.

    python bench/multi_gpu.py [--device auto] [--models tiny,qwen2-0.5b] [--steps 3]
        [--prompts 32] [--group 8] [--max-tokens 48] [--budget-s 420] [--out PATH]

Each figure is `run_rl`'s own `perf/step_seconds` (with its rollout and train parts), the
median of `--steps` steps after one untimed step (graph capture, allocator warm-up), in
three placements of the same run (rlcore/train/distributed.py):
- single: one GPU, the engine sampling the trainer's own model (colocated);
- split: generation on cuda:0, training on cuda:1, the weights copied over after each step;
- parallel: two processes (NCCL), rank 0 generating, both ranks taking half of the update.
The task is `reverse_text` (paragraph mode): `--prompts` x `--group` completions a step of
at most `--max-tokens` tokens, temperature 1, loss grpo with a KL term (beta 0.04), so
every sequence is trained even though an untrained model's rewards are all 0 (the
reference's forward and the scoring pass are part of the step), lr 1e-5 constant, micro
batches of 16 sequences. Models: the built-in tiny model, and Qwen2-0.5B's config with
random weights (bench/local_engine.py's builder, the tiny tokenizer), fp32 weights with
bf16 autocast as the trainer runs them. Every run is a child process (a clean CUDA state,
and a run that hangs is cut off at the time left of `--budget-s`); results are written
after each one.

Two checks on the tiny model come first. Split: the generation copy (static decoder, CUDA
graphs captured) answers a greedy prompt, the trainer's weights change, `copy_weights`
copies them over, and the next answer's logprobs must be the trainer's own (teacher-forced,
fp32) with no graph captured again. Parallel: one RL update (two optimizer steps, KL term)
on a fixed batch with advantages +-1, in one process and on two NCCL ranks: the losses and
gradient norm (relative difference) and the weights after it (largest difference, in
units of lr) must agree up to noise. An untrained model's rewards are all 0, so the timed
runs' own losses cannot show this: their gradient is 0.

Needs two CUDA GPUs (says so and exits 2 otherwise); `--device cpu` runs the same three on
the CPU (split: two CPU "devices"; parallel: gloo) as a smoke check. Writes
bench/results/multi_gpu.json (`--out` elsewhere) with the card names.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from benchlib import write_results  # noqa: E402

MODES = ("single", "split", "parallel")
MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
NO_TWO_GPUS = 2


def build_model(name: str, device: str, directory: Path) -> str:
    """A model directory for `name`: the tiny model's own, or qwen2-0.5b saved to
    `directory` (random weights from Qwen2-0.5B's config, the tiny tokenizer)."""
    from rlcore.policy.tiny import ensure_tiny_model

    if name == "tiny":
        return ensure_tiny_model()
    from local_engine import load_model

    model, tokenizer = load_model(name, device, torch.float32)
    path = directory / name
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return str(path)


def run_one(spec: dict) -> dict:
    """One placement of one model (in a child process): step times, rank 0's peak memory."""
    from rlcore.events import NullSink
    from rlcore.train.config import RLConfig, build_config
    from rlcore.train.distributed import run_rl_ranks

    class StepTimes(NullSink):
        def __init__(self):
            self.steps: list[dict] = []

        def metric(self, step, values):
            self.steps.append(
                {
                    "step": values["perf/step_seconds"],
                    "rollout": values["perf/rollout_seconds"],
                    "train": values["perf/train_seconds"],
                    "tokens_per_s": values["perf/tokens_per_s"],
                }
            )

    mode, device = spec["mode"], spec["device"]
    with tempfile.TemporaryDirectory() as output_dir:
        settings = dict(
            model=spec["model_path"],
            env="reverse_text",
            batch_size=spec["prompts"] * spec["group"],
            rollouts_per_example=spec["group"],
            max_tokens=spec["max_tokens"],
            temperature=1.0,
            lr=1e-5,
            lr_schedule="constant",
            beta=0.04,
            micro_batch_size=spec["micro_batch_size"],
            concurrency=spec["prompts"] * spec["group"],
            save_every=0,
            log_rollouts=0,
            device=device,
            max_steps=spec["steps"] + 1,
            output_dir=output_dir,
            placement="split" if mode == "split" else "colocated",
        )
        cfg = build_config(RLConfig, [("bench", settings)])
        sink = StepTimes()
        started = time.monotonic()
        run_rl_ranks(cfg, sink, processes=2 if mode == "parallel" else 1)
        wall = time.monotonic() - started
    timed = sink.steps[1:]
    result = {
        key: statistics.median(s[key] for s in timed)
        for key in ("step", "rollout", "train", "tokens_per_s")
    }
    result |= {"steps": sink.steps, "run_seconds": wall}
    if device != "cpu":
        result["peak_gib_by_gpu"] = [
            torch.cuda.max_memory_allocated(i) / 2**30 for i in range(torch.cuda.device_count())
        ]
    return result


def check_split(model_path: str, device: str) -> dict:
    """The generation copy samples the trainer's weights after `copy_weights`, through
    the static decoder's graphs captured before the copy (on a CPU: the dynamic loop)."""
    import asyncio

    from rlcore.policy.local import LocalEngine
    from rlcore.train.common import load_model_and_tokenizer
    from rlcore.train.distributed import copy_weights, generation_model, placement_devices
    from rlcore.train.grpo import token_logprobs
    from rlcore.types import SamplingParams

    train_device, generation_device = placement_devices("split", torch.device(device))
    model, tokenizer = load_model_and_tokenizer(model_path, train_device)
    copy = generation_model(model, "split", generation_device)
    engine = LocalEngine(None, model=copy, tokenizer=tokenizer)
    prompt = [{"role": "user", "content": "Reverse: abcdef"}]
    greedy = SamplingParams(temperature=0.0, max_tokens=16)

    def answer():
        return asyncio.run(engine.generate(prompt, greedy))

    def gap(generation) -> float:
        """Largest gap between the engine's logprobs and the trainer's for the same ids."""
        ids = generation.prompt_ids + generation.completion_ids
        input_ids = torch.tensor([ids], device=train_device)
        with torch.no_grad():
            logprobs, *_ = token_logprobs(model, input_ids, 1.0)
        trainer = logprobs[0, len(generation.prompt_ids) - 1 :].tolist()
        return max(abs(a - b) for a, b in zip(generation.logprobs, trainer, strict=True))

    before = answer()
    captures = engine._static.captures if engine._static else 0
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.02)
    stale = answer()
    copy_weights(model, copy)
    after = answer()
    return {
        "train_device": str(train_device),
        "generation_device": str(generation_device),
        "decode": engine.decode,
        "gap_before_copy": gap(stale),
        "gap_after_copy": gap(after),
        "answer_changed": after.completion_ids != before.completion_ids
        or after.logprobs != before.logprobs,
        "graphs_captured_before": captures,
        "graphs_captured_after": engine._static.captures if engine._static else 0,
        "ok": gap(after) < 1e-3 < gap(stale),
    }


def fixed_sequences(vocabulary: int, count: int = 12) -> list:
    """`count` sequences of growing length, the second half of each trained with an
    advantage of +1 or -1 (alternating)."""
    from rlcore.train.sequences import TrainingSequence

    generator = torch.Generator().manual_seed(0)
    rows = []
    for index in range(count):
        ids = torch.randint(3, vocabulary, (8 + 5 * index,), generator=generator).tolist()
        trained = [float(position >= len(ids) // 2) for position in range(len(ids))]
        sign = 1.0 if index % 2 else -1.0
        rows.append(TrainingSequence(ids, trained, [sign * w for w in trained], None))
    return rows


def check_parallel(model_path: str, device: str) -> dict:
    """One update on a fixed batch in one process and on two ranks: the differences, next
    to the noise floor of the same update in one process with its sums in another order
    (micro-batches of 2 instead of 4). On a GPU the update runs under bf16 autocast, whose
    rounding depends on each pass's shapes, so two ranks can only be as close as that."""
    from rlcore.train.common import resolve_device
    from rlcore.train.config import RLConfig, build_config
    from rlcore.train.distributed import backend_for, current_ranks, launch, never
    from rlcore.train.grpo import build_learner, learn, loss_normalizer

    lr = 1e-4

    def config(micro_batch_size: int):
        with tempfile.TemporaryDirectory() as output_dir:
            settings = dict(
                model=model_path, device=device, output_dir=output_dir, batch_size=12,
                rollouts_per_example=2, micro_batch_size=micro_batch_size, num_iterations=2,
                beta=0.04, lr=lr,
            )  # fmt: skip
            return build_config(RLConfig, [("check", settings)])

    def update(cfg) -> tuple[dict, dict]:
        ranks = current_ranks()
        learner, tokenizer, _ = build_learner(cfg, ranks.device(resolve_device(cfg.device)), never)
        sequences = fixed_sequences(len(tokenizer))
        normalizer = loss_normalizer(sequences, cfg.loss, cfg.sampling.max_tokens)
        metrics = learn(learner, ranks.share(sequences, normalizer), normalizer, cfg)
        ranks.end()
        weights = {name: p.detach().cpu() for name, p in learner.model.named_parameters()}
        return metrics, weights

    cfg = config(4)
    alone, alone_weights = update(cfg)
    reordered, reordered_weights = update(config(2))
    together, together_weights = launch(
        lambda: update(cfg),
        "rlcore.train.distributed:follow_rl",
        cfg.to_dict(),
        processes=2,
        backend=backend_for(device),
    )

    def differences(metrics: dict, weights: dict) -> dict:
        relative = {
            name: abs(metrics[name] - alone[name]) / max(abs(alone[name]), 1e-8)
            for name in ("loss/policy", "loss/total", "loss/kl", "optim/grad_norm")
        }
        # In lr units: Adam moves a weight about lr per step whatever its gradient's size,
        # so an entry whose gradient is at the noise level may land a step apart.
        gaps = torch.cat(
            [(alone_weights[name] - weights[name]).abs().flatten() / lr for name in weights]
        )
        return {
            "relative_difference": relative,
            "largest_weight_difference_in_lr": float(gaps.max()),
            "share_of_weights_apart_by_a_tenth_of_lr": float((gaps > 0.1).float().mean()),
        }

    two_ranks = differences(together, together_weights)
    noise = differences(reordered, reordered_weights)
    worst = max(two_ranks["relative_difference"].values())
    worst_noise = max(noise["relative_difference"].values())
    share = two_ranks["share_of_weights_apart_by_a_tenth_of_lr"]
    share_noise = noise["share_of_weights_apart_by_a_tenth_of_lr"]
    return two_ranks | {
        "noise_floor": noise,
        "grad_norm": alone["optim/grad_norm"],
        "ok": worst < max(2 * worst_noise, 1e-4) and share < max(2 * share_noise, 1e-3),
    }


def run_child(spec: dict, timeout_s: float) -> dict:
    """`run_one(spec)` in a child process, cut off after `timeout_s` together with the
    rank it started (they share a process group)."""
    with tempfile.TemporaryDirectory() as scratch:
        spec_path, result_path = Path(scratch) / "spec.json", Path(scratch) / "result.json"
        spec_path.write_text(json.dumps(spec))
        command = [sys.executable, __file__, "--run-one", str(spec_path), str(result_path)]
        child = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            output, _ = child.communicate(timeout=max(timeout_s, 1))
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            output, _ = child.communicate()
            return {"error": f"cut off after {timeout_s:.0f} s", "log": output[-3000:]}
        if child.returncode or not result_path.is_file():
            return {"error": f"exited with {child.returncode}", "log": output[-3000:]}
        return json.loads(result_path.read_text())


def print_table(rows: list[dict], cards: str) -> None:
    print(f"\nRL step on reverse_text; {cards}")
    print(
        f"{'model':<12}{'placement':<11}{'step s':>8}{'rollout s':>11}{'train s':>9}"
        f"{'step vs single':>16}{'train vs single':>17}"
    )
    for row in rows:
        if "error" in row:
            print(f"{row['model']:<12}{row['mode']:<11}  {row['error']}")
            continue
        single = next(
            (r for r in rows if r["model"] == row["model"] and r["mode"] == "single"), None
        )
        ratios = ["-", "-"]
        if single and "error" not in single:
            ratios = [f"{row[key] / single[key]:.2f}x" for key in ("step", "train")]
        print(
            f"{row['model']:<12}{row['mode']:<11}{row['step']:>8.3f}{row['rollout']:>11.3f}"
            f"{row['train']:>9.3f}{ratios[0]:>16}{ratios[1]:>17}"
        )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", help="auto, cuda or cpu (a smoke check)")
    parser.add_argument("--models", default=None, help="tiny,qwen2-0.5b (CPU default: tiny)")
    parser.add_argument("--modes", default=",".join(MODES), help="single,split,parallel")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per run")
    parser.add_argument("--prompts", type=int, default=32, help="prompts per step")
    parser.add_argument("--group", type=int, default=8, help="completions per prompt")
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens per completion")
    parser.add_argument("--micro-batch-size", type=int, default=16, help="sequences per pass")
    parser.add_argument("--budget-s", type=float, default=420, help="stop starting runs after")
    parser.add_argument("--out", default=None, help="JSON path")
    parser.add_argument("--run-one", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run_one:
        spec_path, result_path = args.run_one
        spec = json.loads(Path(spec_path).read_text())
        checks = {"check_split": check_split, "check_parallel": check_parallel}
        if spec["mode"] in checks:
            result = checks[spec["mode"]](spec["model_path"], spec["device"])
        else:
            result = run_one(spec)
        Path(result_path).write_text(json.dumps(result))
        return result

    started = time.monotonic()
    # A rank whose peer died gives up after this, not after the default half hour.
    os.environ.setdefault("RLCORE_DIST_TIMEOUT_S", "180")
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "none"
    if device != "cpu":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count < 2:
            print(
                f"multi_gpu: needs two CUDA GPUs, torch sees {count}; nothing measured "
                "(run with --device cpu for a smoke check of the same code on the CPU)"
            )
            sys.exit(NO_TWO_GPUS)
        device = "cuda"
        # No NVLink multicast: on the lent machines it can take shared GPUs out of service.
        for name, value in MULTICAST_OFF.items():
            os.environ.setdefault(name, value)
        cards = [torch.cuda.get_device_name(i) for i in range(count)]
    else:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        cards = [f"CPU ({platform.processor() or platform.machine()}), {os.cpu_count()} cores"]
    models = (args.models or ("tiny,qwen2-0.5b" if device == "cuda" else "tiny")).split(",")
    modes = args.modes.split(",")
    card_text = " + ".join(cards)
    print(f"multi_gpu: {device}: {card_text}; torch {torch.__version__}", flush=True)
    results = {
        "benchmark": "multi_gpu",
        "device": device,
        "cards": cards,
        "torch": torch.__version__,
        "task": {
            "env": "reverse_text",
            "prompts": args.prompts,
            "group": args.group,
            "max_tokens": args.max_tokens,
            "micro_batch_size": args.micro_batch_size,
            "loss": "grpo, beta 0.04",
            "steps": args.steps,
        },
        "rows": [],
    }
    with tempfile.TemporaryDirectory() as scratch:
        for name in models:
            path = build_model(name, device, Path(scratch))
            for mode in ("split", "parallel"):
                if name != "tiny" or mode not in modes:
                    continue
                spec = {"mode": f"check_{mode}", "device": device, "model_path": path}
                left = args.budget_s - (time.monotonic() - started)
                results[f"{mode}_check"] = check = run_child(spec, min(120, left))
                verdict = "ok" if check.get("ok") else "FAILED"
                print(f"  {mode} check ({name}): {verdict}: {check}", flush=True)
            for mode in modes:
                left = args.budget_s - (time.monotonic() - started)
                if left < 20:
                    row = {"error": f"not run: {args.budget_s:.0f} s budget spent"}
                else:
                    spec = {
                        "mode": mode,
                        "device": device,
                        "model_path": path,
                        "steps": args.steps,
                        "prompts": args.prompts,
                        "group": args.group,
                        "max_tokens": args.max_tokens,
                        "micro_batch_size": args.micro_batch_size,
                    }
                    row = run_child(spec, left)
                row = {"model": name, "mode": mode} | row
                results["rows"].append(row)
                summary = row.get("error") or f"{row['step']:.3f} s/step"
                print(f"  {name} {mode}: {summary}", flush=True)
                if "error" in row and row.get("log"):
                    print(row["log"], flush=True)
                write_results(results, args.out, "multi_gpu.json")
    print_table(results["rows"], card_text)
    checks = [results[key] for key in ("split_check", "parallel_check") if key in results]
    if any("error" in row for row in results["rows"]) or not all(c.get("ok") for c in checks):
        sys.exit(1)
    return results


if __name__ == "__main__":
    main()
