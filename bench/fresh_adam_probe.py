"""Diagnostic: does one optimizer step at a high learning rate break a fine-tuned model
because of the data, or because the optimizer starts fresh?

Takes an SFT checkpoint of the tiny model and its own training data, and compares one
AdamW step on the same batch of that data, at the same learning rate, from
1. a fresh optimizer (its first step moves every weight by the full rate, in the sign of
   its gradient), and
2. an optimizer whose moment estimates were first filled by `--warm-batches` batches of the
   same data at learning rate 0 (no weight moves), as they would be in a run that trained
   on it all along,
with the untouched checkpoint as the baseline, and
3. a fresh optimizer that goes on training on the data for `--more-steps` more steps at
   the same rate (SFT going on: does its consistent gradient repair the first step?).
Each is evaluated like
`bench/tictactoe_mastery.py` against the random opponent (greedy). Without `--model` the
mastery benchmark's synth and SFT stages make the checkpoint first.

    python bench/fresh_adam_probe.py --model runs/tictactoe_tiny/sft/final \
        --dataset runs/tictactoe_tiny/synth/dataset.jsonl

Prints one table and writes `--results` (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
from tictactoe_mastery import add_output_args, evaluate, teacher_games, warm_up  # noqa: E402

from rlcore.policy.tiny import ensure_tiny_model  # noqa: E402
from rlcore.train.common import (  # noqa: E402
    clip_gradients,
    load_model_and_tokenizer,
    resolve_device,
    save_checkpoint,
)
from rlcore.train.config import OptimizerConfig, SFTConfig  # noqa: E402
from rlcore.train.sft import assistant_loss, build_sft_example, load_sft_dataset  # noqa: E402


def batch_loss(model, tokenizer, examples, device) -> torch.Tensor:
    """Mean cross-entropy over the assistant tokens of `examples`, as SFT computes it."""
    masked = sum(sum(mask) for _, mask in examples)
    return assistant_loss(model, examples, tokenizer.pad_token_id, device, masked)


def one_step(
    checkpoint, examples, probe, args, warm_batches: int, out: Path, more_steps: int = 0
) -> str:
    """The checkpoint after one AdamW step at `args.lr` on `probe`, the optimizer's moments
    first filled by `warm_batches` batches at learning rate 0, then `more_steps` further
    steps at `args.lr` on random batches of the data (SFT going on); saved to `out`."""
    device = resolve_device(args.device)
    model, tokenizer = load_model_and_tokenizer(checkpoint, device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0, weight_decay=0.0)
    rng = random.Random(args.seed)
    for _ in range(warm_batches):
        batch_loss(model, tokenizer, rng.sample(examples, args.batch_size), device).backward()
        clip_gradients(model, 1.0)
        optimizer.step()  # lr 0: the moments update, no weight moves
        optimizer.zero_grad(set_to_none=True)
    for group in optimizer.param_groups:
        group["lr"] = args.lr
    for index in range(1 + more_steps):
        batch = probe if index == 0 else rng.sample(examples, args.batch_size)
        batch_loss(model, tokenizer, batch, device).backward()
        clip_gradients(model, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    model.eval()
    step = SFTConfig(
        model=checkpoint,
        dataset=args.dataset,
        output_dir=str(out),
        max_steps=1 + more_steps,
        batch_size=args.batch_size,
        micro_batch_size=args.batch_size,
        optimizer=OptimizerConfig(lr=args.lr, lr_schedule="constant"),
        seed=args.seed,
    )
    return save_checkpoint(model, tokenizer, step, out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="SFT checkpoint (default: make one as the benchmark does)")
    parser.add_argument("--dataset", help="its SFT data (JSONL); needed with --model")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warm-batches", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument(
        "--more-steps",
        type=int,
        default=19,
        help="the last variant goes on training on the data this many steps after the first",
    )
    parser.add_argument("--games", type=int, default=300, help="greedy games vs random")
    parser.add_argument("--seed", type=int, default=0)
    add_output_args(parser, "fresh_adam_probe")
    args = parser.parse_args(argv)
    if bool(args.model) != bool(args.dataset):
        parser.error("--model and --dataset go together")
    out = Path(args.out)
    # What `evaluate` reads of the benchmark's arguments.
    args.max_turns, args.reasoning, args.max_tokens, args.eval_concurrency = 6, "empty", 64, 256
    args.sft_epochs, args.hidden_size, args.num_layers = 40, 128, 4
    if not args.model:
        env_args = {"max_turns": args.max_turns, "num_groups": 4, "reasoning": args.reasoning}
        synth = teacher_games("random", 200, env_args, out / "synth")
        args.dataset = synth["path"]
        args.model = warm_up(ensure_tiny_model(), args.dataset, out / "sft", 40, args)

    _, tokenizer = load_model_and_tokenizer(args.model, torch.device("cpu"))
    examples = [build_sft_example(tokenizer, m, 1024) for m in load_sft_dataset(args.dataset)]
    probe = random.Random(args.seed + 1).sample(examples, args.batch_size)
    variants = {
        "no step (the SFT checkpoint)": args.model,
        f"fresh AdamW, 1 step at lr {args.lr:g}": one_step(
            args.model, examples, probe, args, 0, out / "fresh"
        ),
        f"AdamW warmed by {args.warm_batches} batches, 1 step at lr {args.lr:g}": one_step(
            args.model, examples, probe, args, args.warm_batches, out / "warmed"
        ),
        f"fresh AdamW, {1 + args.more_steps} steps at lr {args.lr:g}": one_step(
            args.model, examples, probe, args, 0, out / "more", args.more_steps
        ),
    }
    rows = {}
    for label, checkpoint in variants.items():
        args.out = str(out / "eval" / str(len(rows)))
        rows[label] = evaluate(checkpoint, args.games, args, f"v{len(rows)}", ("random",))["random"]
        rows[label]["checkpoint"] = str(checkpoint)

    print(f"\n{'variant':<52} {'win':>6} {'loss':>6} {'unfin':>6} {'invalid':>8} {'sound':>6}")
    for label, row in rows.items():
        print(
            f"{label:<52} {row['win']:>6.1%} {row['loss']:>6.1%} {row['unfinished']:>6.1%} "
            f"{row['invalid_move_rate']:>8.2%} {row['sound_move_rate']:>6.1%}"
        )
    results = {
        "benchmark": "fresh_adam_probe",
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
        },
        "args": {k: v for k, v in vars(args).items() if k != "out"},
        "variants": rows,
    }
    # Paths inside the repository are written relative to it, as the other results are.
    text = json.dumps(results, indent=1).replace(str(ROOT) + "/", "")
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    Path(args.results).write_text(text + "\n")
    print(f"\nresults: {args.results}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
