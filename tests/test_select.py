"""Which save is an RL run's result (`RLConfig.select`, rlcore/train/select.py): the best of
the last saves on the env's validation games, on the real tiny model and trainer."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rlcore.envs import load_environment
from rlcore.evaluate import EvalConfig, run_eval, summary_metrics
from rlcore.events import RecordingSink
from rlcore.train.common import TRAINER_STATE
from rlcore.train.config import ConfigError, RLConfig, build_config
from rlcore.train.grpo import run_rl
from rlcore.train.select import choose_save, saved_steps, score
from tests.test_rl import REVERSE_AB, rl_config


def select_config(model: str, tmp_path, **changes) -> RLConfig:
    """test_rl's short reverse-text run, 4 steps saving every step, choosing among the last
    3 saves on 6 validation games."""
    values = {
        "max_steps": 4,
        "save_every": 1,
        "select": {"keep": 3, "num_examples": 6, "seed": 777},
    }
    return rl_config(model, tmp_path, **{**values, **changes})


def validation_reward(model: Path) -> float:
    """A plain greedy eval of `model` on select_config's validation games: its mean reward."""
    config = EvalConfig(
        env="reverse_text", model=str(model), env_args=REVERSE_AB, num_examples=6,
        max_tokens=8, temperature=0.0, seed=777, device="cpu",
    )  # fmt: skip
    return summary_metrics(run_eval(config).summary)["reward/mean"]


def test_the_result_is_the_best_of_the_last_saves_on_validation_games(tiny_model, tmp_path):
    cfg = select_config(tiny_model, tmp_path)
    sink = RecordingSink()
    path = run_rl(cfg, sink)
    out = Path(cfg.output_dir)
    assert path == str(out / "best")
    record = json.loads((out / "select.json").read_text())
    # The last three saves (steps 2 and 3, and the last step's, saved as final/) were
    # each played.
    assert list(record["candidates"]) == ["step_000002", "step_000003", "final"]
    assert [c["step"] for c in record["candidates"].values()] == [2, 3, 4]
    scores = {name: c["score"] for name, c in record["candidates"].items()}
    best = max(scores, key=lambda name: (scores[name], record["candidates"][name]["step"]))
    assert record["chosen"] == best
    # best/ holds the chosen save's weights, without its optimizer state.
    chosen = out / best
    assert (out / "best" / "model.safetensors").read_bytes() == (
        chosen / "model.safetensors"
    ).read_bytes()
    assert not (out / "best" / TRAINER_STATE).exists()
    # The recorded score is what a plain greedy eval of that save on the same games gives.
    assert validation_reward(chosen) == pytest.approx(scores[best], abs=1e-6)
    # The run reports each candidate's score at its step and the chosen save as a checkpoint.
    reported = {step: m["select/score"] for step, m in sink.metrics if "select/score" in m}
    assert sorted(reported) == [2, 3, 4]
    assert sink.checkpoints[-1] == (record["candidates"][best]["step"], path)
    assert any("select: chose" in message for _, message in sink.logs)


def test_the_average_of_the_last_saves_is_one_more_candidate(tiny_model, tmp_path):
    cfg = select_config(tiny_model, tmp_path, select={"keep": 2, "num_examples": 6, "average": 3})
    run_rl(build_config(RLConfig, [("test", {**cfg.to_dict(), "select": {"keep": 0}})]))
    out = Path(cfg.output_dir)
    # The tiny model's few steps barely move it: make the three saves averaged differ.
    names = ("step_000002", "step_000003", "final")
    generator = torch.Generator().manual_seed(0)
    for name in names[:2]:
        weights = load_file(out / name / "model.safetensors")
        noisy = {
            k: v + 0.01 * torch.randn(v.shape, generator=generator) for k, v in weights.items()
        }
        save_file(noisy, out / name / "model.safetensors", metadata={"format": "pt"})
    sink = RecordingSink()
    path, record = choose_save(cfg, sink)
    logs = [message for _, message in sink.logs]
    assert "select: average/ averages the last 3 saves" in logs
    assert any(m.startswith("select: 2 saves (steps 3..4) and average/ x 6 greedy") for m in logs)
    # The last two saves, then average/ of the last three (steps 2, 3 and final's 4).
    assert list(record["candidates"]) == ["step_000003", "final", "average"]
    assert record["candidates"]["average"]["step"] == 4
    saves = [load_file(out / name / "model.safetensors") for name in names]
    averaged = load_file(out / "average" / "model.safetensors")
    assert averaged.keys() == saves[0].keys()
    for name, tensor in averaged.items():
        expected = sum(save[name].double() for save in saves) / 3
        assert tensor.dtype == saves[-1][name].dtype
        assert torch.allclose(tensor.double(), expected, atol=1e-6), name
        assert not torch.equal(tensor, saves[-1][name])
    assert not (out / "average" / TRAINER_STATE).exists()
    assert (out / "average" / "tokenizer.json").is_file()
    # Its score is a plain greedy eval of it on the validation games; it can be the result.
    scored = record["candidates"]["average"]["score"]
    assert validation_reward(out / "average") == pytest.approx(scored, abs=1e-6)
    chosen = record["chosen"]
    assert (Path(path) / "model.safetensors").read_bytes() == (
        out / chosen / "model.safetensors"
    ).read_bytes()
    # The average is a candidate of the choice: without one it is refused, naming the field.
    with pytest.raises(ConfigError) as error:
        select_config(tiny_model, tmp_path, select={"keep": 0, "average": 3})
    assert "select.average" in error.value.errors


def test_a_stop_request_during_the_choice_keeps_what_was_played(tiny_model, tmp_path):
    cfg = select_config(tiny_model, tmp_path, max_steps=2, select={"keep": 2})
    run_rl(build_config(RLConfig, [("test", {**cfg.to_dict(), "select": {"keep": 0}})]))

    class StopAfterOne(RecordingSink):
        def should_stop(self) -> bool:
            return any("select/score" in m for _, m in self.metrics)

    path, record = choose_save(cfg, StopAfterOne())
    assert list(record["candidates"]) == ["step_000001"]
    assert record["chosen"] == "step_000001" and Path(path).name == "best"


def test_a_run_with_a_single_save_takes_it_without_games(tiny_model, tmp_path):
    cfg = select_config(tiny_model, tmp_path, max_steps=1, save_every=5)
    sink = RecordingSink()
    path = run_rl(cfg, sink)
    record = json.loads((Path(cfg.output_dir) / "select.json").read_text())
    assert record["chosen"] == "final" and record["candidates"] == {}
    assert (
        Path(path, "model.safetensors").read_bytes()
        == Path(cfg.output_dir, "final", "model.safetensors").read_bytes()
    )
    assert not any("select/score" in m for _, m in sink.metrics)


def test_saves_are_found_in_step_order_and_incomplete_ones_skipped(tmp_path):
    names = ("step_000010", "step_000002", "final", "step_000005", "notes", "step_x", "step_000020")
    for name in names:  # step 20: an earlier, longer run's, past this run's last step
        (tmp_path / name).mkdir()
        (tmp_path / name / TRAINER_STATE).write_bytes(b"")
    (tmp_path / "step_000007").mkdir()  # weights written, trainer state not yet: incomplete
    found = [(step, path.name) for step, path in saved_steps(tmp_path, 12)]
    assert found == [(2, "step_000002"), (5, "step_000005"), (10, "step_000010"), (12, "final")]


def test_choosing_among_saves_needs_saves(tiny_model, tmp_path):
    with pytest.raises(ConfigError) as error:
        select_config(tiny_model, tmp_path, save_every=0)
    assert "select.keep" in error.value.errors
    with pytest.raises(ConfigError) as error:
        select_config(tiny_model, tmp_path, select={"keep": -1})
    assert "select.keep" in error.value.errors
    with pytest.raises(ValueError, match="no save"):
        choose_save(select_config(tiny_model, tmp_path))


def test_tictactoe_validates_on_full_games_against_the_random_and_the_perfect_opponent():
    training = {"opening_moves": 2, "self_play": 0.5, "min_random_move_prob": 0.3}
    env = load_environment("tictactoe", **training)
    validation = {part.name: part for part in env.validation()}
    assert list(validation) == ["random", "optimal"]
    for name, prob in (("random", 1.0), ("optimal", 0.0)):
        games = load_environment("tictactoe", **{**training, **validation[name].env_args})
        for example in games.examples(40, seed=20_000):
            assert example.info["random_move_prob"] == prob
            assert example.info["opening"] == [] and "self_play" not in example.info
    # The weights are the choice rule tiny-master was picked by: draws against optimal +
    # wins against random - 2 x losses against random - 2 x the mean invalid-move rate.
    summaries = {
        "random": {"outcome/win": 0.8, "outcome/loss": 0.05, "tictactoe/invalid_move_rate": 0.02},
        "optimal": {"outcome/draw": 0.9, "tictactoe/invalid_move_rate": 0.04},
    }
    rule = 0.9 + 0.8 - 2 * 0.05 - 2 * (0.02 + 0.04) / 2
    assert score(summaries, env.validation()) == pytest.approx(rule)
