"""Seconds per RL step of the default tic-tac-toe recipe, this tree against an earlier
commit, side by side on the same machine.

Each side runs in its own process from its own checkout (a `git worktree` of the earlier
commit under runs/bench/), on the built-in tiny model, with the settings of
`recipes/tictactoe_tiny/rl.toml` given as plain `key=value` overrides that every version of
the config accepts. Runs alternate (earlier, current, earlier, current, ...) so that a
machine that slows down mid-benchmark slows both alike. The first step of every run
(model load, warm-up) is left out of the figures.

  python bench/rl_step.py --compare 19d4077 --steps 6 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# rl.toml's settings, flat, on the untrained tiny model and the CPU.
SETTINGS = [
    "model=tiny", "env=tictactoe", "batch_size=64", "rollouts_per_example=8",
    "advantage=tree", "loss_aggregation=turn", "micro_batch_size=16", "lr=1e-4",
    "lr_schedule=constant", "warmup_steps=5", "temperature=0.7", "max_tokens=64",
    "save_every=0", "log_rollouts=8", "device=cpu",
    'env_args={"min_random_move_prob": 0.0, "max_random_move_prob": 1.0, '
    '"num_groups": 4, "max_turns": 6, "opening_moves": 2}',
]  # fmt: skip

CHILD = r"""
import json, sys, time
import torch
torch.set_num_threads(int(sys.argv[3]))
from rlcore.events import NullSink
from rlcore.train.config import RLConfig, load_config
from rlcore.train.grpo import run_rl

class Timer(NullSink):
    def __init__(self):
        self.steps = []
    def metric(self, step, values):
        self.steps.append([values["perf/step_seconds"], values["perf/rollout_seconds"],
                           values["perf/train_seconds"]])

settings = json.loads(sys.argv[1])
cfg = load_config(RLConfig, None, settings + [f"output_dir={sys.argv[2]}"])
sink = Timer()
run_rl(cfg, sink)
print("RESULT " + json.dumps(sink.steps))
"""


def worktree(commit: str) -> Path:
    path = ROOT / "runs" / "bench" / f"worktree-{commit}"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(path), commit], cwd=ROOT, check=True
        )
    return path


def run_side(tree: Path, steps: int, threads: int, out: Path) -> list[list[float]]:
    settings = [*SETTINGS, f"max_steps={steps}"]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(settings), str(out), str(threads)],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        raise SystemExit(f"the run in {tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])[1:]  # the first step warms up


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compare", required=True, help="the earlier commit to time against")
    parser.add_argument("--steps", type=int, default=6, help="RL steps per run (first dropped)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each side")
    parser.add_argument("--threads", type=int, default=2, help="torch threads per run")
    parser.add_argument("--results", default=str(ROOT / "bench" / "results" / "rl_step.json"))
    args = parser.parse_args(argv)
    sides = {f"earlier ({args.compare})": worktree(args.compare), "current": ROOT}
    times: dict[str, list[list[float]]] = {name: [] for name in sides}
    for repeat in range(args.repeats):
        for name, tree in sides.items():
            out = ROOT / "runs" / "bench" / "rl_step" / f"{name.split()[0]}-{repeat}"
            times[name] += run_side(tree, args.steps, args.threads, out)
            print(f"{name}, run {repeat + 1}: {len(times[name])} steps timed", flush=True)

    rows = {
        name: {
            "steps": len(values),
            "step_s": statistics.median(v[0] for v in values),
            "rollout_s": statistics.median(v[1] for v in values),
            "train_s": statistics.median(v[2] for v in values),
        }
        for name, values in times.items()
    }
    earlier, current = rows[f"earlier ({args.compare})"], rows["current"]
    print(f"\n{'side':<22} {'steps':>5} {'step s':>8} {'rollout s':>10} {'train s':>8}")
    for name, row in rows.items():
        print(
            f"{name:<22} {row['steps']:>5} {row['step_s']:>8.2f} {row['rollout_s']:>10.2f} "
            f"{row['train_s']:>8.2f}"
        )
    ratio = current["step_s"] / earlier["step_s"]
    print(f"current / earlier (median step): {ratio:.3f}")
    result = {
        "benchmark": "rl_step",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip(),
        "compare": args.compare,
        "settings": SETTINGS,
        "threads": args.threads,
        "rows": rows,
        "current_over_earlier": ratio,
        "raw": times,
    }
    Path(args.results).write_text(json.dumps(result, indent=2) + "\n")
    print(f"results: {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
