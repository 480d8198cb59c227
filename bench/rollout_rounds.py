"""A rank's tic-tac-toe rollout batch by batch: how many engine batches a step takes, what
each costs, and how much of the rollout is the event loop's own work (the env's turns, the
prompts, the rollouts' bookkeeping) rather than the engine's.

    python bench/rollout_rounds.py [--device auto] [--games 16,64,256] [--steps 10]
        [--warmup 3] [--recipe recipes/tictactoe_tiny/rl_gpu.toml] [--model tiny-master]
        [--out PATH]

Each size plays `--steps` batches of the recipe's games (its env args, self-play included)
with `--model` through the local engine with its default batch bound (on a GPU every
concurrent turn in one batch, so a batch is a round of the games; on the CPU batches of 64),
as one rank of `run_rl` rolls out its share (no update between steps; the first `--warmup`
steps are not counted). The engine's batch call and its parts (tokenizing, the decode loop,
decoding the replies) are timed from outside, so the code measured is the shipped code.
`outside` is the rollout's wall time less the engine's batch calls: the event loop's work
between batches, which grows with the games while a batch's fixed cost does not. Writes
bench/results/rollout_rounds_<device>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from benchlib import machine, recipe_rollouts, write_results  # noqa: E402

from rlcore.envs.registry import load_environment  # noqa: E402
from rlcore.policy.local import LocalEngine  # noqa: E402
from rlcore.train.common import load_model_and_tokenizer  # noqa: E402
from rlcore.train.config import RLConfig, load_config  # noqa: E402
from rlcore.train.sampling import StratifiedSampler  # noqa: E402


class Clock:
    """Seconds spent in the wrapped callables, by name."""

    def __init__(self) -> None:
        self.seconds: Counter = Counter()

    def wrap(self, owner, attribute: str, name: str) -> None:
        inner = getattr(owner, attribute)

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - started

        setattr(owner, attribute, timed)


def run_size(args: argparse.Namespace, games: int) -> dict:
    overrides = [f"model={args.model}", f"batch_size={games}", f"device={args.device}"]
    cfg = load_config(RLConfig, args.recipe, [*overrides, "output_dir=runs/bench/rounds"])
    env = load_environment(cfg.env, **cfg.env_args)
    model, tokenizer = load_model_and_tokenizer(cfg.model, torch.device(args.device))
    model.eval()
    engine = LocalEngine(None, model=model, tokenizer=tokenizer, name="policy")
    sampler = StratifiedSampler(env, cfg.seed, games // cfg.rollouts_per_example)
    clock, batches = Clock(), []
    batch_call = engine._run_batch

    def timed_batch(batch):
        started = time.perf_counter()
        try:
            return batch_call(batch)
        finally:
            batches.append((time.perf_counter() - started, len(batch)))

    engine._run_batch = timed_batch
    clock.wrap(engine._prompt_tokenizer, "encode", "tokenize")
    clock.wrap(engine, "_sample", "decode loop")
    clock.wrap(engine, "_decode_replies", "reply texts")
    loop = asyncio.new_event_loop()
    steps = []
    for index in range(args.warmup + args.steps):
        batches.clear()
        clock.seconds.clear()
        started = time.perf_counter()
        recipe_rollouts(loop, env, engine, sampler.next_batch(), cfg, games)
        wall = time.perf_counter() - started
        if index < args.warmup:
            continue
        in_batches = sum(seconds for seconds, _ in batches)
        steps.append(
            {
                "rollout": wall,
                "batches": len(batches),
                "batch_ms": [1000 * seconds for seconds, _ in batches],
                "batch_rows": [rows for _, rows in batches],
                "outside": wall - in_batches,
                **{name: seconds for name, seconds in clock.seconds.items()},
            }
        )
    loop.run_until_complete(engine.aclose())
    loop.close()
    every_batch = [ms for step in steps for ms in step["batch_ms"]]
    return {
        "games": games,
        "decode": engine.decode,
        "rollout_s": statistics.median(s["rollout"] for s in steps),
        "batches": statistics.fmean(s["batches"] for s in steps),
        "batch_ms_median": statistics.median(every_batch),
        "batch_ms_min": min(every_batch),
        "batch_ms_max": max(every_batch),
        "outside_s": statistics.median(s["outside"] for s in steps),
        "parts_s": {
            name: statistics.median(s.get(name, 0.0) for s in steps)
            for name in ("tokenize", "decode loop", "reply texts")
        },
        "steps": steps,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--games", default="16,64,256")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--recipe", default="recipes/tictactoe_tiny/rl_gpu.toml")
    parser.add_argument("--model", default="tiny-master")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    card = torch.cuda.get_device_name() if args.device.startswith("cuda") else machine()
    rows = []
    for games in (int(g) for g in args.games.split(",")):
        rows.append(run_size(args, games))
        print(f"  {games} games: {rows[-1]['rollout_s']:.3f} s a rollout", flush=True)
    print(f"\na rank's rollout by engine batches, {args.model}, {args.recipe}, {args.device}")
    print(
        f"{'card':<24} {'games':>5} {'decode':>7} {'rollout s':>9} {'batches':>7} "
        f"{'ms a batch (min-median-max)':>27} {'outside s':>9} {'tokenize s':>10} "
        f"{'decode loop s':>13} {'reply texts s':>13}"
    )
    for r in rows:
        span = f"{r['batch_ms_min']:.1f}-{r['batch_ms_median']:.1f}-{r['batch_ms_max']:.1f}"
        parts = r["parts_s"]
        print(
            f"{card[:24]:<24} {r['games']:>5} {r['decode']:>7} {r['rollout_s']:>9.3f} "
            f"{r['batches']:>7.1f} {span:>27} {r['outside_s']:>9.3f} {parts['tokenize']:>10.3f} "
            f"{parts['decode loop']:>13.3f} {parts['reply texts']:>13.3f}"
        )
    results = {
        "benchmark": "rollout_rounds",
        "card": card,
        "device": args.device,
        "model": args.model,
        "recipe": args.recipe,
        "rows": rows,
    }
    return write_results(results, args.out, f"rollout_rounds_{args.device.split(':')[0]}.json")


if __name__ == "__main__":
    main()
