"""A step's groups trained as they end (grpo.GroupPasses): the same update as the whole
batch's, alone and over data-parallel ranks, with the batch's mean per-move reward and the
loss's normalizer known only after the last group."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
import torch

from rlcore.envs.registry import load_environment
from rlcore.events import RecordingSink
from rlcore.policy.local import LocalEngine
from rlcore.rollout import run_rollouts
from rlcore.train import grpo
from rlcore.train.common import checkpoint_dir, model_path
from rlcore.train.config import RLConfig, build_config
from rlcore.train.distributed import follow_rl, launch
from rlcore.train.grpo import (
    GroupPasses,
    advantage_metrics,
    build_learner,
    learn,
    run_rl,
    step_sequences,
    update_policy,
)
from rlcore.types import SamplingParams

GROUP = 4


def never() -> bool:
    return False


def game_config(tmp_path, **changes) -> RLConfig:
    settings = dict(
        model=str(model_path("tiny-master")),
        env="tictactoe",
        env_args={"opening_moves": 2, "num_groups": 2, "self_play": 0.5},
        output_dir=str(tmp_path / "rl"),
        device="cpu",
        batch_size=24,
        rollouts_per_example=GROUP,
        micro_batch_size=5,
        max_tokens=24,
        lr=1e-3,
        max_steps=1,
        log_rollouts=0,
        advantage="tree",
        turn_reward_weight=1.0,
        sound_mass_weight=1.0,
        aggregation="turn",
    )
    return build_config(RLConfig, [("test", settings | changes)])


@pytest.fixture(scope="module")
def games():
    """24 tic-tac-toe games of `tiny-master`, six groups of four, half of them self-play."""
    env = load_environment("tictactoe", opening_moves=2, num_groups=2, self_play=0.5)
    engine = LocalEngine(str(model_path("tiny-master")), device="cpu")
    rollouts = asyncio.run(
        run_rollouts(
            env,
            engine,
            env.examples(6, seed=5),
            sampling=SamplingParams(max_tokens=24, temperature=1.0),
            rollouts_per_example=GROUP,
        )
    )
    assert len({r.reward for r in rollouts}) > 1
    return env, rollouts


def wait_for(condition, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "the passes' thread did not get there in time"
        time.sleep(0.01)


def gradients_stepped(learner) -> dict[str, torch.Tensor]:
    """Filled with the gradient each parameter has when the optimizer steps (after the
    ranks' sum and clipping): where two updates must agree. The weights after AdamW's first
    step would not show it, as it moves each weight by about lr whatever its gradient."""
    names = {id(p): n for n, p in learner.model.named_parameters()}
    seen: dict[str, torch.Tensor] = {}

    def record(optimizer, *_):
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    seen[names[id(param)]] = param.grad.clone()

    learner.optimizer.register_step_pre_hook(record)
    return seen


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"loss_type": "cispo", "aggregation": "token"},
        {"advantage": "group", "turn_reward_weight": 0.0, "sound_mass_weight": 0.0},
    ],
    ids=["tree-turn-rewards-sound-mass", "cispo-token", "group-no-turn-rewards"],
)
def test_groups_trained_as_they_end_take_the_whole_batchs_step(games, tmp_path, changes):
    env, rollouts = games
    cfg = game_config(tmp_path, **changes)

    whole, tokenizer, _ = build_learner(cfg, torch.device("cpu"), never)
    whole_grads = gradients_stepped(whole)
    sequences, normalizer, sums = step_sequences(env, rollouts, cfg, tokenizer, {})
    expected = learn(whole, sequences, normalizer, cfg)

    streamed, _, _ = build_learner(cfg, torch.device("cpu"), never)
    streamed_grads = gradients_stepped(streamed)
    passes = GroupPasses(streamed, env, cfg, tokenizer, {})
    groups = [rollouts[i : i + GROUP] for i in range(0, len(rollouts), GROUP)]
    for group in groups[:-1]:
        passes.add(group)
    # The first five groups trained while the sixth "plays".
    wait_for(passes.idle)
    early = passes.trained
    assert early > 0
    passes.add(groups[-1])
    got_sequences, got_normalizer, got_sums = passes.finish()
    got = update_policy(
        streamed, passes.untrained, got_normalizer, cfg, passes.batch_mean, passes.sums
    )

    assert passes.trained == early  # the last group is left to the update
    assert len(got_sequences) == len(sequences)
    assert got_normalizer == pytest.approx(normalizer)
    assert advantage_metrics(got_sums) == pytest.approx(advantage_metrics(sums))
    if cfg.turn_reward_weight > 0:
        assert passes.batch_mean > 0
        assert any(owed is not None for owed in passes.owed)
    names = ["loss/policy", "loss/total", "optim/grad_norm", "policy/entropy"]
    names += ["policy/clip_fraction"] + (["sound_mass/mean"] if cfg.sound_mass_weight else [])
    for name in names:
        assert got[name] == pytest.approx(expected[name], rel=1e-4, abs=1e-6), name
    for name, grad in streamed_grads.items():
        torch.testing.assert_close(grad, whole_grads[name], rtol=1e-4, atol=1e-7, msg=name)
    assert max(grad.abs().max().item() for grad in whole_grads.values()) > 1e-4


def streams_everywhere(cfg, learner, groups: int) -> bool:
    """`grpo.streams_update` as on a GPU, for a run on the CPU."""
    return cfg.num_iterations == 1 and learner.reference is None and groups > 1


def follow_streamed(payload: dict) -> None:
    """A follower rank that trains its groups as they end, as rank 0 does."""
    grpo.streams_update = streams_everywhere
    follow_rl(payload)


def test_a_run_that_trains_groups_as_they_end_logs_the_same_first_step(tmp_path, monkeypatch):
    def run(name: str, processes: int = 1, follower: str = ""):
        sink = RecordingSink()
        cfg = game_config(tmp_path, output_dir=str(tmp_path / name), batch_size=32, max_steps=2)
        launch(
            lambda: run_rl(cfg, sink),
            follower,
            {"settings": cfg.to_dict(), "engine": "local"},
            processes=processes,
            backend="gloo",
            log_dir=tmp_path / name / "ranks",
        )
        return sink

    plain = run("plain")
    plain_together = run("plain together", 2, "rlcore.train.distributed:follow_rl")
    monkeypatch.setattr(grpo, "streams_update", streams_everywhere)
    alone, together = run("alone"), run("together", 2, "tests.test_group_passes:follow_streamed")

    first = {name: sink.metrics[0][1] for name, sink in [("plain", plain), ("alone", alone)]}
    assert "perf/trained_while_playing" not in first["plain"]
    assert 0 <= first["alone"]["perf/trained_while_playing"] < 1  # the last group: after
    names = ["loss/policy", "loss/total", "optim/grad_norm", "policy/entropy"]
    names += ["sound_mass/mean", "advantage/abs_mean", "reward/turn_mean", "reward/mean"]
    for name in names:
        assert first["alone"][name] == pytest.approx(first["plain"][name], rel=1e-4), name
    # Two ranks training their groups as they end take the step two ranks take without:
    # the normalizer and the per-move rewards' mean are the whole batch's.
    for name in names:
        assert together.metrics[0][1][name] == pytest.approx(
            plain_together.metrics[0][1][name], rel=1e-4
        ), name
    assert [step for step, _ in together.metrics] == [1, 2]
    logs = [message for _, message in together.logs]
    assert "rl: at the end the 2 data-parallel ranks hold the same weights" in logs


class StopOnceStepTwoTrains(RecordingSink):
    """Asks the run to stop inside step 2's rollout, once its passes have trained a group."""

    def __init__(self, made: list[GroupPasses]) -> None:
        super().__init__()
        self.made = made

    def should_stop(self) -> bool:
        if len(self.made) == 2 and self.made[1].trained > 0:
            self.stop_requested = True
        return self.stop_requested


def test_a_stop_inside_a_streamed_step_drops_what_its_passes_trained(tmp_path, monkeypatch):
    made: list[GroupPasses] = []

    class Recorded(GroupPasses):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(grpo, "streams_update", streams_everywhere)
    monkeypatch.setattr(grpo, "GroupPasses", Recorded)
    sink = StopOnceStepTwoTrains(made)
    cfg = game_config(tmp_path, batch_size=32, max_steps=3)
    path = run_rl(cfg, sink)

    assert [step for step, _ in sink.metrics] == [1]
    assert path == str(checkpoint_dir(Path(cfg.output_dir), 1))
    assert any("stopped on request inside step 2 (rollouts:" in m for _, m in sink.logs)
    assert made[1].trained > 0 and not made[1].thread.is_alive()
    assert not [t for t in threading.enumerate() if t.name == "group-passes"]
    # The state saved is step 1's: a resumed run plays step 2 again.
    resumed = build_config(RLConfig, [("test", cfg.to_dict() | {"resume_from": path})])
    _, _, state = build_learner(resumed, torch.device("cpu"), never)
    assert state["step"] == 1
