"""Seconds per RL step of the tic-tac-toe recipe at 64, 256 and 1024 games a step, run by
1, 2, 4 ... data-parallel processes (`RLConfig.processes`) on one device, in one run.

    python bench/rl_processes.py [--device auto] [--games 64,256,1024] [--processes 1,2,4]
        [--actors 2,4] [--steps 8] [--warmup 2] [--recipe recipes/tictactoe_tiny/rl_gpu.toml]
        [--model tiny-master] [--out PATH] [--profile 4,8] [--set KEY=VALUE ...] [--no-mps]

Each row is a real `run_rl` (`run_rl_ranks`, as `python -m rlcore rl ... processes=P` runs
it) of the recipe with `--model` as the policy (a trained player, whose replies end as a
trained model's do), `batch_size` and `concurrency` set to the games, no saves and no
choice among saves. Each process rolls out its share of the step's games with its own
engine, scores them and trains on their sequences; the gradients are summed, so the step
is the same update on the whole batch. On a GPU worker a step is mostly host work (the
games, the prompts, the engine's bookkeeping: docs/BENCHMARKS.md), which the processes
split over CPU cores; several processes share one GPU. Figures are medians of rank 0's
`perf/step_seconds`, `perf/rollout_seconds`, `perf/train_seconds` and the train part's pieces
(scoring, the wait for the ranks, the update, rank 0's gathering) over the steps after
`--warmup` (CUDA graph capture, allocator warm-up); `period` is the median time between two
steps' metrics, logging included. `vs 1 proc` compares a row with the first processes
count's at the same games; `vs 64` with the same processes at the fewest games.
`--actors A` adds rows of one learner fed by A rollout actors (`RLConfig.actors`): there the
rollout and scoring are an actor's, `wait` the learner's wait for a batch, and `lag` the median
number of updates between the weights that played a batch and the ones it trained.
`--set KEY=VALUE` overrides a recipe setting in every row (`micro_batch_size=1024`, say).
The last lines compare each size's best row with the fewest games' best row, whatever their
processes (`best_over_fewest_games`: the 1,024-game target of issue 14 is <= 2x).
Processes sharing a card share it through NVIDIA MPS where the machine has it
(`distributed.share_card`); `--no-mps` runs them without, and `mps` in the results says
which. Writes bench/results/rl_processes_<device>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from benchlib import write_results  # noqa: E402

from rlcore.events import RecordingSink  # noqa: E402
from rlcore.train import grpo  # noqa: E402
from rlcore.train.config import RLConfig, load_config  # noqa: E402
from rlcore.train.distributed import mps_serving, run_rl_ranks  # noqa: E402

PARTS = ("step", "rollout", "train", "scoring", "wait", "update", "gather")


class TimedSink(RecordingSink):
    """Also notes when each step's metrics arrive: their spacing is the step's whole
    period (`perf/step_seconds` stops before rank 0 summarizes and logs the step)."""

    def __init__(self) -> None:
        super().__init__()
        self.arrivals: list[float] = []

    def metric(self, step: int, values: dict[str, float]) -> None:
        self.arrivals.append(time.monotonic())
        super().metric(step, values)


def run_row(args, games: int, processes: int, actors: int = 0) -> dict:
    """One run of `--steps` + `--warmup` steps: medians of the timed steps."""
    with tempfile.TemporaryDirectory() as output_dir:
        overrides = [
            f"model={args.model}", f"batch_size={games}", f"concurrency={games}",
            f"processes={processes}", f"actors={actors}", f"device={args.device}",
            f"output_dir={output_dir}",
            f"max_steps={args.warmup + args.steps}", "save_every=0", "select.keep=1",
            "select.average=0",
            "log_rollouts=0", *args.set,
        ]  # fmt: skip
        cfg = load_config(RLConfig, args.recipe, overrides)
        sink = TimedSink()
        tables: dict[str, str] = {}
        with profiled_update(processes in args.profile, args.warmup + 1, tables):
            run_rl_ranks(cfg, sink)
    timed = [metrics for step, metrics in sink.metrics if step > args.warmup]
    row = {"games": games, "processes": processes, "actors": actors, "steps": len(timed)}
    for part in PARTS:  # wait and gather only in a data-parallel run
        row[f"{part}_seconds"] = statistics.median(
            m.get(f"perf/{part}_seconds", 0.0) for m in timed
        )
    periods = [b - a for a, b in itertools.pairwise(sink.arrivals[max(args.warmup - 1, 0) :])]
    row["period_seconds"] = statistics.median(periods) if periods else float("nan")
    row["lag"] = statistics.median(m.get("async/lag", 0.0) for m in timed)
    row["games_per_second"] = games / row["step_seconds"]
    if tables:
        row["update_profile"] = tables
    return row


@contextlib.contextmanager
def profiled_update(active: bool, call: int, tables: dict):
    """With `active`, rank 0's update (`grpo.learn`, run in this process) at its `call`-th
    call runs under the torch profiler: its tables by host and by device time go into
    `tables`, and the first is printed."""
    if not active:
        yield
        return
    learn, calls = grpo.learn, []

    def traced(*args, **kwargs):
        calls.append(1)
        if len(calls) != call:
            return learn(*args, **kwargs)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            result = learn(*args, **kwargs)
        averages = prof.key_averages()
        for sort in ("self_cpu_time_total", "self_cuda_time_total")[: len(activities)]:
            tables[sort] = averages.table(sort_by=sort, row_limit=30)
        print(tables["self_cpu_time_total"])
        return result

    grpo.learn = traced
    try:
        yield
    finally:
        grpo.learn = learn


def card(device: str) -> str:
    if device != "cpu" and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda")
    parser.add_argument("--games", default="64,256,1024", help="games a step, comma-separated")
    parser.add_argument(
        "--processes",
        default="1,2,4",
        help='processes, comma-separated ("": none, actors rows only)',
    )
    parser.add_argument("--actors", default="", help="actor counts, comma-separated")
    parser.add_argument("--steps", type=int, default=8, help="timed steps a row")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--recipe", default="recipes/tictactoe_tiny/rl_gpu.toml")
    parser.add_argument("--model", default="tiny-master", help="the policy")
    parser.add_argument("--out", default=None, help="JSON path")
    parser.add_argument(
        "--profile",
        default="",
        help="process counts whose rows profile rank 0's update in their first timed step",
    )
    parser.add_argument(
        "--no-mps",
        action="store_true",
        help="ranks sharing a card do not start NVIDIA MPS for it (RLCORE_MPS=0)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a recipe setting for every row (repeatable)",
    )
    args = parser.parse_args(argv)
    if args.no_mps:
        os.environ["RLCORE_MPS"] = "0"
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    sizes = [int(g) for g in args.games.split(",")]
    counts = [int(p) for p in args.processes.split(",") if p]  # "": actors rows only
    setups = [(p, 0) for p in counts] + [(1, int(a)) for a in args.actors.split(",") if a]
    args.profile = {int(p) for p in args.profile.split(",") if p}
    rows = []
    for games in sizes:
        for processes, actors in setups:
            row = run_row(args, games, processes, actors)
            rows.append(row)
            print(
                f"  {games} games, {processes} processes, {actors} actors: "
                f"{row['step_seconds']:.3f} s/step"
            )
    first = {r["games"]: r["step_seconds"] for r in rows if (r["processes"], r["actors"]) == setups[0]}  # fmt: skip
    fewest = {
        (r["processes"], r["actors"]): r["step_seconds"] for r in rows if r["games"] == sizes[0]
    }
    for row in rows:
        row["vs_one_process"] = first[row["games"]] / row["step_seconds"]
        row["vs_fewest_games"] = row["step_seconds"] / fewest[row["processes"], row["actors"]]
    name = card(args.device)
    mps = args.device != "cpu" and mps_serving()
    print(
        f"\ntic-tac-toe RL step by processes, {args.model}, {args.recipe}, {args.device}, "
        f"MPS {'on' if mps else 'off'}"
    )
    header = (
        f"{'card':<22} {'games':>5} {'procs':>5} {'actors':>6} {'rollout s':>9} {'train s':>7} "
        f"{'scoring':>7} {'wait':>6} {'update':>6} {'gather':>6} "
        f"{'step s':>7} {'period':>6} {'lag':>4} {'vs 1 proc':>9} {'vs 64':>6} {'games/s':>8}"
    )
    print(header)
    for r in rows:
        print(
            f"{name[:22]:<22} {r['games']:>5} {r['processes']:>5} {r['actors']:>6} "
            f"{r['rollout_seconds']:>9.3f} "
            f"{r['train_seconds']:>7.3f} {r['scoring_seconds']:>7.3f} {r['wait_seconds']:>6.3f} "
            f"{r['update_seconds']:>6.3f} {r['gather_seconds']:>6.3f} {r['step_seconds']:>7.3f} "
            f"{r['period_seconds']:>6.3f} {r['lag']:>4.1f} "
            f"{r['vs_one_process']:>8.2f}x {r['vs_fewest_games']:>5.2f}x "
            f"{r['games_per_second']:>8.1f}"
        )
    # The target's comparison: each size at its best setup against the fewest games at theirs.
    best = {g: min(r["step_seconds"] for r in rows if r["games"] == g) for g in sizes}
    for games in sizes[1:]:
        print(
            f"best {games}-game step over best {sizes[0]}-game step: "
            f"{best[games]:.3f} / {best[sizes[0]]:.3f} s = {best[games] / best[sizes[0]]:.2f}x"
        )
    results = {
        "benchmark": "rl_processes",
        "card": name,
        "device": args.device,
        "recipe": args.recipe,
        "model": args.model,
        "steps": args.steps,
        "warmup": args.warmup,
        "settings": args.set,
        "mps": mps,
        "command": "python bench/rl_processes.py " + " ".join(argv or sys.argv[1:]),
        "rows": rows,
        "best_step_seconds": {str(g): best[g] for g in sizes},
        "best_over_fewest_games": {str(g): best[g] / best[sizes[0]] for g in sizes},
    }
    return write_results(results, args.out, f"rl_processes_{args.device}.json")


if __name__ == "__main__":
    main()
