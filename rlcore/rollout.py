"""Runs many rollouts concurrently against one policy.

Rollouts are coroutines; a semaphore caps how many are in flight so an endpoint or the
local engine is never flooded. Each rollout's failure is kept on the rollout (`error`),
never raised, so one bad reply cannot lose a whole evaluation. A stop request (the
caller's `should_stop`) is honoured between turns, not only between rollouts: a batch of
long multi-turn games, all started at once, would otherwise play every game to its end.
"""

from __future__ import annotations

import asyncio
import traceback
from collections.abc import Callable

from rlcore.envs.base import Environment
from rlcore.policy.base import Policy, StopRequested
from rlcore.types import Example, Generation, Message, Rollout, SamplingParams


class _StoppablePolicy(Policy):
    """`policy`, asking `should_stop` before every reply; once told to stop it raises
    StopRequested instead of replying, which ends the rollout (as any PolicyError does)
    and marks it `stopped`. A StopRequested from `policy` itself (the local engine cutting
    a generation short) marks it too."""

    def __init__(self, policy: Policy, should_stop: Callable[[], bool]):
        self.policy = policy
        self.should_stop = should_stop
        self.name = policy.name
        self.stopped = False

    async def generate(
        self,
        messages: list[Message],
        sampling: SamplingParams,
        *,
        tools: list[dict] | None = None,
        state: dict | None = None,
    ) -> Generation:
        if self.stopped or self.should_stop():
            self.stopped = True
            raise StopRequested("stop requested before this turn")
        try:
            return await self.policy.generate(messages, sampling, tools=tools, state=state)
        except StopRequested:
            self.stopped = True
            raise


async def run_rollouts(
    env: Environment,
    policy: Policy,
    examples: list[Example],
    *,
    sampling: SamplingParams,
    rollouts_per_example: int = 1,
    concurrency: int = 32,
    on_result: Callable[[Rollout], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> list[Rollout]:
    """`rollouts_per_example` rollouts of every example, in example order (groups adjacent).

    `should_stop` is asked before each rollout starts and before each of its model turns;
    once it says True, rollouts that have not started are skipped and those in flight end
    after the reply being generated (or sooner, where the policy itself stops: the local
    engine given the same `should_stop`), and both are left out of the result (an
    unfinished game would pass for a lost one). Every rollout returned was played to its
    end and carries the env's facts about it (`Environment.rollout_facts`), a failed one
    included.
    """
    semaphore = asyncio.Semaphore(max(1, concurrency))

    async def one(example: Example) -> Rollout | None:
        async with semaphore:
            if should_stop is not None and should_stop():
                return None
            player = policy if should_stop is None else _StoppablePolicy(policy, should_stop)
            try:
                result = await env.rollout(player, example, sampling)
            except Exception as exc:  # keep the failure with the rollout, name where it came from
                result = Rollout(
                    example_id=example.id,
                    seed=example.seed,
                    group=example.group,
                    messages=list(example.prompt),
                    prompt_len=len(example.prompt),
                    info=dict(example.info),
                    error=f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}",
                )
            if isinstance(player, _StoppablePolicy) and player.stopped:
                return None
            result.facts = env.rollout_facts(result)
        if on_result is not None:
            on_result(result)
        return result

    tasks = [one(ex) for ex in examples for _ in range(rollouts_per_example)]
    return [result for result in await asyncio.gather(*tasks) if result is not None]
