"""The mastery benchmark's budget in two parts, and the round runner that merges runs: a
small real round on the CPU (synth, SFT, RL split then resumed, evaluation), and the
merge's arithmetic on recorded results."""

import importlib.util
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ROUND = load("tictactoe_mastery_round")
# The smallest story that still plays, trains and resumes: 20 teacher games, one SFT epoch,
# RL steps of 16 games with 16-token replies, 8 games per opponent; a budget of 90 s split at
# 30 s (a first part of 15 s left a slow, loaded 2-core VM no RL step before the split, and a
# second part of 30 s once spent itself resuming, the other test worker loading the VM).
BUDGET_MINUTES = 1.5
COMMON = (
    f"--device cpu --skip-base --budget-minutes {BUDGET_MINUTES} --sft-games 20 --sft-epochs 1 "
    "--eval-games 8 --eval-concurrency 8 --rl-batch 16 --rl-group 4 --max-tokens 16 "
    "--rl-turn-reward-weight 1 --rl-sound-mass 1 --rl-no-think-loss"
)
# The RL checkpoint chosen among the last 2 saves (one a step) by 4 validation games each.
SELECT = "--seed 0 --rl-select 2 --rl-select-every 1 --rl-select-games 4"


def runner(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(BENCH / "tictactoe_mastery_round.py"), *args],
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_a_round_split_in_two_parts_resumes_exactly_and_spends_one_budget(tmp_path):
    root, common = tmp_path / "round", ["--common", COMMON, "--run", f"a={SELECT}"]
    first = runner("--round", "t", "--root", str(root), *common, "--part", "1",
                   "--split-minutes", "0.5")  # fmt: skip
    assert first.returncode == 0, first.stdout + first.stderr
    partial = json.loads((root / "a.part.json").read_text())
    assert partial["partial"] and "stages" not in partial  # nothing evaluated yet
    assert partial["wall_seconds"]["pipeline"] < 0.5 * 60 + 10
    assert partial["wall_seconds"]["select_probe"] > 0  # the first save's validation, timed
    steps_first = len((root / "a" / "rl" / "metrics.jsonl").read_text().splitlines())
    assert steps_first >= 1 and f"{steps_first} RL steps" in first.stdout

    # Another setting than the first part's is refused, by name, before anything runs.
    other = subprocess.run(
        [sys.executable, str(BENCH / "tictactoe_mastery.py"), *COMMON.split(),
         *SELECT.replace("--seed 0", "--seed 1").split(), "--resume", str(root / "a.part.json"), "--out", str(root / "a")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert other.returncode != 0 and "other settings: seed" in other.stderr

    results, archive = tmp_path / "round.json", tmp_path / "archive"
    second = runner("--round", "t", "--root", str(root), *common, "--part", "2",
                    "--results", str(results), "--archive", str(archive))  # fmt: skip
    assert second.returncode == 0, second.stdout + second.stderr
    record = json.loads(results.read_text())
    run = record["runs"]["a"]
    # The second part went on from the first part's last saved step: one run of steps.
    metrics = [json.loads(line) for line in (root / "a" / "rl" / "metrics.jsonl").open()]
    assert [m["step"] for m in metrics] == list(range(1, len(metrics) + 1))
    assert run["rl_steps"] == len(metrics) > steps_first
    assert "resumed from" in (root / "a.log").read_text()
    # Both parts' wall time together is the one budget (the second part's start included).
    seconds = run["wall_seconds"]
    assert seconds["first_part"] == pytest.approx(partial["wall_seconds"]["pipeline"], abs=0.1)
    # RL stopped 2 validations' time (as the first save's took) early, and the choice of
    # the checkpoint was spent in that room: the budget is overrun only by what the choice
    # took beyond its estimate (a loaded VM can slow the choice after the probe).
    room = 2 * seconds["select_probe"]
    beyond = max(0.0, seconds["select"] - room)
    budget = BUDGET_MINUTES * 60
    assert budget - 1 - room <= seconds["pipeline"] < budget + 15 + beyond
    assert seconds["select"] > 0
    assert (
        set(run["stages"]) == {"sft", "rl", "rl_last"}
        and run["stages"]["rl"]["random"]["games"] == 8
    )
    assert run["curves"]["perf/step_seconds"]["last"] > 0
    # The tactics the player missed, a game: in every row and along the training curve.
    row = run["stages"]["sft"]["random"]
    assert row["missed_wins"] >= 0 and row["missed_blocks"] >= 0
    assert run["curves"]["tictactoe/missed_blocks"]["last"] >= 0
    assert record["best"] == "a" and record["run_flags"] == {"a": SELECT}
    # The RL stage is the best of the last two saves on the validation games; the last
    # step's save is kept beside it.
    own = json.loads((root / "a.json").read_text())["selection"]
    scores = run["selection"]["scores"]
    last = Path(run["checkpoints"]["rl_last"]).name
    assert len(scores) == 2 and last in scores
    assert own["num_examples"] == 4 and own["seed"] == 20_000
    assert run["selection"]["chosen"] == max(scores, key=lambda k: (scores[k], k))
    assert Path(run["checkpoints"]["rl"]).name == run["selection"]["chosen"]
    # Each candidate played both validation sets (the env's), scored by the choice rule.
    for candidate in own["candidates"].values():
        rows = {
            name: {key.rsplit("/", 1)[-1]: value for key, value in metrics.items()}
            for name, metrics in candidate["metrics"].items()
        }
        assert candidate["score"] == pytest.approx(ROUND.choice_score(rows), abs=1e-5)
    with tarfile.open(archive / "best.tar.gz") as packed:
        assert "rt-a/model.safetensors" in packed.getnames()
        assert not any(name.endswith("trainer_state.pt") for name in packed.getnames())
    # Each run's candidates for a later exact look: its chosen save and its last one.
    with tarfile.open(archive / "a.tar.gz") as packed:
        names = packed.getnames()
    for save in {run["selection"]["chosen"], last}:
        assert f"rt-a/{save}/model.safetensors" in names and f"rt-a/{save}/config.json" in names
    assert not any(name.endswith("trainer_state.pt") for name in names)


def _rl(win, draw_vs_optimal, loss, invalid):
    row = {"win": win, "draw": 1 - win - loss, "loss": loss, "invalid_move_rate": invalid}
    optimal = {"win": 0.0, "draw": draw_vs_optimal, "loss": 1 - draw_vs_optimal}
    return {"random": row | {"format": 1.0}, "optimal": optimal | {"invalid_move_rate": invalid}}


def test_the_merge_picks_the_best_run_by_the_choice_rule(tmp_path):
    # b wins less than a but loses far less and draws more against optimal.
    stages = {"a": _rl(0.80, 0.50, 0.15, 0.0), "b": _rl(0.70, 0.90, 0.05, 0.01)}
    # b reported its save of step 8, chosen over step 10 by validation games (--rl-select).
    choice = {"chosen": "step_000008", "candidates": {"step_000008": {"score": 1.4},
                                                      "step_000010": {"score": 0.9}}}  # fmt: skip
    for name, rl in stages.items():
        out = tmp_path / name
        (out / "rl").mkdir(parents=True)
        lines = [{"step": s, "perf/step_seconds": 1.0 + s, "outcome/win": s / 10} for s in range(1, 11)]  # fmt: skip
        (out / "rl" / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
        result = {
            "args": {"out": str(out)}, "stages": {"sft": rl, "rl": rl},
            "wall_seconds": {"pipeline": 900.0}, "checkpoints": {"rl": str(out / "rl")},
            "machine": {"cuda": "NVIDIA H200", "platform": "linux"},
        }  # fmt: skip
        if name == "b":
            result["selection"] = choice
            result["stages"]["rl_last"] = _rl(0.60, 0.40, 0.30, 0.0)
        (tmp_path / f"{name}.json").write_text(json.dumps(result))
    merged = ROUND.merge_round(tmp_path, {"a": "--seed 0", "b": "--seed 1"})
    assert merged["runs"]["a"]["score"] == pytest.approx(0.5 + 0.8 - 0.3)
    assert merged["runs"]["b"]["score"] == pytest.approx(0.9 + 0.7 - 0.1 - 0.02)
    assert merged["best"] == "b" and merged["runs"]["b"]["rl_steps"] == 10
    curve = merged["runs"]["a"]["curves"]["outcome/win"]
    assert curve == {"first": 0.1, "third": 0.4, "two_thirds": 0.7, "last": 1.0}
    assert merged["runs"]["b"]["selection"] == {
        "chosen": "step_000008", "scores": {"step_000008": 1.4, "step_000010": 0.9}
    }  # fmt: skip
    assert "selection" not in merged["runs"]["a"]
    table = ROUND.summary_table(merged)
    assert "best: b" in table and "step_000008 (0.400)" in table  # 0.4 + 0.6 - 0.6


@pytest.mark.parametrize("bad", [["x"], ["=--seed 0"], ["../a=--seed 0"], ["a=1", "a=2"], []])
def test_run_names_must_be_plain_words_given_once(bad):
    with pytest.raises(SystemExit):
        ROUND.parse_runs(bad)


@pytest.mark.parametrize(
    "bad", [["--rl-select", "-1"], ["--rl-select", "2", "--rl-select-every", "0"],
            ["--rl-select", "2", "--rl-select-games", "0"]],
)  # fmt: skip
def test_the_choice_refuses_settings_it_cannot_keep_naming_them(bad, tmp_path):
    done = subprocess.run(
        [sys.executable, str(BENCH / "tictactoe_mastery.py"), *bad, "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2 and " ".join(bad[-2:]) in done.stderr
    assert not any(tmp_path.iterdir())  # refused before anything ran
