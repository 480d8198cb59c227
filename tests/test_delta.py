"""`python -m rlcore delta`: two models on the same held-out examples, compared example by
example with a 95 % interval; a real improvement is "higher" beyond noise, a model
against itself is no clear difference."""

from __future__ import annotations

import json

import pytest

from rlcore.cli import HELD_OUT_SEED, main
from rlcore.delta import held_out_delta, paired_delta, t95
from rlcore.envs import load_environment


async def test_the_oracle_against_a_constant_string_is_higher_beyond_noise():
    env = load_environment("math")
    players = env.builtin_policies()
    report = await held_out_delta(
        env, players["constant"](), players["oracle"](), env_name="math", base_name="constant",
        trained_name="oracle", num_examples=12, seed=HELD_OUT_SEED,
    )  # fmt: skip
    by_name = {m.name: m for m in report.metrics}
    assert report.metrics[0].name == "reward"
    assert by_name["reward"].delta == 1.0 and by_name["reward"].verdict == "higher"
    assert by_name["outcome/incorrect"].verdict == "lower"
    assert by_name["reward/format"].verdict == "no clear difference"


async def test_a_model_against_itself_shows_no_clear_difference():
    env = load_environment("tictactoe")
    players = env.builtin_policies()
    report = await held_out_delta(
        env, players["random"](), players["random"](), env_name="tictactoe",
        base_name="random", trained_name="random", num_examples=16, seed=7,
    )  # fmt: skip
    reward = report.metrics[0]
    assert reward.verdict == "no clear difference"
    assert reward.low <= 0 <= reward.high


def test_the_interval_narrows_with_more_examples_and_pairs_differences():
    noisy = paired_delta("m", [0, 1, 0, 1], [1, 1, 1, 0])
    assert noisy.verdict == "no clear difference"
    steady = paired_delta("m", [0.2, 0.5, 0.9, 0.4] * 5, [0.3, 0.6, 1.0, 0.5] * 5)
    # Base values spread widely, but every pair differs by +0.1: pairing sees it.
    assert steady.delta == pytest.approx(0.1)
    assert steady.verdict == "higher" and steady.high - steady.low < 1e-9
    assert t95(1) > t95(10) > t95(1000) == 1.96


def test_the_cli_answers_and_writes_json(tmp_path, capsys):
    out = tmp_path / "delta.json"
    code = main(["delta", "math", "--base", "constant", "--trained", "oracle", "-n", "6",
                 "--out", str(out)])  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0
    assert "did training help? yes: reward +1.000" in printed
    assert json.loads(out.read_text())["metrics"][0]["verdict"] == "higher"
    assert main(["delta", "nonesuch", "--base", "constant", "--trained", "oracle"]) == 2
    assert "unknown environment 'nonesuch'" in capsys.readouterr().err
