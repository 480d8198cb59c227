"""Diagnostic: can the tiny model represent master play at all, and from how many games?

Not the mastery benchmark (whose teacher may be no stronger than random): here the model is
fine-tuned on games of a chosen teacher, the oracle included, then evaluated like
`bench/tictactoe_mastery.py` (greedy games against a random and an optimal opponent). With
the oracle as teacher the result is a ceiling for what SFT-sized training can put into a
model of this size; if even that ceiling is far from the mastery targets, RL on the same
model and budget cannot reach them either, and the size or the data is what limits it.

    python bench/tictactoe_capacity.py --teacher oracle --games 200
    python bench/tictactoe_capacity.py --teacher oracle --games 2000 --hidden-size 256

Prints one table (SFT stage, both opponents) and writes `--results` (JSON, the mastery
benchmark's per-opponent fields plus the SFT wall time and the checkpoint).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
from tictactoe_mastery import (  # noqa: E402
    add_output_args,
    evaluate,
    format_table,
    teacher_games,
    warm_up,
)

from rlcore.envs.tictactoe_game import REASONING_FORMATS  # noqa: E402
from rlcore.policy.tiny import ensure_tiny_model  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--teacher", default="oracle", choices=["oracle", "random"])
    parser.add_argument("--games", type=int, default=200, help="teacher games kept for SFT")
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--reasoning", default="empty", choices=REASONING_FORMATS)
    parser.add_argument("--eval-games", type=int, default=1000)
    parser.add_argument("--eval-concurrency", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-turns", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    add_output_args(parser, "tictactoe_capacity")
    args = parser.parse_args(argv)
    out = Path(args.out)
    base = ensure_tiny_model(hidden_size=args.hidden_size, num_layers=args.num_layers)
    env_args = {"max_turns": args.max_turns, "num_groups": 4, "reasoning": args.reasoning}

    started = time.monotonic()
    synth = teacher_games(args.teacher, args.games, env_args, out / "synth")
    sft_dir = warm_up(
        base, synth["path"], out / "sft", args.epochs, args, batch=args.batch, lr=args.lr
    )
    sft_seconds = time.monotonic() - started
    results = {"sft": evaluate(sft_dir, args.eval_games, args, "sft")}
    report = {
        "benchmark": "tictactoe_capacity",
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        },
        "args": vars(args),
        "synth": {k: v for k, v in synth.items() if k != "path"} | {"path": synth["path"]},
        "stages": results,
        "wall_seconds": {"synth_and_sft": round(sft_seconds, 1)},
        "checkpoints": {"base": base, "sft": sft_dir},
    }
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    Path(args.results).write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(format_table(results, {"synth_and_sft": sft_seconds}))
    print(f"\nresults: {args.results}\nSFT checkpoint: {sft_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
