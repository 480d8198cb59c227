"""Runs many rollouts concurrently against one policy.

Rollouts are coroutines; a semaphore caps how many are in flight so an endpoint or the
local engine is never flooded. Each rollout's failure is kept on the rollout (`error`),
never raised, so one bad reply cannot lose a whole evaluation. A stop request (the
caller's `should_stop`) is honoured between turns, not only between rollouts: a batch of
long multi-turn games, all started at once, would otherwise play every game to its end.
While rollouts run, the garbage collector runs less often (`ROLLOUT_GC_THRESHOLD`).
"""

from __future__ import annotations

import asyncio
import gc
import threading
import traceback
from collections.abc import Callable

from rlcore.envs.base import Environment
from rlcore.policy.base import Policy, StopRequested
from rlcore.types import Example, Generation, Message, Rollout, SamplingParams

# New container objects between the collector's youngest-generation passes while rollouts
# run (Python's default: 700). A large batch keeps millions of token ids alive in lists,
# which every collection of the older generations walks again: at 1,024 tic-tac-toe games
# the default made hundreds of collections a step, a third of its host time or more
# (bench/rl_host_overhead.py --gc-threshold). Collection only comes later; nothing else
# changes.
ROLLOUT_GC_THRESHOLD = 50_000


class _FewerCollections:
    """A context in which the collector's first threshold is at least `threshold`; the
    setting found on entry is put back when the last of overlapping contexts (concurrent
    `run_rollouts`, on any thread) leaves. A disabled collector (threshold 0) stays so."""

    def __init__(self, threshold: int):
        self.threshold = threshold
        self._lock = threading.Lock()
        self._inside = 0
        self._saved: tuple[int, ...] = ()

    def __enter__(self) -> None:
        with self._lock:
            if self._inside == 0:
                self._saved = gc.get_threshold()
                if 0 < self._saved[0] < self.threshold:
                    gc.set_threshold(self.threshold, *self._saved[1:])
            self._inside += 1

    def __exit__(self, *_) -> None:
        with self._lock:
            self._inside -= 1
            if self._inside == 0:
                gc.set_threshold(*self._saved)


# Rollouts, and the trainer's building of a step's sequences from them, run inside this.
fewer_collections = _FewerCollections(ROLLOUT_GC_THRESHOLD)


class _FrozenHeap:
    """While a run trains, the objects its setup left (the libraries' modules, the model, the
    tokenizer: ~400,000 objects in the tiny model's run) sit in the collector's permanent
    generation, so its full collections walk only what the steps made: a full collection
    of a 256-game tic-tac-toe step took ~160 ms with them and ~15 ms without
    (bench/gc_pauses.py), and one came every few steps. `freeze` collects once, then
    freezes; `thaw` puts the objects back for the collector when the last of overlapping
    runs (threads of one worker process) ends, so a long-lived process that runs many jobs
    frees their cycles as before."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inside = 0

    def freeze(self) -> None:
        with self._lock:
            if self._inside == 0:
                gc.collect()
                gc.freeze()
            self._inside += 1

    def thaw(self) -> None:
        with self._lock:
            self._inside -= 1
            if self._inside == 0:
                gc.unfreeze()


# RL runs' step loops (the trainer's and the rollout actors') run between freeze and thaw.
frozen_heap = _FrozenHeap()


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
    with fewer_collections:
        results = await asyncio.gather(*tasks)
    return [result for result in results if result is not None]
