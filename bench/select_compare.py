"""The choice among a run's saves by validation games (RL's `select`) against a choice by
their exact validation, on the same saves: which save each rule picks and how far apart
their scores stand.

    python bench/select_compare.py RUN/rl [--games 500] [--seed 20000] [--device cpu]
        [--out PATH]

RUN/rl is a tic-tac-toe RL run's output directory with a `select.json` (a run with
`select.keep` > 1; its candidate saves still there). Each candidate is scored by the choice
rule twice: on the env's validation games (`--games` per set, greedy, on the validation
seed, played by `select`'s own `game_summary`) and exactly (`Environment.exact_validation`:
the player asked at every history a full game reaches, the random and the perfect
opponent's trees walked; rlcore/envs/tictactoe_exact.py). Prints both scores per save and each rule's pick with its
exact score: the true score the games' noise gives up where the picks differ.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchlib import write_results  # noqa: E402

from rlcore.envs import load_environment  # noqa: E402
from rlcore.policy import load_policy  # noqa: E402
from rlcore.train.config import RLConfig, build_config  # noqa: E402
from rlcore.train.select import game_summary, score  # noqa: E402

KEPT = ("outcome/win", "outcome/draw", "outcome/loss", "tictactoe/invalid_move_rate")


def exact_summaries(env, path: Path, cfg: RLConfig) -> dict[str, dict]:
    """The save at `path` by the env's exact validation."""
    policy = load_policy(
        str(path), env=env, device=cfg.device, concurrency=cfg.sampling.concurrency
    )

    async def walk() -> dict[str, dict]:
        try:
            return await env.exact_validation(policy, cfg.sampling.max_tokens)
        finally:
            await policy.aclose()

    return asyncio.run(walk())


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", help="the RL run's output directory (select.json, config.json)")
    parser.add_argument("--games", type=int, default=500, help="validation games per set")
    parser.add_argument("--seed", type=int, default=20_000, help="the validation games' seed")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default=None, help="JSON path (default: none written)")
    args = parser.parse_args(argv)
    run = Path(args.run)
    record = json.loads((run / "select.json").read_text())
    if not record.get("candidates"):
        parser.error(f"{run / 'select.json'} has no candidates (a run with select.keep > 1)")
    saved = json.loads((run / "config.json").read_text())
    games = {"select": {"num_examples": args.games, "seed": args.seed}, "device": args.device}
    cfg = build_config(RLConfig, [(str(run / "config.json"), saved), ("select_compare", games)])
    env = load_environment(cfg.env, **cfg.env_args)
    validation = env.validation()
    rows = {}
    for name, candidate in record["candidates"].items():
        summaries = {part.name: game_summary(run / name, part, cfg) for part in validation}
        exact = exact_summaries(env, run / name, cfg)
        rows[name] = {
            "step": candidate["step"],
            "exact": score(exact, validation),
            "games": score(summaries, validation),
            "exact_metrics": exact,
            "games_metrics": {
                part: {key: value for key, value in metrics.items() if key in KEPT}
                for part, metrics in summaries.items()
            },
        }
    by_exact = max(rows, key=lambda name: (rows[name]["exact"], rows[name]["step"]))
    by_games = max(rows, key=lambda name: (rows[name]["games"], rows[name]["step"]))
    print(f"{'save':<14} {'step':>6} {'exact':>8} {'games':>8} {'games - exact':>14}")
    for name, row in rows.items():
        gap = row["games"] - row["exact"]
        print(f"{name:<14} {row['step']:>6} {row['exact']:>8.4f} {row['games']:>8.4f} {gap:>14.4f}")
    given_up = rows[by_exact]["exact"] - rows[by_games]["exact"]
    print(
        f"exact picks {by_exact} ({rows[by_exact]['exact']:.4f}); games pick {by_games} "
        f"(exact {rows[by_games]['exact']:.4f}): {given_up:.4f} of true score given up"
    )
    results = {
        "command": "python bench/select_compare.py " + " ".join(argv or sys.argv[1:]),
        "run": str(run),
        "games": args.games,
        "seed": args.seed,
        "candidates": rows,
        "by_exact": by_exact,
        "by_games": by_games,
        "given_up": given_up,
    }
    if args.out:
        write_results(results, args.out, "")
    return results


if __name__ == "__main__":
    main()
