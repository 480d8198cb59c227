"""Hostile model replies never crash an environment: for every registered environment,
10,000 generated replies (huge digit strings, deep brackets and JSON, unicode and NUL
bytes, nested and unclosed tags, very long text, valid-looking answers with garbage, tool
calls made of all of these) are played through the env's own rollout loop and rubric,
the code RL and evaluation run, and each rollout ends without an exception, with every
reward finite and inside the range the rubric declares. In Play a hostile reply is an
invalid move, counted and answered, not a failed turn."""

from __future__ import annotations

import asyncio
import math
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlcore.envs.registry import ENVIRONMENTS, load_environment
from rlcore.envs.tictactoe_game import parse_move
from rlcore.envs.tictactoe_play import PlaySession
from rlcore.policy.base import Policy
from rlcore.types import Generation, SamplingParams
from webapp.play import services
from webapp.play.models import Game
from workers import play_tasks

EXAMPLES_PER_ENV = 10_000
SAMPLING = SamplingParams(temperature=0.0, max_tokens=16)

# The issue's own reply, and the other two that used to raise.
REPORTED = [
    "<move>" + "0" * 4400 + "4</move>",
    '<tool_call>{"name": "calculate", "arguments": {"expression": ' + "7" * 5000 + "}}</tool_call>",
    "<tool_call>" + "[" * 100_000 + "</tool_call>",
]

TAGS = [
    "<think>", "</think>", "<move>", "</move>", "<answer>", "</answer>", "<reversed>",
    "</reversed>", "<tool_call>", "</tool_call>", "\\boxed{", "\\boxed", "{", "}", "\\frac",
    "\\dfrac12", "\\", "<", ">", "/", "\x00", "\n", " ",
]  # fmt: skip
VALID_LOOKING = [
    "<think>Empty: 0 1 2 3 4 5 6 7 8.</think><move>4</move>",
    "<move>4</move>", "<move>+04</move>", "<move>-0</move>", "<move>9</move>",
    "<answer>42</answer>", "<answer>1,234</answer>", "<answer>7/8</answer>",
    "<answer>1e999</answer>", "<answer>-3.5</answer>", "<reversed>cba</reversed>",
    "The answer is \\boxed{\\frac{1}{2}}.", "\\boxed{0.5}", "\\boxed{x = 1/2}",
    "\\boxed{1/0}", "\\boxed{9^{9^{9^9}}}", "\\boxed{1e999999}",
    '<tool_call>{"name": "calculate", "arguments": {"expression": "(37 * 12) - 145 / 5"}}'
    "</tool_call>",
    '<tool_call>{"name": "calculate", "arguments": {"expression": "1/0"}}</tool_call>',
    '<tool_call>{"name": "calculate", "arguments": "{\\"expression\\": 1}"}</tool_call>',
]  # fmt: skip


def _nested_json(depth: int) -> str:
    return '{"a": ' * depth + "1" + "}" * depth


digits = st.one_of(
    st.integers(0, 6000).map(lambda n: "9" * n),
    st.tuples(st.integers(0, 6000), st.sampled_from("0123456789")).map(lambda t: "0" * t[0] + t[1]),
    st.integers(-(10**30), 10**30).map(str),
)
brackets = st.one_of(
    st.integers(1, 5000).map(lambda n: "[" * n),
    st.integers(1, 5000).map(lambda n: "{" * n + "}" * (n // 2)),
    st.integers(1, 3000).map(_nested_json),
    st.integers(1, 3000).map(lambda n: "(" * n + "1" + ")" * n),
    st.integers(1, 80).map(lambda n: "{" * n + "1" + "}" * n),
)
fragment = st.one_of(
    st.sampled_from(TAGS),
    st.sampled_from(VALID_LOOKING),
    st.text(max_size=12),  # any unicode, NUL and lone control characters included
    digits,
    brackets,
)
tool_body = st.one_of(
    fragment,
    st.tuples(fragment, fragment).map(
        lambda t: f'{{"name": "calculate", "arguments": {{"expression": {t[0]}}}}}{t[1]}'
    ),
    fragment.map(lambda inner: f'{{"name": {inner}, "arguments": {inner}}}'),
)
piece = st.one_of(
    fragment,
    tool_body.map(lambda body: f"<tool_call>{body}</tool_call>"),
    tool_body.map(lambda body: f"<tool_call>{body}"),  # unclosed
    fragment.map(lambda inner: f"<move>{inner}</move>"),
    fragment.map(lambda inner: f"<answer>{inner}</answer>"),
    fragment.map(lambda inner: f"\\boxed{{{inner}}}"),
)
# Mostly once; sometimes hundreds of times, up to about 20 kilobytes a piece (the
# megabyte replies have a test of their own below).
repeated = st.tuples(piece, st.sampled_from([1, 1, 1, 1, 2, 3, 50, 500, 5000])).map(
    lambda t: t[0] * max(1, min(t[1], 20_000 // max(1, len(t[0]))))
)
replies = st.one_of(
    st.sampled_from(REPORTED),
    st.lists(repeated, min_size=0, max_size=6).map("".join),
)
# Native tool calls as an endpoint may send them: well-formed, or not at all.
native_call = st.one_of(
    st.builds(
        lambda name, arguments: {
            "id": "call_0",
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        },
        st.one_of(st.just("calculate"), fragment),
        tool_body,
    ),
    st.sampled_from([{}, {"function": "calculate"}, {"function": {"name": 7}}, "call", 3]),
)
text_turns = st.lists(replies.map(lambda text: (text, None)), min_size=1, max_size=3)
tool_turns = st.lists(
    st.tuples(replies, st.one_of(st.none(), st.lists(native_call, min_size=1, max_size=3))),
    min_size=1,
    max_size=3,
)
# Pathological for a parser that rescans from every opening tag (about a megabyte each),
# and for math-verify's LaTeX grammar (time exponential in brace depth).
PATHOLOGICAL_REPLIES = [
    "\\boxed{" + "{" * 60 + "1" + "}" * 60 + "}",
    "<move>" * 170_000,
    "\\boxed{" * 140_000,
    "<tool_call>" * 90_000,
    "<think>" + "</think>" * 120_000,
    "<answer>" * 120_000,
    "<reversed>" * 100_000,
]


class ScriptedPolicy(Policy):
    """The outside world: answers each turn with the next scripted reply, cycling."""

    name = "scripted"

    def __init__(self, script: list[tuple[str, list | None]]):
        self.script = script
        self.calls = 0

    async def generate(self, messages, sampling, *, tools=None, state=None) -> Generation:
        text, tool_calls = self.script[self.calls % len(self.script)]
        self.calls += 1
        return Generation(text=text, tool_calls=tool_calls)


_LOOP = asyncio.new_event_loop()
_ENVS = {name: load_environment(name) for name in ENVIRONMENTS}
_EXAMPLES = {name: env.examples(8, seed=11) for name, env in _ENVS.items()}


def _within(value: float, bounds: tuple[float, float]) -> bool:
    return math.isfinite(value) and bounds[0] - 1e-9 <= value <= bounds[1] + 1e-9


# Only the tool env reads native tool calls; the others get text alone. Each generated
# script is played through every env of its kind: drawing the replies is most of the cost.
KINDS = {
    "text replies": (text_turns, [name for name in ENVIRONMENTS if name != "calculator"]),
    "tool calls": (tool_turns, ["calculator"]),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_hostile_replies_score_as_wrong_answers_in_every_environment(kind):
    scripts, names = KINDS[kind]
    assert set(ENVIRONMENTS) == {n for _, group in KINDS.values() for n in group}
    for env_name in names:
        bounds, total_bounds = _ENVS[env_name].rubric.bounds, _ENVS[env_name].rubric.reward_bounds()
        assert total_bounds is not None, (
            f"{env_name}: every weighted reward function declares bounds"
        )
        assert all(bounds.values()), f"{env_name}: undeclared bounds in {bounds}"

    @settings(
        max_examples=EXAMPLES_PER_ENV,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(script=scripts, example_index=st.integers(0, 7))
    def play(script, example_index):
        for env_name in names:
            try:
                check_rollout(_ENVS[env_name], script, _EXAMPLES[env_name][example_index])
            except AssertionError as failed:
                raise AssertionError(f"{env_name}: {failed}") from failed

    play()


def check_rollout(env, script, example) -> None:
    """One rollout of `script` through the env's own loop and rubric: no exception, every
    reward finite and inside the rubric's declared bounds."""
    bounds, total_bounds = env.rubric.bounds, env.rubric.reward_bounds()
    rollout = _LOOP.run_until_complete(env.rollout(ScriptedPolicy(script), example, SAMPLING))
    assert rollout.error is None, rollout.error
    for name, value in rollout.rewards.items():
        assert _within(value, bounds[name]), (name, value, bounds[name])
    assert _within(rollout.reward, total_bounds), (rollout.reward, total_bounds)
    assert all(math.isfinite(v) for v in env.rollout_metrics(rollout).values())
    per_turn = env.turn_rewards(rollout)
    assert per_turn is None or all(math.isfinite(v) for v in per_turn)


@pytest.mark.parametrize("env_name", list(ENVIRONMENTS))
def test_pathological_replies_are_scored_in_linear_time(env_name):
    """Where a parser rescanned the text from every opening tag, each megabyte reply took
    minutes (20,000 `\\boxed{` alone took 140 s), and math-verify did not finish the
    60-deep braces in 5 minutes; now all of them together take about a second. The 50 s
    bound leaves room for a busy machine and still trips on either returning."""
    env = _ENVS[env_name]
    started = time.monotonic()
    for text in PATHOLOGICAL_REPLIES:
        check_rollout(env, [(text, None)], _EXAMPLES[env_name][0])
    assert time.monotonic() - started < 50.0


@settings(max_examples=2_000, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(text=replies)
def test_a_hostile_reply_in_play_is_an_invalid_move_with_a_reason(text):
    session = PlaySession.new("X", True, seed=1)
    board = list(session.board)
    result = _LOOP.run_until_complete(
        session.model_turn(ScriptedPolicy([(text, None)]), SamplingParams(), max_attempts=1)
    )
    cell, error = parse_move(text, board)
    assert result["valid"] == (error is None) and result["move"] == cell
    if error is not None:
        assert session.invalid_moves == 1 and session.forfeited and result["error"] == error
    [reply] = play_tasks.replies_from(session.messages[1:], board, move_number=1)
    assert reply["valid"] == result["valid"] and reply["error"] == result["error"]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("hostile", REPORTED, ids=["4400-digit move", "5000-digit call", "deep"])
def test_the_play_worker_task_counts_a_hostile_reply_as_an_invalid_move(
    alice, hostile, monkeypatch
):
    """The real task, run in-process, with the model replaced by the outside world: a
    policy whose every reply is `hostile`. Three invalid tries, then a forfeit, never a
    failed turn."""
    game = Game(owner=alice, player="builtin-constant", player_name="hostile",
                policy={"kind": "builtin", "model": "constant"}, sampling=services.PLAY_SAMPLING,
                model_mark="X", model_starts=True)  # fmt: skip
    services._state_from(game, PlaySession.new("X", True, seed=3))
    game.save()
    monkeypatch.setattr(play_tasks, "policy_for", lambda policy: ScriptedPolicy([(hostile, None)]))

    status = play_tasks.play_model_move(game.pk)

    game = Game.objects.get(pk=game.pk)
    assert status != "failed" and not game.error
    assert game.session["forfeited"] is True and game.session["invalid_moves"] == 3
    assert [reply["valid"] for reply in game.replies] == [False, False, False]
    assert all(reply["error"] for reply in game.replies)
