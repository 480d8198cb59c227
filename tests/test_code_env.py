"""The code environment: the shipped task set (every reference solution passes its hidden
tests in the jail), prompts that never show a test, the reward as the fraction of tests
passed, reading code out of a reply, and verification that overlaps other rollouts."""

from __future__ import annotations

import asyncio
import time

import pytest

from rlcore.envs import load_environment
from rlcore.envs.code_env import (
    CodeEnv,
    extract_code,
    load_tasks,
    parse_test,
    tasks_by_id,
    values_equal,
)
from rlcore.policy.base import Policy
from rlcore.rollout import run_rollouts
from rlcore.sandbox import SandboxUnavailable
from rlcore.types import Generation, SamplingParams

SAMPLING = SamplingParams(max_tokens=64)


@pytest.fixture(scope="module")
def env() -> CodeEnv:
    return load_environment("code", parallel_jails=2, wall_seconds=5)


class ReplyPolicy(Policy):
    """Replies with `reply(task)`, after an optional delay standing in for generation."""

    name = "reply"

    def __init__(self, reply, delay: float = 0.0):
        self.reply = reply
        self.delay = delay

    async def generate(self, messages, sampling, *, tools=None, state=None) -> Generation:
        await asyncio.sleep(self.delay)
        return Generation(text=self.reply(tasks_by_id()[state["task"]]))


def test_the_task_set_is_large_and_every_task_well_formed():
    tasks = load_tasks()
    assert len(tasks) >= 100
    assert len({t.id for t in tasks}) == len(tasks)
    assert len({t.entry_point for t in tasks}) == len(tasks)
    assert all(len(t.tests) >= 3 for t in tasks)
    assert all(t.signature.startswith(f"def {t.entry_point}(") for t in tasks)


def test_every_reference_solution_passes_its_hidden_tests_in_the_sandbox(env):
    tasks = load_tasks()
    futures = [env.verifier.pool.submit(env.verifier.verify, t, t.solution) for t in tasks]
    failing = {
        task.id: future.result().reason
        for task, future in zip(tasks, futures, strict=True)
        if future.result().passed != len(task.tests)
    }
    assert failing == {}


def test_prompts_never_show_a_hidden_test(env):
    for example in env.examples(len(load_tasks()), seed=5):
        task = tasks_by_id()[example.info["task"]]
        shown = "\n".join(m["content"] for m in example.prompt)
        assert task.signature in shown
        for test in task.tests:
            assert test.source not in shown
            call = test.source.split("==")[0].strip()
            assert call not in shown


def test_a_dataset_longer_than_the_task_set_repeats_each_task_once_per_pass(env):
    count = len(load_tasks())
    ids = [ex.info["task"] for ex in env.examples(2 * count, seed=1)]
    assert sorted(ids[:count]) == sorted(ids[count:]) == sorted(t.id for t in load_tasks())
    assert ids[:count] != ids[count:]


async def test_the_reward_is_the_fraction_of_hidden_tests_passed(env):
    example = next(ex for ex in env.examples(200, seed=0) if ex.info["task"] == "is_prime")
    # Right on 2, 1, 91 and -7; wrong on 97, a prime.
    half_right = "```python\ndef is_prime(n):\n    return n == 2\n```"
    rollout = await env.rollout(ReplyPolicy(lambda task: half_right), example, SAMPLING)
    assert rollout.rewards["tests"] == pytest.approx(4 / 5)
    assert rollout.rewards["format"] == 1.0
    assert rollout.outcome == "partial"
    verdict = rollout.state["verdict"]
    assert verdict["tests"][2] == "wrong answer: returned False"
    assert verdict["tests"].count("passed") == 4
    assert env.rollout_facts(rollout)["tests_passed"] == pytest.approx(0.8)
    assert "4 of 5 tests passed" in env.state_views(rollout.state)[0]["text"]


@pytest.mark.parametrize(
    ("reply", "reason"),
    [
        ("def is_prime(n):\n    return True", "no ```python code block"),
        ("```python\ndef is_prime(n) return True\n```", "SyntaxError"),
        ("```python\ndef prime(n):\n    return True\n```", "defines no function 'is_prime'"),
        ("```python\nimport sys\nsys.exit(0)\n```", "SystemExit"),
    ],
)
async def test_replies_that_do_not_define_the_function_score_zero_with_a_reason(env, reply, reason):
    example = next(ex for ex in env.examples(200, seed=0) if ex.info["task"] == "is_prime")
    rollout = await env.rollout(ReplyPolicy(lambda task: reply), example, SAMPLING)
    assert rollout.reward == 0.0
    assert rollout.rewards["format"] == 0.0
    assert reason in rollout.state["verdict"]["reason"]
    assert rollout.outcome == "failed"


def test_the_last_fenced_block_after_thinking_is_the_code():
    reply = (
        "<think>```python\ndef draft(): pass\n```</think>First try:\n```py\nA = 1\n```\n"
        "Final:\n```python\nB = 2\n```\nDone."
    )
    assert extract_code(reply) == "B = 2\n"
    assert extract_code("```\nC = 3\n```") == "C = 3\n"
    assert extract_code("<think>```python\nD = 4\n```</think>no code") is None
    assert extract_code("```python\nunclosed") is None


def test_test_lines_must_be_a_call_compared_to_a_literal():
    test = parse_test("add(1, [2, 3]) == (4, 'x')", "add")
    assert test.arguments == (1, [2, 3]) and test.expected == (4, "x")
    for bad in ("add(1) != 2", "other(1) == 2", "add(x) == 2", "add(1)[0] == 2"):
        with pytest.raises(ValueError, match="test"):
            parse_test(bad, "add")


def test_values_compare_like_an_assert_with_float_tolerance():
    assert values_equal(0.1 + 0.2, 0.3)
    assert values_equal(2, 2.0)
    assert not values_equal([1, 2], (1, 2))
    assert not values_equal("1", 1)
    assert not values_equal(True, 1.0)
    assert values_equal({"a": [1.0000000001]}, {"a": [1.0]})


async def test_oracle_scores_one_and_the_random_and_constant_players_near_zero(env):
    examples = env.examples(8, seed=2)
    means = {}
    for name in ("oracle", "random", "constant"):
        policy = env.builtin_policies()[name]()
        rollouts = await run_rollouts(env, policy, examples, sampling=SAMPLING)
        assert all(r.error is None for r in rollouts), [r.error for r in rollouts]
        means[name] = sum(r.reward for r in rollouts) / len(rollouts)
    assert means["oracle"] == 1.0
    assert means["random"] < 0.2 and means["constant"] < 0.2


async def test_verification_overlaps_other_rollouts_and_is_a_metric(env):
    # Each reply's tests take about 0.6 s in the jail; with two jails and replies
    # generated concurrently, four rollouts take far less than four verifications.
    slow = "```python\nimport time\ndef {name}(*args):\n    time.sleep(0.15)\n```"
    policy = ReplyPolicy(lambda task: slow.format(name=task.entry_point), delay=0.05)
    examples = env.examples(4, seed=9)
    started = time.monotonic()
    rollouts = await run_rollouts(env, policy, examples, sampling=SAMPLING, concurrency=4)
    elapsed = time.monotonic() - started
    verify_seconds = [env.rollout_metrics(r)["verify_seconds"] for r in rollouts]
    assert all(s > 0.3 for s in verify_seconds)
    assert elapsed < 0.8 * sum(verify_seconds)


async def test_without_a_sandbox_no_candidate_code_runs():
    env = load_environment("code", parallel_jails=1)
    env.verifier.sandbox.bwrap = "/nonexistent/bwrap"
    example = env.make_example(0, 0)
    with pytest.raises(SandboxUnavailable, match="never runs outside a jail"):
        await env.rollout(
            ReplyPolicy(lambda task: f"```python\n{task.solution}```"), example, SAMPLING
        )
