"""`python -m rlcore audit`: the shipped code and math verifiers pass it, and verifiers
made brittle or exploitable on purpose (the same env with one reward changed) are
caught; verification that would bound an RL step is warned about."""

from __future__ import annotations

import json

import pytest

from rlcore.audit import format_report, run_audit
from rlcore.cli import main
from rlcore.envs import load_environment
from rlcore.envs.math_env import MathEnv, correct_reward, format_reward, last_boxed
from rlcore.parsers import last_assistant_text
from rlcore.rubric import Rubric


class LiteralMathEnv(MathEnv):
    """Math whose answer must be written exactly as the oracle writes it."""

    def build_rubric(self) -> Rubric:
        def literal(*, completion, state, **_) -> float:
            boxed = last_boxed(last_assistant_text(completion))
            return 1.0 if boxed == state["answer_latex"] else 0.0

        rubric = Rubric()
        rubric.add(literal, 1.0, name="correct", bounds=(0.0, 1.0))
        return rubric


class FormatPaysMathEnv(MathEnv):
    """Math that pays as much for any boxed answer as for the right one."""

    def build_rubric(self) -> Rubric:
        rubric = Rubric()
        rubric.add(correct_reward, 1.0, name="correct", bounds=(0.0, 1.0))
        rubric.add(format_reward, 1.0, name="format", bounds=(0.0, 1.0))
        return rubric


async def test_the_code_env_passes_every_check():
    env = load_environment("code", parallel_jails=2)
    report = await run_audit(env, env_name="code", num_examples=6, step_seconds=1000)
    assert report.oracle_mean == 1.0
    names = {player.name for player in report.exploits}
    assert {
        "exploit: print the expected output",
        "exploit: sys.exit(0)",
        "exploit: monkeypatch the test runner",
        "random text",
    } <= names
    assert all(player.ok for player in report.exploits), format_report(report)
    assert {v.name for v in report.variants} >= {"CRLF line ends", "tabs for indentation"}
    assert all(v.flipped == 0 for v in report.variants), format_report(report)
    assert report.passed and report.warnings == []
    # Verification is spread over the env's jails, and a 1000 s step is not bounded by it.
    assert report.throughput["parallel_verifiers"] == 2
    assert report.throughput["verify_seconds_per_step"] == pytest.approx(
        report.throughput["verify_seconds_per_rollout"] * 64 / 2
    )
    assert report.throughput["bounds_step"] is False


async def test_math_scores_equivalent_forms_alike_and_a_literal_checker_does_not():
    sound = await run_audit(MathEnv(), env_name="math", num_examples=12)
    assert all(v.flipped == 0 for v in sound.variants), format_report(sound)

    brittle = await run_audit(LiteralMathEnv(), env_name="literal math", num_examples=12)
    flipped = {v.name for v in brittle.variants if v.flipped}
    assert {"a/b instead of \\frac", "x = in the box"} <= flipped
    assert any("flips the reward" in warning for warning in brittle.warnings)
    assert "FLIPS" in format_report(brittle)


async def test_a_reward_for_format_alone_is_reported_as_an_exploit():
    sound = await run_audit(MathEnv(), env_name="math", num_examples=8)
    assert all(player.ok for player in sound.exploits)

    exploitable = await run_audit(FormatPaysMathEnv(), env_name="format pays", num_examples=8)
    constant = next(p for p in exploitable.exploits if p.name == "env's constant")
    assert not constant.ok and constant.share_of_oracle > 0.4
    assert not exploitable.passed


@pytest.mark.parametrize(("step_seconds", "bounds"), [(1e-6, True), (10_000.0, False)])
async def test_throughput_warns_only_when_verification_would_bound_the_step(step_seconds, bounds):
    report = await run_audit(MathEnv(), env_name="math", num_examples=4, step_seconds=step_seconds)
    throughput = report.throughput
    assert throughput["verify_seconds_per_rollout"] > 0
    assert throughput["verify_seconds_per_step"] == pytest.approx(
        throughput["verify_seconds_per_rollout"] * 64
    )
    assert throughput["bounds_step"] is bounds
    assert any("would bound the step" in warning for warning in report.warnings) is bounds


def test_the_cli_prints_the_report_and_writes_json(tmp_path, capsys):
    out = tmp_path / "audit.json"
    code = main(["audit", "math", "-n", "4", "--step-seconds", "1000", "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0
    assert "trivial exploits" in printed and "format brittleness" in printed
    report = json.loads(out.read_text())
    assert report["env"] == "math" and report["num_examples"] == 4
    assert {"exploits", "variants", "throughput", "warnings"} <= set(report)


def test_the_cli_names_a_bad_env_and_exits_2(capsys):
    assert main(["audit", "nonesuch"]) == 2
    assert "unknown environment 'nonesuch'" in capsys.readouterr().err
