"""Seconds per RL update (`update_policy`) alone, on batches whose lengths repeat or change:
what the training step costs on a device once rollouts are done.

    python bench/train_update.py [--device auto] [--sequences 384] [--micro-batch-size 128]

Synthetic all-trained sequences of 150-650 tokens (a 100-token prompt, the rest trained,
advantage +-1) on the built-in tiny model, the trainer's settings otherwise. Batch A is
updated on three times, then batches B, C, D with new random lengths, then D again: on a
GPU the first sight of a batch shape pays its kernels' set-up, so "again" rows show the
steady cost and "new" rows what a real step (new lengths every time) pays. The first A
also pays the process's CUDA set-up. Prints one line per update.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from rlcore.train.common import build_optimizer, load_model_and_tokenizer  # noqa: E402
from rlcore.train.config import RLConfig, load_config  # noqa: E402
from rlcore.train.grpo import Learner, update_policy  # noqa: E402
from rlcore.train.sequences import TrainingSequence  # noqa: E402

PROMPT = 100
SCHEDULE = [("A", 1), ("A again", 1), ("A again", 1), ("B new", 2), ("C new", 3),
            ("D new", 4), ("D again", 4)]  # fmt: skip


def synthetic_batch(seed: int, count: int, vocabulary: int) -> list[TrainingSequence]:
    draw = random.Random(seed)
    batch = []
    for index in range(count):
        length = draw.randint(150, 650)
        trained = length - PROMPT
        batch.append(
            TrainingSequence(
                input_ids=[draw.randrange(vocabulary) for _ in range(length)],
                weights=[0.0] * PROMPT + [1.0 / trained] * trained,
                advantages=[0.0] * PROMPT + [1.0 if index % 2 else -1.0] * trained,
                sampled_logprobs=[0.0] * length,
            )
        )
    return batch


def main(argv: list[str] | None = None) -> list[tuple[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda")
    parser.add_argument("--sequences", type=int, default=384)
    parser.add_argument("--micro-batch-size", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    name = (
        args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    )
    device = torch.device(name)
    with tempfile.TemporaryDirectory() as output_dir:
        cfg = load_config(
            RLConfig,
            None,
            ["model=tiny", "env=tictactoe", f"micro_batch_size={args.micro_batch_size}",
             f"output_dir={output_dir}", f"device={name}"],
        )  # fmt: skip
    model, tokenizer = load_model_and_tokenizer(cfg.model, device)
    model.eval()
    optimizer, scheduler = build_optimizer(model, cfg.optimizer, len(SCHEDULE))
    learner = Learner(
        model, None, optimizer, scheduler, tokenizer.pad_token_id, device, lambda: False
    )
    card = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    timings = []
    for label, seed in SCHEDULE:
        batch = synthetic_batch(seed, args.sequences, len(tokenizer) - 1)
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        update_policy(learner, batch, normalizer=1000.0, cfg=cfg)
        if device.type == "cuda":
            torch.cuda.synchronize()
        timings.append((label, time.perf_counter() - started))
        print(f"{card}  {label:<8} {timings[-1][1]:.3f} s", flush=True)
    return timings


if __name__ == "__main__":
    main()
