"""Runs many rollouts concurrently against one policy.

Rollouts are coroutines; a semaphore caps how many are in flight so an endpoint or the
local engine is never flooded. Each rollout's failure is kept on the rollout (`error`),
never raised, so one bad reply cannot lose a whole evaluation.
"""

from __future__ import annotations

import asyncio
import traceback
from collections.abc import Callable

from rlcore.envs.base import Environment
from rlcore.policy.base import Policy
from rlcore.types import Example, Rollout, SamplingParams


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

    `should_stop` is asked before each rollout starts; once it says True, rollouts that have
    not started are skipped (left out of the result) while those in flight finish, so a
    cancelled run still returns every rollout it paid for.
    """
    semaphore = asyncio.Semaphore(max(1, concurrency))

    async def one(example: Example) -> Rollout | None:
        async with semaphore:
            if should_stop is not None and should_stop():
                return None
            try:
                result = await env.rollout(policy, example, sampling)
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
        if on_result is not None:
            on_result(result)
        return result

    tasks = [one(ex) for ex in examples for _ in range(rollouts_per_example)]
    return [result for result in await asyncio.gather(*tasks) if result is not None]
