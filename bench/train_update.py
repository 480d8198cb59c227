"""Seconds per RL update (`update_policy`) alone, on batches whose lengths repeat or change:
what the training step costs on a device once rollouts are done.

    python bench/train_update.py [--device auto] [--model tiny] [--sequences 384]
        [--micro-batch-size 128] [--lengths 150-650] [--judged 0] [--compile off|on|both]
        [--out PATH]

Synthetic all-trained sequences of 150-650 tokens (a 100-token prompt, the rest trained,
advantage +-1) on the built-in tiny model, the trainer's settings otherwise. Batch A is
updated on three times, then batches B, C, D with new random lengths, then D again: on a
GPU the first sight of a batch shape pays its kernels' set-up, so "again" rows show the
steady cost and "new" rows what a real step (new lengths every time) pays. The first A
also pays the process's CUDA set-up (and, compiled, the compile). Prints one line per
update. `--compile both` runs the schedule eagerly and then compiled (`RLConfig.compile`,
CUDA only), each from the model's saved weights, and compares the steady ("again") updates
and the logprobs of batch A's first micro-batch under the same weights. `--judged N` gives
each sequence N judged moves (the sound-mass term's), as the tic-tac-toe recipes train.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from benchlib import write_results  # noqa: E402

from rlcore.train.common import (  # noqa: E402
    autocast,
    build_optimizer,
    load_model_and_tokenizer,
    model_path,
)
from rlcore.train.config import RLConfig, load_config  # noqa: E402
from rlcore.train.grpo import (  # noqa: E402
    Learner,
    training_pass,
    update_policy,
)
from rlcore.train.sequences import TrainingSequence, collate, micro_batches  # noqa: E402

PROMPT = 100
SCHEDULE = [("A", 1), ("A again", 1), ("A again", 1), ("B new", 2), ("C new", 3),
            ("D new", 4), ("D again", 4)]  # fmt: skip


def synthetic_batch(
    seed: int, count: int, vocabulary: int, lengths=(150, 650), judged: int = 0
) -> list[TrainingSequence]:
    draw = random.Random(seed)
    batch = []
    for index in range(count):
        length = draw.randint(*lengths)
        prompt = min(PROMPT, length // 2)
        trained = length - prompt
        batch.append(
            TrainingSequence(
                input_ids=[draw.randrange(vocabulary) for _ in range(length)],
                weights=[0.0] * prompt + [1.0 / trained] * trained,
                advantages=[0.0] * prompt + [1.0 if index % 2 else -1.0] * trained,
                sampled_logprobs=[0.0] * length,
                move_sets=[
                    (draw.randrange(prompt, length - 1), draw.sample(range(vocabulary), 2))
                    for _ in range(judged)
                ],
            )
        )
    return batch


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda")
    parser.add_argument("--model", default="tiny", help="the policy (tiny, tiny-master, a path)")
    parser.add_argument("--sequences", type=int, default=384)
    parser.add_argument("--micro-batch-size", type=int, default=128)
    parser.add_argument("--lengths", default="150-650", help="sequence lengths, MIN-MAX tokens")
    parser.add_argument("--judged", type=int, default=0, help="judged moves a sequence")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument(
        "--compile",
        default="off",
        choices=["off", "on", "both"],
        help="RLConfig.compile (CUDA only); both: eager, then compiled, on the same batches",
    )
    parser.add_argument("--out", default=None, help="JSON path (default: none written)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    name = (
        args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    )
    device = torch.device(name)
    shortest, longest = (int(n) for n in args.lengths.split("-"))
    card = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.compile]
    rows, first_logprobs = [], {}
    for compiled in modes:
        with tempfile.TemporaryDirectory() as output_dir:
            cfg = load_config(
                RLConfig,
                None,
                ["env=tictactoe", f"micro_batch_size={args.micro_batch_size}",
                 f"output_dir={output_dir}", f"device={name}", f"compile={str(compiled).lower()}",
                 "sound_mass_weight=1.0"],
            )  # fmt: skip
        model, tokenizer = load_model_and_tokenizer(model_path(args.model), device)
        model.eval()
        optimizer, scheduler = build_optimizer(model, cfg.optimizer, len(SCHEDULE))
        learner = Learner(
            model, None, optimizer, scheduler, tokenizer.pad_token_id, device, lambda: False
        )
        mode = "compiled" if compiled and device.type == "cuda" else "eager"
        for label, seed in SCHEDULE:
            batch = synthetic_batch(
                seed, args.sequences, len(tokenizer) - 1, (shortest, longest), args.judged
            )
            if label == "A":  # the same weights in both modes: their logprobs compare
                first_logprobs[mode] = first_pass(learner, batch, cfg)
            if device.type == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
            update_policy(learner, batch, normalizer=1000.0, cfg=cfg)
            if device.type == "cuda":
                torch.cuda.synchronize()
            rows.append({"mode": mode, "batch": label, "seconds": time.perf_counter() - started})
            print(f"{card}  {mode:<8} {label:<8} {rows[-1]['seconds']:.3f} s", flush=True)
    steady = {
        mode: statistics.median(r["seconds"] for r in rows if r["mode"] == mode and "again" in r["batch"])
        for mode in {r["mode"] for r in rows}
    }  # fmt: skip
    results = {
        "benchmark": "train_update",
        "card": card,
        "model": args.model,
        "settings": vars(args),
        "rows": rows,
        "steady_seconds": steady,
    }
    if len(first_logprobs) == 2:
        eager, fused = first_logprobs["eager"], first_logprobs["compiled"]
        results["compiled_vs_eager"] = {
            "speedup": steady["eager"] / steady["compiled"],
            "max_logprob_gap": (eager - fused).abs().max().item(),
            "mean_logprob_gap": (eager - fused).abs().mean().item(),
        }
        gap = results["compiled_vs_eager"]
        print(
            f"\n{card}: steady update eager {steady['eager']:.3f} s, compiled "
            f"{steady['compiled']:.3f} s ({gap['speedup']:.2f}x); logprobs of batch A, largest "
            f"gap {gap['max_logprob_gap']:.2e}, mean {gap['mean_logprob_gap']:.2e}"
        )
    if args.out:
        write_results(results, args.out, "")
    return results


@torch.no_grad()
def first_pass(learner, batch, cfg) -> torch.Tensor:
    """The trained tokens' logprobs of `batch`'s first micro-batch under the current
    weights, by the pass the update takes (`grpo.training_pass`: compiled or eager)."""
    chunk = micro_batches(batch, cfg.micro_batch_size)[0]
    input_ids, _, weights, _ = collate(chunk, learner.pad_id, learner.device)
    forward = training_pass(cfg, learner.device)
    with autocast(learner.device):
        logprobs, *_ = forward(learner.model, input_ids, cfg.sampling.temperature, True, None)
    return logprobs.float()[weights > 0].cpu()


if __name__ == "__main__":
    main()
