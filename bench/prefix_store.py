"""Host milliseconds of the engine's prefix store over a large tic-tac-toe step's turns: every
round's prompts looked up, then every row's prompt and reply stored, as the engine does at
1,024 games a step.

    python bench/prefix_store.py [--games 1024] [--repeats 15] [--before DIR]

The conversations are synthetic but shaped like the recipe's (round 60's player, the
character tokenizer): groups of 8 games share their first prompt (~170 tokens), each turn adds a
5-token reply and a ~40-token board message, games end after 1-6 turns (most rows in the
first rounds). Figures are the best of `--repeats` runs of the whole step, each on a fresh
store. With `--before DIR` (a `git worktree` of an earlier commit) the store of DIR's
`rlcore/policy/kv_cache.py` runs the same turns, interleaved run by run, and the table
puts the two side by side; both must find the same hits and reuse the same tokens.
Writes bench/results/prefix_store.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchlib import machine, write_results  # noqa: E402

from rlcore.policy import kv_cache  # noqa: E402

GROUP = 8


def conversations(games: int, seed: int = 0) -> list[list[tuple[list[int], list[int]]]]:
    """Per round, each live game's (prompt, prompt + reply)."""
    rng = random.Random(seed)
    rounds: list[list[tuple[list[int], list[int]]]] = [[] for _ in range(6)]
    for _ in range(games // GROUP):
        opening = [rng.randrange(290) for _ in range(170)]
        for _ in range(GROUP):
            prompt = list(opening)
            for turn in range(rng.choice((1, 2, 3, 3, 4, 4, 5, 6))):
                reply = [rng.randrange(290) for _ in range(5)]
                rounds[turn].append((prompt, prompt + reply))
                prompt = prompt + reply + [rng.randrange(290) for _ in range(40)]
    return [r for r in rounds if r]


def one_step(module, rounds) -> tuple[float, int, int]:
    store = module.PrefixCache()
    store.version = ()
    batched = hasattr(store, "lookup_many")
    started = time.perf_counter()
    for rows in rounds:
        prompts = [prompt for prompt, _ in rows]
        if batched:
            store.lookup_many(prompts)
            store.add_many([full[:-1] for _, full in rows], [None] * len(rows), [1] * len(rows))
        else:
            for prompt in prompts:
                store.lookup(prompt)
            for _, full in rows:
                store.add(full[:-1], None, nbytes=1)
    return time.perf_counter() - started, store.hits, store.tokens_reused


def load_before(tree: Path):
    spec = importlib.util.spec_from_file_location(
        "kv_cache_before", tree / "rlcore" / "policy" / "kv_cache.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--games", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--before", type=Path, default=None, help="an earlier commit's tree")
    parser.add_argument("--out", default=None, help="JSON path")
    args = parser.parse_args()
    rounds = conversations(args.games)
    sides = {"after": kv_cache}
    if args.before is not None:
        sides = {"before": load_before(args.before), **sides}
    best = dict.fromkeys(sides, float("inf"))
    found = {}
    for _ in range(args.repeats):
        for name, module in sides.items():
            seconds, hits, reused = one_step(module, rounds)
            best[name] = min(best[name], seconds)
            found[name] = (hits, reused)
    if len(set(found.values())) != 1:
        raise SystemExit(f"the stores found different prefixes: {found}")
    rows = sum(len(r) for r in rounds)
    hits, reused = next(iter(found.values()))
    print(f"prefix store, {args.games} games, {rows} rows in {len(rounds)} rounds, {hits} hits")
    print(f"{'side':<8} {'ms a step':>10} {'us a row':>9}")
    for name, seconds in best.items():
        print(f"{name:<8} {1000 * seconds:>10.1f} {1e6 * seconds / rows:>9.1f}")
    if "before" in best:
        print(f"before / after: {best['before'] / best['after']:.2f}x")
    write_results(
        {
            "benchmark": "prefix_store",
            "machine": machine(),
            "games": args.games,
            "rows": rows,
            "hits": hits,
            "tokens_reused": reused,
            "repeats": args.repeats,
            "best_seconds": best,
        },
        args.out,
        "prefix_store.json",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
