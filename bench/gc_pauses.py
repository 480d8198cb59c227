"""The garbage collector's pauses in an RL run, with the run's setup frozen out of its full
collections (`rlcore.rollout.frozen_heap`, what `run_rl` does) and without (the control),
side by side on one machine.

    python bench/gc_pauses.py [--device cpu] [--games 256] [--steps 30] [--repeats 2]
        [--recipe recipes/tictactoe_tiny/rl_gpu.toml] [--model tiny-master] [--out PATH]

Each run is a real `run_rl` of the recipe (one process, no actors, no saves) in a child
process of its own; the runs alternate, frozen then control, `--repeats` times. A run records
every collection the steps made (the collector's callbacks: generation, milliseconds) from
its first step's metrics on, so the setup's own collections are left out, and each step's
`perf/step_seconds`. A full (generation 2) collection walks every tracked object; a run
whose setup left hundreds of thousands of them pays for them at each full collection,
which comes every few steps and lands inside one step: the median step hides it, the mean
does not. Writes bench/results/gc_pauses_<device>.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchlib import machine, write_results  # noqa: E402


def child(args: argparse.Namespace) -> None:
    """One run; prints its figures as one JSON line."""
    import rlcore.rollout as rollout
    from rlcore.events import NullSink
    from rlcore.train.config import RLConfig, load_config
    from rlcore.train.grpo import run_rl

    if args.variant == "control":  # the collector as it was: nothing frozen
        rollout.frozen_heap.freeze = rollout.frozen_heap.thaw = lambda: None
    collections: list[tuple[int, float]] = []
    steps: list[float] = []
    started = [0.0]

    def note(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        elif steps:  # from the first step's metrics on
            collections.append((info["generation"], time.perf_counter() - started[0]))

    class Sink(NullSink):
        def metric(self, step: int, values: dict[str, float]) -> None:
            steps.append(values["perf/step_seconds"])

    gc.callbacks.append(note)
    with tempfile.TemporaryDirectory() as out:
        overrides = [
            f"model={args.model}", f"batch_size={args.games}", f"concurrency={args.games}",
            f"device={args.device}", f"output_dir={out}", f"max_steps={args.steps + 1}",
            "save_every=0", "select.keep=1", "select.average=0", "actors=0", "processes=1",
        ]  # fmt: skip
        run_rl(load_config(RLConfig, args.recipe, overrides), sink=Sink())
    timed = steps[1:]  # the first step pays the engine's and the allocator's first use
    full = [seconds for generation, seconds in collections if generation == 2]
    print(
        json.dumps(
            {
                "variant": args.variant,
                "steps": len(timed),
                "mean_step_s": statistics.fmean(timed),
                "median_step_s": statistics.median(timed),
                "max_step_s": max(timed),
                "collections": [sum(g == n for g, _ in collections) for n in range(3)],
                "collection_ms": [
                    1000 * sum(s for g, s in collections if g == n) for n in range(3)
                ],
                "full_collection_max_ms": 1000 * max(full, default=0.0),
            }
        )
    )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--games", type=int, default=256)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--recipe", default="recipes/tictactoe_tiny/rl_gpu.toml")
    parser.add_argument("--model", default="tiny-master")
    parser.add_argument("--out", default=None)
    parser.add_argument("--variant", default=None, help=argparse.SUPPRESS)  # a child's
    args = parser.parse_args(argv)
    if args.variant:
        child(args)
        return {}
    rows = []
    for _ in range(args.repeats):
        for variant in ("frozen", "control"):
            command = [sys.executable, __file__, *(argv or sys.argv[1:]), "--variant", variant]
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise SystemExit(f"{variant} run failed:\n{done.stderr[-3000:]}")
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"  {variant}: {rows[-1]['mean_step_s']:.3f} s/step (mean)", flush=True)
    print(f"\ngarbage collection in RL steps, {args.model}, {args.games} games, {args.device}")
    print(
        f"{'variant':<8} {'steps':>5} {'mean s':>7} {'median s':>8} {'max s':>6} "
        f"{'gen0/1/2 collections':>20} {'gen2 ms':>8} {'gen2 max ms':>11}"
    )
    for r in rows:
        counts = "/".join(str(n) for n in r["collections"])
        print(
            f"{r['variant']:<8} {r['steps']:>5} {r['mean_step_s']:>7.3f} "
            f"{r['median_step_s']:>8.3f} {r['max_step_s']:>6.3f} {counts:>20} "
            f"{r['collection_ms'][2]:>8.1f} {r['full_collection_max_ms']:>11.1f}"
        )
    means = {v: statistics.fmean(r["mean_step_s"] for r in rows if r["variant"] == v) for v in ("frozen", "control")}  # fmt: skip
    print(f"mean step, control / frozen: {means['control'] / means['frozen']:.3f}x")
    results = {
        "benchmark": "gc_pauses",
        "machine": machine(),
        "device": args.device,
        "games": args.games,
        "model": args.model,
        "recipe": args.recipe,
        "rows": rows,
        "control_over_frozen_mean_step": means["control"] / means["frozen"],
    }
    return write_results(results, args.out, f"gc_pauses_{args.device}.json")


if __name__ == "__main__":
    main()
