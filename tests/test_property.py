"""Property tests: whatever a model writes, no environment or parser crashes.

Arbitrary replies (random text mixed with the tags, boxes and tool calls the verifiers
look for, plus native tool calls and truncated generations) are played through EVERY
registered environment, so an environment added to the registry is covered here without
a new test. Rewards must be finite floats under the rubric's names, outcome labels must
come from the environment's declared `outcome_labels`, metrics must be finite, and the
rollout must survive the JSON round trip the database and results.jsonl use.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlcore.envs.base import ToolEnv, parse_text_tool_calls
from rlcore.envs.calculator import calculate, evaluate_arithmetic, parse_number
from rlcore.envs.math_env import answer_matches, last_boxed, latex_to_arithmetic
from rlcore.envs.registry import ENVIRONMENTS, load_environment
from rlcore.envs.reverse_text import lcs_length, lcs_ratio, parse_reversal
from rlcore.parsers import ThinkParser, XMLParser
from rlcore.policy.base import Policy
from rlcore.types import Generation, Rollout, SamplingParams

# No example database: the tests stay fast and leave nothing behind in the checkout.
PROPERTY = settings(
    max_examples=40,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)

FRAGMENTS = [
    "<think>",
    "</think>",
    "<answer>",
    "</answer>",
    "<reversed>",
    "</reversed>",
    "<move>",
    "</move>",
    "<text>",
    "\\boxed{",
    "\\boxed",
    "{",
    "}",
    "\\frac{1}{2}",
    "\\dfrac12",
    "\\",
    "<tool_call>",
    "</tool_call>",
    '{"name": "calculate", "arguments": {"expression": "1/0"}}',
    '{"name": "calculate", "arguments": {"expression": "(2 + 3) * 4"}}',
    '{"name": "calculate", "arguments": {"expr": 1}}',
    '{"name": "calculate", "arguments": "not an object"}',
    '{"name": 5}',
    "[]",
    "4",
    "-1",
    "0.5",
    "1/0",
    "1e999",
    "9^{9^{9}}",
    "NaN",
    "1,000",
    "\x00",
    " ",
    "\n",
]

reply_texts = st.lists(
    st.one_of(st.text(max_size=12), st.sampled_from(FRAGMENTS)), max_size=10
).map("".join)

native_tool_calls = st.lists(
    st.fixed_dictionaries(
        {
            "id": st.text(max_size=6),
            "type": st.just("function"),
            "function": st.fixed_dictionaries(
                {
                    "name": st.sampled_from(["calculate", "", "missing_tool"]),
                    "arguments": st.one_of(
                        reply_texts,
                        st.dictionaries(
                            st.sampled_from(["expression", "x"]), reply_texts, max_size=2
                        ).map(json.dumps),
                    ),
                }
            ),
        }
    ),
    max_size=2,
)

generations = st.builds(
    Generation,
    text=reply_texts,
    finish_reason=st.sampled_from(["stop", "length"]),
    tool_calls=st.one_of(st.none(), native_tool_calls),
)


class ReplayPolicy(Policy):
    """Plays a fixed list of generations in turn (the last one repeats)."""

    name = "replay"

    def __init__(self, replies: list[Generation]):
        self.replies = replies
        self.calls = 0

    async def generate(self, messages, sampling, *, tools=None, state=None) -> Generation:
        reply = self.replies[min(self.calls, len(self.replies) - 1)]
        self.calls += 1
        return reply


@functools.cache
def environment(name: str):
    return load_environment(name)


def assert_finite_floats(values: dict, where: str) -> None:
    for key, value in values.items():
        assert isinstance(value, float), f"{where}[{key!r}] is {type(value).__name__}"
        assert math.isfinite(value), f"{where}[{key!r}] = {value}"


@pytest.mark.parametrize("env_name", sorted(ENVIRONMENTS))
@PROPERTY
@given(
    replies=st.lists(generations, min_size=1, max_size=4),
    index=st.integers(0, 200),
    seed=st.integers(0, 2**31 - 1),
)
def test_any_model_text_gives_a_sound_rollout(env_name, replies, index, seed):
    env = environment(env_name)
    example = env.make_example(index, seed)
    rollout = asyncio.run(env.rollout(ReplayPolicy(replies), example, SamplingParams()))

    assert rollout.error is None
    assert list(rollout.rewards) == env.rubric.names
    assert_finite_floats(rollout.rewards, "rewards")
    assert isinstance(rollout.reward, float) and math.isfinite(rollout.reward)
    expected_total = sum(env.rubric.weights[k] * v for k, v in rollout.rewards.items())
    assert rollout.reward == pytest.approx(expected_total)
    assert rollout.outcome in type(env).outcome_labels, (
        f"{env_name} returned outcome {rollout.outcome!r}, not in its outcome_labels "
        f"{type(env).outcome_labels!r}"
    )
    assert_finite_floats(env.rollout_metrics(rollout), "rollout_metrics")
    breakdowns = env.breakdowns(rollout)
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in breakdowns.items())
    assert 1 <= rollout.num_turns <= env.turn_limit()

    row = json.loads(json.dumps(rollout.to_dict()))
    assert Rollout.from_dict(row).to_dict() == row


@pytest.mark.parametrize("env_name", sorted(ENVIRONMENTS))
@PROPERTY
@given(text=reply_texts)
def test_every_env_parser_reads_any_text(env_name, text):
    parser = environment(env_name).parser
    parsed = parser.parse(text)
    if isinstance(parsed, dict):
        assert all(value is None or isinstance(value, str) for value in parsed.values())


@pytest.mark.parametrize(
    "env_name",
    sorted(name for name in ENVIRONMENTS if issubclass(type(environment(name)), ToolEnv)),
)
@PROPERTY
@given(calls=native_tool_calls)
def test_tool_envs_answer_every_call_with_a_tool_message(env_name, calls):
    env = environment(env_name)
    state = {"tool_calls": 0, "tool_errors": 0}
    messages = [{"role": "assistant", "content": "", "tool_calls": calls}]
    replies = env.env_response(messages, state)
    assert [reply["tool_call_id"] for reply in replies] == [call["id"] for call in calls]
    assert all(reply["role"] == "tool" and isinstance(reply["content"], str) for reply in replies)
    assert state["tool_calls"] == len(calls)
    assert 0 <= state["tool_errors"] <= len(calls)


@PROPERTY
@given(text=reply_texts)
def test_shared_parsers_read_any_text(text):
    parsed = XMLParser(["answer", "think", "move"]).parse(text)
    assert all(value is None or isinstance(value, str) for value in parsed.values())
    think, answer = ThinkParser().parse(text)
    assert (think is None or isinstance(think, str)) and isinstance(answer, str)
    for call in parse_text_tool_calls(text):
        assert isinstance(call["function"]["name"], str)
        assert isinstance(call["function"]["arguments"], str)
        assert call["id"].startswith("call_")


@PROPERTY
@given(text=reply_texts)
def test_answer_readers_read_any_text(text):
    reversal = parse_reversal(text)
    assert reversal is None or isinstance(reversal, str)
    number = parse_number(text)
    assert number is None or isinstance(number, Fraction)
    boxed = last_boxed(text)
    assert boxed is None or isinstance(boxed, str)
    assert answer_matches(boxed, Fraction(1, 2)) in (True, False)
    try:
        arithmetic = latex_to_arithmetic(text)
    except ValueError as exc:
        assert "\\frac" in str(exc)  # only a broken \frac is refused
    else:
        assert isinstance(arithmetic, str)


arithmetic_texts = st.text(alphabet="0123456789+-*/().e ^x_", max_size=40)


@PROPERTY
@given(expression=st.one_of(arithmetic_texts, reply_texts))
def test_the_calculator_tool_returns_a_number_or_a_value_error(expression):
    try:
        result = calculate(expression)
    except ValueError as exc:
        assert str(exc)
        return
    assert parse_number(result) is not None
    value = evaluate_arithmetic(expression)
    assert abs(parse_number(result) - value) <= abs(value) * Fraction(1, 10**10)


def textbook_lcs(first: str, second: str) -> int:
    """The O(len*len) table, row by row, as in any algorithms book."""
    previous = [0] * (len(second) + 1)
    for char in first:
        current = [0]
        for j, other in enumerate(second):
            current.append(previous[j] + 1 if char == other else max(previous[j + 1], current[j]))
        previous = current
    return previous[-1]


@settings(max_examples=200, deadline=None, database=None)
@given(first=st.text(alphabet="abcd", max_size=30), second=st.text(alphabet="abcde", max_size=30))
def test_bit_parallel_lcs_matches_the_textbook_table(first, second):
    assert lcs_length(first, second) == textbook_lcs(first, second)
    ratio = lcs_ratio(first, second)
    assert 0.0 <= ratio <= 1.0
    assert ratio == lcs_ratio(second, first)
    assert (ratio == 1.0) == (first == second)
