"""A stop request is heard inside a training step, not only between steps: before every
model turn of the rollouts and between the micro-batches of the update. The step is then
dropped whole (no optimizer step from a partial batch), the state after the last complete
step is saved with the sampler and random states the dropped step began from, and a run
resumed from it plays that step exactly as an uninterrupted run does. No timings: each
test counts what ran (engine requests, forward passes) against a full step's count."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from rlcore.events import RecordingSink
from rlcore.policy import vllm_engine
from rlcore.policy.local import LocalEngine
from rlcore.train import grpo, sft
from rlcore.train.common import TRAINER_STATE
from rlcore.train.config import OptimizerConfig, RLConfig, SFTConfig, build_config
from rlcore.train.grpo import run_rl
from rlcore.train.sft import run_sft

TICTACTOE = {"max_turns": 2, "num_groups": 2}


def rl_config(model: str, output_dir, **changes) -> RLConfig:
    values = dict(
        model=model,
        env="tictactoe",
        env_args=dict(TICTACTOE),
        output_dir=str(output_dir),
        batch_size=8,
        rollouts_per_example=2,
        micro_batch_size=2,
        max_tokens=8,
        lr=1e-2,
        max_steps=3,
        device="cpu",
    )
    return build_config(RLConfig, [("test", {**values, **changes})])


class StopWhen(RecordingSink):
    """Says stop once `condition()` holds, and keeps saying it."""

    def __init__(self, condition) -> None:
        super().__init__()
        self.condition = condition

    def should_stop(self) -> bool:
        self.stop_requested = self.stop_requested or self.condition()
        return self.stop_requested


@pytest.fixture
def engines(monkeypatch) -> list[LocalEngine]:
    """Every LocalEngine run_rl makes, to count the requests it served."""
    made: list[LocalEngine] = []

    class Recorded(LocalEngine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(vllm_engine, "LocalEngine", Recorded)  # rollout_engine makes it
    return made


@pytest.fixture
def forward_passes(monkeypatch) -> list[int]:
    """How many training forward passes (micro-batches of the update) ran, by counting
    token_logprobs calls with gradients on (the no-grad scoring pass is not one)."""
    calls: list[int] = []
    original = grpo.token_logprobs

    def counted(*args, **kwargs):
        if torch.is_grad_enabled():
            calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(grpo, "token_logprobs", counted)
    return calls


def weights(path) -> dict[str, torch.Tensor]:
    return load_file(f"{path}/model.safetensors")


def test_a_stop_during_the_rollouts_ends_them_before_their_next_turn(
    tiny_model, tmp_path, engines, forward_passes
):
    # Asked once the engine has played every rollout's first turn (one batch of 8).
    sink = StopWhen(lambda: bool(engines) and engines[0].batches_run >= 1)
    path = run_rl(rl_config(tiny_model, tmp_path / "rl"), sink)

    # A full step plays 2 turns of each of the 8 games (16 requests) then trains; this one
    # stopped after the first turns and never reached the update.
    assert engines[0].requests_served == 8
    assert forward_passes == []
    assert sink.metrics == [] and sink.rollout_batches == []
    assert path.endswith("step_000000") and sink.checkpoints == [(0, path)]
    assert any("inside step 1 (rollouts: 0 of 8 finished)" in m for _, m in sink.logs)
    assert all(torch.equal(weights(path)[k], v) for k, v in weights(tiny_model).items())


def test_a_stop_during_a_generation_abandons_it_between_tokens(tiny_model, tmp_path, engines):
    # The engine asks from its worker thread before every token; say stop at its 4th ask,
    # 3 tokens into the first turn's replies (max_tokens 8).
    engine_asks: list[int] = []

    def fourth_engine_ask() -> bool:
        if threading.current_thread() is not threading.main_thread():
            engine_asks.append(1)
        return len(engine_asks) >= 4

    sink = StopWhen(fourth_engine_ask)
    path = run_rl(rl_config(tiny_model, tmp_path / "rl"), sink)
    assert len(engine_asks) == 4
    assert engines[0].batches_run == 0 and engines[0].requests_served == 0
    assert sink.metrics == [] and path.endswith("step_000000")
    assert any("inside step 1 (rollouts: 0 of 8 finished)" in m for _, m in sink.logs)


def test_a_stop_between_micro_batches_drops_the_step_without_an_optimizer_step(
    tiny_model, tmp_path, forward_passes
):
    sink = StopWhen(lambda: len(forward_passes) >= 1)
    path = run_rl(rl_config(tiny_model, tmp_path / "rl", beta=0.1), sink)

    # A KL term trains every sequence: 8 rollouts in micro-batches of 2 is at least 4
    # forward passes for a full step; one ran.
    assert forward_passes == [1]
    assert sink.metrics == [] and sink.progress_events == []
    assert path.endswith("step_000000") and sink.checkpoints == [(0, path)]
    state = torch.load(f"{path}/{TRAINER_STATE}", weights_only=True)
    assert state["step"] == 0 and state["optimizer"]["state"] == {}  # Adam never stepped
    assert state["sampler"]["next_index"] == 0  # the dropped step's examples come again
    assert all(torch.equal(weights(path)[k], v) for k, v in weights(tiny_model).items())
    assert any("inside step 1 (update 1: micro-batch 2 of" in m for _, m in sink.logs)
    assert not (tmp_path / "rl" / "final").exists()


def test_a_run_resumed_after_a_mid_step_stop_plays_the_dropped_step_as_if_never_stopped(
    tiny_model, tmp_path, forward_passes
):
    changes = dict(max_steps=2, save_every=1, beta=0.1)
    full = RecordingSink()
    run_rl(rl_config(tiny_model, tmp_path / "full", **changes), full)

    # Stop inside step 2's update: step 1's state is saved with step 2's starting point.
    passes_before: list[int] = []

    class StopInStepTwosUpdate(RecordingSink):
        def metric(self, step, values):
            super().metric(step, values)
            passes_before.append(len(forward_passes))

        def should_stop(self) -> bool:
            return bool(passes_before) and len(forward_passes) > passes_before[0]

    stopped = StopInStepTwosUpdate()
    path = run_rl(rl_config(tiny_model, tmp_path / "stopped", **changes), stopped)
    assert [step for step, _ in stopped.metrics] == [1] and path.endswith("step_000001")
    assert any("inside step 2 (update 1: micro-batch 2 of" in m for _, m in stopped.logs)

    resumed = RecordingSink()
    run_rl(rl_config(tiny_model, tmp_path / "resumed", resume_from=path, **changes), resumed)
    assert [step for step, _ in resumed.metrics] == [2]
    ((_, expected),) = full.metrics[1:]
    ((_, got),) = resumed.metrics
    for name in ("reward/mean", "loss/policy", "policy/entropy", "optim/grad_norm"):
        assert got[name] == pytest.approx(expected[name], abs=1e-6), name
    assert [r.messages for r in resumed.rollout_batches[0][1]] == [
        r.messages for r in full.rollout_batches[1][1]
    ]


def test_a_stop_after_the_steps_first_update_finishes_the_step_and_saves_it(
    tiny_model, tmp_path, monkeypatch
):
    """A stop heard once the step's first update is taken: its second update still runs,
    the completed step is logged and saved, and no later step begins."""
    optimizer_steps: list[int] = []
    original = grpo.clip_gradients

    def counted(*args, **kwargs):  # runs right before each optimizer step
        optimizer_steps.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(grpo, "clip_gradients", counted)
    sink = StopWhen(lambda: bool(optimizer_steps))
    cfg = rl_config(tiny_model, tmp_path / "rl", num_iterations=2, beta=0.1)
    path = run_rl(cfg, sink)
    assert optimizer_steps == [1, 1]
    assert [step for step, _ in sink.metrics] == [1]
    assert path.endswith("step_000001") and sink.checkpoints == [(1, path)]
    state = torch.load(f"{path}/{TRAINER_STATE}", weights_only=True)
    assert state["step"] == 1 and state["optimizer"]["state"]  # both updates stepped Adam
    assert state["scheduler"]["last_epoch"] == 2
    assert any("inside step 2 (before it began)" in m for _, m in sink.logs)


def test_sft_stops_between_micro_batches_without_stepping_on_a_partial_batch(
    tiny_model, tmp_path, monkeypatch
):
    conversations = tmp_path / "data.jsonl"
    line = (
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}'
    )
    conversations.write_text((line + "\n") * 8)
    chunks: list[int] = []
    original = sft.assistant_loss

    def counted(*args, **kwargs):
        chunks.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(sft, "assistant_loss", counted)
    sink = StopWhen(lambda: len(chunks) >= 1)
    cfg = SFTConfig(
        model=tiny_model,
        dataset=str(conversations),
        output_dir=str(tmp_path / "sft"),
        max_steps=3,
        batch_size=8,
        micro_batch_size=2,
        optimizer=OptimizerConfig(lr=1e-2),
        device="cpu",
    )
    path = run_sft(cfg, sink)
    assert chunks == [1]  # of the step's 4 micro-batches
    assert path.endswith("step_000000") and sink.checkpoints == [(0, path)] and not sink.metrics
    assert all(torch.equal(weights(path)[k], v) for k, v in weights(tiny_model).items())


@pytest.mark.django_db(transaction=True)
@pytest.mark.worker
def test_cancelling_an_rl_job_on_the_worker_stops_it_inside_its_first_step(
    alice, ttt_config, tiny, celery_worker
):
    """A default-size step (32 games of up to 6 turns, 128-token replies) on the real
    worker, cancelled once its rollouts are under way: the job ends cancelled with no
    step's metrics stored, and its log says the stop came inside step 1."""
    from tests.lab_fixtures import create_job_with_listener, wait_for_job
    from webapp.jobs import services
    from webapp.jobs.models import Job, LogLine, Metric

    job, listener = create_job_with_listener(
        owner=alice, kind="rl", env_config=ttt_config, model=tiny,
        options={"max_steps": 2, "device": "cpu"},
    )  # fmt: skip
    listener.collect(until_status=("running",))
    deadline = time.monotonic() + 120
    while (
        time.monotonic() < deadline
        and not LogLine.objects.filter(job=job, message__startswith="rl: grpo on").exists()
    ):
        time.sleep(0.2)
    time.sleep(2)  # into the rollouts
    services.job_cancel(job=Job.objects.get(pk=job.pk))
    job = wait_for_job(job)
    assert job.status == "cancelled", job.error
    assert not Metric.objects.filter(job=job).exists()
    assert LogLine.objects.filter(job=job, message__contains="inside step 1").exists()
