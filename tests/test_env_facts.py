"""What environments declare for the rollout inspector: typed facts per rollout (filled by
`run_rollouts` when a rollout ends, failed ones included) and how a final state is drawn."""

from __future__ import annotations

import pytest

from rlcore.envs import Fact, load_environment
from rlcore.envs.calculator import CalculatorOraclePolicy
from rlcore.envs.double_check import DoubleCheckOraclePolicy
from rlcore.envs.registry import ENVIRONMENTS
from rlcore.envs.tictactoe_players import OraclePolicy
from rlcore.policy.base import Policy
from rlcore.rollout import run_rollouts
from rlcore.types import Generation, Rollout, SamplingParams

SAMPLING = SamplingParams()


class InvalidThenOracle(Policy):
    """`invalid` replies without a move, then perfect play."""

    name = "invalid-then-oracle"

    def __init__(self, invalid: int):
        self.invalid = invalid

    async def generate(self, messages, sampling, *, tools=None, state=None) -> Generation:
        if self.invalid:
            self.invalid -= 1
            return Generation(text="no move here")
        return await OraclePolicy().generate(messages, sampling, state=state)


class Broken(Policy):
    """Fails the way a bug does (not a PolicyError), so the rollout keeps only its example."""

    name = "broken"

    async def generate(self, messages, sampling, *, tools=None, state=None) -> Generation:
        raise RuntimeError("boom")


async def test_tictactoe_facts_are_its_invalid_moves_and_opponent_strength():
    env = load_environment("tictactoe", max_turns=20)
    examples = env.examples(3, seed=5)
    for example in examples:
        (rollout,) = await run_rollouts(env, InvalidThenOracle(2), [example], sampling=SAMPLING)
        assert rollout.facts == {
            "invalid_moves": 2,
            "random_move_prob": example.info["random_move_prob"],
        }
        assert isinstance(rollout.facts["invalid_moves"], int)
        # The facts travel with the rollout's JSON form (results.jsonl, the database).
        assert Rollout.from_dict(rollout.to_dict()).facts == rollout.facts
    assert [f.name for f in env.facts] == ["invalid_moves", "random_move_prob"]
    assert env.facts[1].label == "opponent random p" and env.facts[1].type == "float"


async def test_a_failed_rollout_keeps_the_facts_its_example_knows():
    env = load_environment("tictactoe")
    (example,) = env.examples(1, seed=2)
    (rollout,) = await run_rollouts(env, Broken(), [example], sampling=SAMPLING)
    assert "RuntimeError: boom" in rollout.error
    # No game was played, so no invalid-move count; the opponent's strength is known.
    assert rollout.facts == {"random_move_prob": example.info["random_move_prob"]}


async def test_tool_and_question_envs_declare_their_own_facts():
    calculator = load_environment("calculator")
    rollouts = await run_rollouts(
        calculator, CalculatorOraclePolicy(), calculator.examples(2, seed=0), sampling=SAMPLING
    )
    assert [r.facts for r in rollouts] == [{"tool_calls": 1, "tool_errors": 0}] * 2
    double_check = load_environment("double_check")
    examples = double_check.examples(2, seed=0)
    rollouts = await run_rollouts(
        double_check, DoubleCheckOraclePolicy(), examples, sampling=SAMPLING
    )
    assert [r.facts for r in rollouts] == [{"kind": e.info["kind"]} for e in examples]
    # An env that declares nothing stores nothing.
    math = load_environment("math")
    assert math.facts == [] and math.rollout_facts(rollouts[0]) == {}


def test_every_registered_env_declares_distinct_well_formed_facts():
    for name in ENVIRONMENTS:
        env = load_environment(name)
        names = [fact.name for fact in env.facts]
        assert len(names) == len(set(names)), name
        assert env.state_views({}) == [], name  # an empty state draws nothing, and no error


def test_a_fact_keeps_only_values_of_its_type():
    count = Fact("moves", "moves", "int")
    share = Fact("share", "share", "float")
    label = Fact("label", "label", "str")
    assert [count.coerce(v) for v in (3, 3.0, 3.5, True, "3", None)] == [
        3,
        3,
        None,
        None,
        None,
        None,
    ]
    assert [share.coerce(v) for v in (1, 0.5, float("nan"), float("inf"))] == [1.0, 0.5, None, None]
    assert [label.coerce(v) for v in ("a", 1)] == ["a", None]
    with pytest.raises(TypeError, match="type must be one of"):
        Fact("flag", "flag", "bool")
    with pytest.raises(TypeError, match="lower-case"):
        Fact("Bad Name", "bad", "int")
