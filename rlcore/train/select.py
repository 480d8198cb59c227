"""Which save is an RL run's result (`RLConfig.select`).

A run's greedy play moves as much between saves 25 steps apart as between seeds
(docs/mastery.md, twenty-seventh session), so the last step's weights are one draw among
several about as good. With `select.keep` > 1 the last `keep` saves each play the env's
validation games (`Environment.validation`: sets of games, each with its own env params and
a weight per metric), greedily, on a seed of their own; the best by the weighted sum is
copied to `best/` and is the run's result. Early stopping on validation games: it changes
which weights are reported, never how they are trained. The record of every candidate goes
to `select.json` beside the saves, and each candidate's score into the run's metrics as
`select/score` at its step.

With `select.average` = K > 1 one more candidate plays: the weights averaged over the run's
last K saves (`average/`). The saves of one run lie close enough to average (the same start,
one small step after another). On the 2-core CPU profile's runs the validation games chose
the average of the last 21 saves on two of three, and there it beat the top-ranked single save's
held-out score by 0.10 (docs/mastery.md, thirty-sixth session): the average smooths the
save-to-save swing that the choice otherwise samples.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from rlcore.envs import load_environment
from rlcore.evaluate import EvalConfig, run_eval, summary_metrics
from rlcore.events import EventSink, NullSink
from rlcore.train.common import TRAINER_STATE

BEST = "best"
AVERAGE = "average"
WEIGHTS = "model.safetensors"


def saved_steps(output_dir: Path, final_step: int) -> list[tuple[int, Path]]:
    """(step, directory) of each complete save of a run (weights and trainer state), in
    step order: `step_NNNNNN/`, and `final/` at `final_step`; a save past `final_step`
    (left in the directory by an earlier, longer run) is not this run's."""
    saves = []
    for path in output_dir.iterdir() if output_dir.is_dir() else []:
        if not (path / TRAINER_STATE).is_file():
            continue
        if path.name == "final":
            saves.append((final_step, path))
        elif path.name.startswith("step_") and path.name[5:].isdigit():
            step = int(path.name[5:])
            saves += [(step, path)] if step <= final_step else []
    return sorted(saves, key=lambda save: (save[0], save[1].name == "final"))


def average_saves(saves: list[Path], out: Path) -> Path:
    """The uniform average of `saves`' weights (float64 sums, stored in each tensor's own
    dtype) written to `out` with the last save's other files (config, tokenizer; no
    trainer state: it is a result, never resumed from)."""
    total: dict[str, torch.Tensor] = {}
    dtypes: dict[str, torch.dtype] = {}
    for save in saves:
        for name, tensor in load_file(save / WEIGHTS).items():
            total[name] = total[name] + tensor.double() if name in total else tensor.double()
            dtypes[name] = tensor.dtype  # the last save's
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(saves[-1], out, ignore=shutil.ignore_patterns(TRAINER_STATE, WEIGHTS))
    averaged = {name: (t / len(saves)).to(dtypes[name]) for name, t in total.items()}
    save_file(averaged, out / WEIGHTS, metadata={"format": "pt"})
    return out


def score(summaries: dict[str, dict], validation) -> float:
    """The weighted sum of each validation set's metrics; a metric its summary lacks (an
    outcome no game had) counts 0."""
    return sum(
        weight * summaries[part.name].get(metric, 0.0)
        for part in validation
        for metric, weight in part.weights.items()
    )


def game_summary(path: Path, part, cfg) -> dict[str, float]:
    """The save at `path` on one validation set's games (greedy, on the select seed)."""
    result = run_eval(
        EvalConfig(
            env=cfg.env,
            model=str(path),
            env_args={**cfg.env_args, **part.env_args},
            num_examples=cfg.select.num_examples,
            max_tokens=cfg.sampling.max_tokens,
            temperature=0.0,
            concurrency=cfg.sampling.concurrency,
            seed=cfg.select.seed,
            device=cfg.device,
        )
    )
    return summary_metrics(result.summary)


def choose_save(cfg, sink: EventSink | None = None) -> tuple[str, dict]:
    """The best of the run's last `cfg.select.keep` saves by the env's validation games,
    copied to `best/` (the later save on a tie), and the record written to `select.json`.
    A stop request ends the choice early among the saves already played."""
    sink = sink or NullSink()
    output_dir = Path(cfg.output_dir)
    saves = saved_steps(output_dir, cfg.max_steps)
    candidates = singles = saves[-cfg.select.keep :]
    if not candidates:
        raise ValueError(f"select: the run left no save in {output_dir} to choose among")
    if cfg.select.average > 1 and len(saves) > 1:
        averaged = [path for _, path in saves[-cfg.select.average :]]
        if any(not (path / WEIGHTS).is_file() for path in averaged):
            raise ValueError(f"select.average: a save in {output_dir} has no {WEIGHTS}")
        candidates = [*singles, (saves[-1][0], average_saves(averaged, output_dir / AVERAGE))]
        sink.log(f"select: {AVERAGE}/ averages the last {len(averaged)} saves")
    validation = load_environment(cfg.env, **cfg.env_args).validation()
    if len(candidates) > 1:
        sink.log(
            f"select: {len(singles)} saves (steps {singles[0][0]}..{singles[-1][0]})"
            + (f" and {AVERAGE}/" if len(candidates) > len(singles) else "")
            + f" x {cfg.select.num_examples} greedy games of "
            + ", ".join(part.name for part in validation)
        )
    else:  # a run shorter than save_every: nothing to choose between
        candidates, (step, only) = [], candidates[0]
        sink.log(f"select: one save ({only.name}), taken without games")
    record: dict[str, dict] = {}
    for done, (step, path) in enumerate(candidates):
        if sink.should_stop():
            sink.log(f"select: stopped after {done} of {len(candidates)} saves", "warning")
            break
        summaries = {part.name: game_summary(path, part, cfg) for part in validation}
        value = score(summaries, validation)
        record[path.name] = {"step": step, "score": round(value, 6), "metrics": summaries}
        sink.metric(step, {"select/score": value})
        sink.progress(done + 1, len(candidates), "select")
    if not record:  # one save, or stopped before the first game: the last save stands
        step, chosen = candidates[-1] if candidates else (step, only)
    else:
        name = max(record, key=lambda n: (record[n]["score"], record[n]["step"]))
        step, chosen = record[name]["step"], output_dir / name
    best = output_dir / BEST
    if best.exists():
        shutil.rmtree(best)
    shutil.copytree(chosen, best, ignore=shutil.ignore_patterns(TRAINER_STATE))  # weights only
    summary = {
        "chosen": chosen.name,
        "step": step,
        "num_examples": cfg.select.num_examples,
        "seed": cfg.select.seed,
        "validation": [
            {"name": p.name, "env_args": p.env_args, "weights": p.weights} for p in validation
        ],
        "candidates": record,
    }
    (output_dir / "select.json").write_text(json.dumps(summary, indent=2) + "\n")
    sink.checkpoint(step, str(best))
    scores = ", ".join(f"{name} {r['score']:.4f}" for name, r in record.items())
    sink.log(f"select: chose {chosen.name} (step {step}) of {scores or 'one'}; copied to {best}")
    return str(best), summary
