"""A round of the mastery search: several `bench/tictactoe_mastery.py` runs at once on one
machine (one card shared), then one results file for the round.

    python bench/tictactoe_mastery_round.py --round 52 --root runs/rounds/r52 \\
        --common "--device cuda --skip-base --budget-minutes 15 --eval-games 1000 ..." \\
        --run s0="--seed 0" --run s1="--seed 1" [--part 1 --split-minutes 8.1 | --part 2]
        [--question "..."] [--archive DIR]

Each run is the mastery benchmark with the common flags and its own, its output under
`<root>/<name>` and its log in `<root>/<name>.log`. A budget longer than one sitting is spent
in two parts, as the benchmark allows: `--part 1 --split-minutes M` stops every run at M
minutes (partial results `<root>/<name>.part.json`), and `--part 2` with the same flags
resumes them. After a whole round (no `--part`) or its second part, the runs' results are
merged into `bench/results/tictactoe_mastery_gpu_r<round>.json` (or `--results`): the
command, the card, each run's flags, stages, wall times and training curves (metrics at the
first step, a third, two thirds and the last, the step's timings among them), and the best
run by the choice rule below; with `--archive DIR` the best run's RL checkpoint is packed
into `DIR/best.tar.gz` and each run's chosen save, `average/` and last save into
`DIR/<run>.tar.gz`, weights without the trainer's state (what a lent machine can hand back,
for `bench/tictactoe_exact.py --model` on each).

The choice rule (the benchmark's `choice_score`, the one `tiny-master` is chosen by): draws
against optimal plus wins against random, less twice the losses against random and twice
the invalid moves. A run with `--rl-select K` records which of its saves it chose and every
candidate's validation score.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tarfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCH = HERE / "tictactoe_mastery.py"
sys.path.insert(0, str(HERE))

from tictactoe_mastery import choice_score  # noqa: E402  (the benchmark's own rule)

from rlcore.train.common import TRAINER_STATE  # noqa: E402

CURVE_KEYS = (
    "tictactoe/sound_move_rate",
    "sound_mass/mean",
    "tictactoe/think_correct_rate",
    "tictactoe/missed_wins",
    "tictactoe/missed_blocks",
    "tictactoe/invalid_move_rate",
    "tictactoe/format_rate",
    "policy/entropy",
    "outcome/win",
    "outcome/loss",
    "policy/clip_fraction",
    "async/lag",
    "perf/step_seconds",
    "perf/wait_seconds",
    "perf/rollout_seconds",
    "perf/train_seconds",
    "length/completion_tokens",
)
POINTS = ("first", "third", "two_thirds", "last")


def curves(metrics: list[dict]) -> dict:
    """Each curve key's value at the first step, a third, two thirds and the last."""
    if not metrics:
        return {}
    n = len(metrics)
    at = dict(zip(POINTS, (0, n // 3, 2 * n // 3, n - 1), strict=True))
    return {key: {point: metrics[i].get(key) for point, i in at.items()} for key in CURVE_KEYS}


def merge_round(root: Path, flags: dict[str, str]) -> dict:
    """The round's runs (results `<root>/<name>.json`, metrics under each run's own `out`):
    their flags, stages, wall times, RL steps and curves, and the best by `choice_score`."""
    runs = {}
    for name, run_flags in flags.items():
        result = json.loads((root / f"{name}.json").read_text())
        metrics_path = Path(result["args"]["out"]) / "rl" / "metrics.jsonl"
        lines = metrics_path.read_text().splitlines() if metrics_path.is_file() else []
        metrics = [json.loads(line) for line in lines if line.strip()]
        runs[name] = {
            "flags": run_flags,
            "stages": result["stages"],
            "wall_seconds": result["wall_seconds"],
            "checkpoints": result["checkpoints"],
            "card": result["machine"].get("cuda") or result["machine"]["platform"],
            "rl_steps": max((m["step"] for m in metrics), default=0),
            "curves": curves(metrics),
            "score": round(choice_score(result["stages"]["rl"]), 4),
        }
        if result.get("selection"):  # --rl-select: which save, and every candidate's score
            selection = result["selection"]
            scores = {k: v["score"] for k, v in selection["candidates"].items()}
            runs[name]["selection"] = {"chosen": selection["chosen"], "scores": scores}
    best = max(runs, key=lambda name: runs[name]["score"]) if runs else None
    return {"runs": runs, "best": best}


def summary_table(merged: dict) -> str:
    """One line a run: steps, SFT and RL against random, draws against optimal, invalid."""
    lines = [
        f"{'run':<10}{'steps':>6}  {'SFT vs random W/D/L':<20}{'RL vs random W/D/L':<20}"
        f"{'opt draw':>9}{'invalid':>9}{'format':>8}{'score':>8}  chosen (last save's score)"
    ]
    for name, run in merged["runs"].items():
        sft, rl = run["stages"]["sft"]["random"], run["stages"]["rl"]
        invalid = (rl["random"]["invalid_move_rate"] + rl["optimal"]["invalid_move_rate"]) / 2
        lines.append(
            f"{name:<10}{run['rl_steps']:>6}  "
            f"{_wdl(sft):<20}{_wdl(rl['random']):<20}{rl['optimal']['draw']:>9.1%}"
            f"{invalid:>9.2%}{rl['random']['format']:>8.1%}{run['score']:>8.3f}" + _chosen(run)
        )
    lines.append(f"best: {merged['best']}")
    return "\n".join(lines)


def _chosen(run: dict) -> str:
    """With --rl-select: the save reported and the last save's score on the same games."""
    if "selection" not in run:
        return ""
    last = run["stages"].get("rl_last")
    return f"  {run['selection']['chosen']}" + (f" ({choice_score(last):.3f})" if last else "")


def _wdl(row: dict) -> str:
    return "/".join(f"{100 * row[k]:.1f}" for k in ("win", "draw", "loss"))


def parse_runs(values: list[str]) -> dict[str, str]:
    """`name=flags` pairs, names of letters, digits, '-' and '_' (they name files)."""
    runs = {}
    for value in values:
        name, sep, run_flags = value.partition("=")
        if not sep or not name or not all(c.isalnum() or c in "-_" for c in name):
            raise SystemExit(f"--run {value!r}: expected name=flags, the name a plain word")
        if name in runs:
            raise SystemExit(f"--run {name}: given twice")
        runs[name] = run_flags
    if not runs:
        raise SystemExit("--run: give at least one name=flags")
    return runs


def run_all(root: Path, common: str, runs: dict[str, str], part: int | None, split: float | None):
    """Every run at once; returns {name: exit status}."""
    root.mkdir(parents=True, exist_ok=True)
    processes = {}
    for name, run_flags in runs.items():
        command = [sys.executable, str(BENCH), *shlex.split(common), *shlex.split(run_flags)]
        command += ["--out", str(root / name)]
        if part == 1:
            command += ["--split-minutes", str(split), "--results", str(root / f"{name}.part.json")]
        elif part == 2:
            command += ["--resume", str(root / f"{name}.part.json")]
            command += ["--results", str(root / f"{name}.json")]
        else:
            command += ["--results", str(root / f"{name}.json")]
        with (root / f"{name}.log").open("a") as log:  # the child keeps its own copy
            processes[name] = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    return {name: process.wait() for name, process in processes.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--round", required=True, help="the round's name, e.g. 52")
    parser.add_argument("--root", required=True, help="where the runs keep their files")
    parser.add_argument("--common", default="", help="flags every run gets")
    parser.add_argument("--run", action="append", default=[], help="name=flags, once a run")
    parser.add_argument("--part", type=int, choices=[1, 2], default=None)
    parser.add_argument("--split-minutes", type=float, default=None)
    parser.add_argument("--question", default="", help="what the round asks, for its record")
    parser.add_argument("--results", default=None, help="the round's JSON (default by round)")
    parser.add_argument(
        "--archive",
        default=None,
        help="pack the best run's RL checkpoint and each run's candidates here",
    )
    args = parser.parse_args(argv)
    if (args.part == 1) != (args.split_minutes is not None):
        parser.error("--split-minutes goes with --part 1, and --part 1 needs it")
    runs = parse_runs(args.run)
    root = Path(args.root)
    statuses = run_all(root, args.common, runs, args.part, args.split_minutes)
    failed = {name: code for name, code in statuses.items() if code != 0}
    for name, code in failed.items():
        print(f"{name}: exited with {code}; its log: {root / name}.log")
    if args.part == 1:
        for name in runs:
            metrics = root / name / "rl" / "metrics.jsonl"
            steps = len(metrics.read_text().splitlines()) if metrics.is_file() else 0
            print(f"{name}: first part done, {steps} RL steps")
        return 1 if failed else 0
    merged = merge_round(root, {name: flags for name, flags in runs.items() if name not in failed})
    budget = next(
        (r["wall_seconds"].get("pipeline") for r in merged["runs"].values()), None
    )  # what the budget allowed, as the first run spent it
    record = {
        "round": args.round,
        "question": args.question,
        "command": f"python3 bench/tictactoe_mastery.py {args.common} [run flags]"
        + (" (in two parts: --split-minutes, then --resume)" if args.part == 2 else ""),
        "card": next((r["card"] for r in merged["runs"].values()), None),
        "pipeline_seconds": budget,
        "run_flags": runs,
        "failed": failed,
        **merged,
    }
    out = Path(args.results or HERE / "results" / f"tictactoe_mastery_gpu_r{args.round}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(summary_table(merged))
    print(f"wrote {out}")
    if args.archive:
        pack(Path(args.archive), args.round, merged)
    return 1 if failed else 0


def pack(archive: Path, round_name: str, merged: dict) -> None:
    """The best run's chosen checkpoint in `best.tar.gz`, and each run's candidates a later
    look needs (its chosen save, `average/` and its last save) in `<run>.tar.gz`, weights,
    config and tokenizer only: the trainer's state (the optimizer's moments, twice the
    weights) is left out, so every archive stays small enough for a lent machine to hand
    back (round 70's three checkpoints with it did not come back)."""
    archive.mkdir(parents=True, exist_ok=True)

    def weights_only(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        return None if Path(info.name).name == TRAINER_STATE else info

    if merged["best"]:
        checkpoint = merged["runs"][merged["best"]]["checkpoints"]["rl"]
        with tarfile.open(archive / "best.tar.gz", "w:gz") as packed:
            packed.add(checkpoint, arcname=f"r{round_name}-{merged['best']}", filter=weights_only)
        print(f"packed {checkpoint} into {archive / 'best.tar.gz'}")
    for name, run in merged["runs"].items():
        chosen = Path(run["checkpoints"]["rl"])
        kept = {chosen, chosen.parent / "average", Path(run["checkpoints"]["rl_last"])}
        with tarfile.open(archive / f"{name}.tar.gz", "w:gz") as packed:
            for path in sorted(p for p in kept if p.is_dir()):
                packed.add(path, arcname=f"r{round_name}-{name}/{path.name}", filter=weights_only)
        print(f"packed {name}'s candidates into {archive / f'{name}.tar.gz'}")


if __name__ == "__main__":
    sys.exit(main())
