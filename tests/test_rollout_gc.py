"""While rollouts run the garbage collector runs less often, and its setting comes back
when the last of overlapping runs ends; the rollouts themselves are the same."""

import asyncio
import gc

import pytest

from rlcore.envs.registry import load_environment
from rlcore.policy.base import ConstantPolicy
from rlcore.rollout import ROLLOUT_GC_THRESHOLD, run_rollouts
from rlcore.types import SamplingParams

SAMPLING = SamplingParams(max_tokens=8)


class ThresholdWatcher(ConstantPolicy):
    """Plays a constant move, noting the collector's first threshold at every reply."""

    def __init__(self):
        super().__init__()
        self.seen = set()

    async def generate(self, messages, sampling, *, tools=None, state=None):
        self.seen.add(gc.get_threshold()[0])
        await asyncio.sleep(0)
        return await super().generate(messages, sampling, tools=tools, state=state)


@pytest.fixture
def default_threshold():
    saved = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    yield
    gc.set_threshold(*saved)


def play(env, policy, runs: int):
    examples = [env.make_example(index, 0) for index in range(4)]

    async def overlapping():
        return await asyncio.gather(
            *(run_rollouts(env, policy, examples, sampling=SAMPLING) for _ in range(runs))
        )

    return asyncio.run(overlapping())


def test_overlapping_runs_collect_less_and_restore_the_setting(default_threshold):
    env = load_environment("tictactoe")
    watcher = ThresholdWatcher()
    results = play(env, watcher, runs=3)
    assert watcher.seen == {ROLLOUT_GC_THRESHOLD}
    assert gc.get_threshold() == (700, 10, 10)
    assert len({repr([r.messages for r in rollouts]) for rollouts in results}) == 1


def test_a_disabled_threshold_stays_disabled(default_threshold):
    gc.set_threshold(0)
    watcher = ThresholdWatcher()
    play(load_environment("tictactoe"), watcher, runs=1)
    assert watcher.seen == {0}
    assert gc.get_threshold()[0] == 0


def test_a_steps_sequences_are_built_collecting_less_too(default_threshold, monkeypatch):
    from rlcore.train import grpo
    from rlcore.train.config import RLConfig, build_config

    env = load_environment("tictactoe")
    examples = [env.make_example(index, 0) for index in range(4)]
    rollouts = asyncio.run(
        run_rollouts(env, ConstantPolicy(), examples, sampling=SAMPLING, rollouts_per_example=2)
    )
    cfg = build_config(RLConfig, [("test", {"env": "tictactoe", "rollouts_per_example": 2})])
    seen = []

    def watched(*args, **kwargs):
        seen.append(gc.get_threshold()[0])
        return built(*args, **kwargs)

    built = grpo.training_sequences
    monkeypatch.setattr(grpo, "training_sequences", watched)
    grpo.step_sequences(env, rollouts, cfg, None, {})
    assert len(rollouts) == 8 and seen == [ROLLOUT_GC_THRESHOLD] * 8
    assert gc.get_threshold() == (700, 10, 10)


def test_the_frozen_heap_keeps_setup_objects_out_until_the_last_run_thaws():
    import weakref

    from rlcore.rollout import frozen_heap

    class Node:
        pass

    node = Node()
    node.self = node  # a cycle: only the collector frees it
    gone = weakref.ref(node)
    frozen_heap.freeze()
    frozen_heap.freeze()  # a second run in the same process
    try:
        assert gc.get_freeze_count() > 0
        del node
        gc.collect()
        assert gone() is not None  # frozen: no collection walks it
        frozen_heap.thaw()
        assert gc.get_freeze_count() > 0  # the other run still trains
    finally:
        frozen_heap.thaw()
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert gone() is None


def test_an_rl_runs_steps_run_with_its_setup_frozen(tiny_model, tmp_path, monkeypatch):
    from rl_fixtures import rl_config

    from rlcore.events import RecordingSink
    from rlcore.train import grpo

    seen = []
    built = grpo.step_sequences

    def watched(*args, **kwargs):
        seen.append(gc.get_freeze_count())
        return built(*args, **kwargs)

    monkeypatch.setattr(grpo, "step_sequences", watched)
    grpo.run_rl(rl_config(tiny_model, tmp_path, "run", max_steps=2), RecordingSink())
    assert len(seen) == 2 and min(seen) > 1000  # the model, the libraries' modules
    assert gc.get_freeze_count() == 0
