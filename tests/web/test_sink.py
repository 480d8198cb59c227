"""DatabaseSink in-process: called from inside rlcore's event loop, it writes rows in
batches, sends one message per step on the real Redis layer, records checkpoints as
models, and turns `cancel_requested` into should_stop()."""

import asyncio
import time

import pytest
from asgiref.sync import async_to_sync

from rlcore.types import Rollout as CoreRollout
from tests.lab_fixtures import GroupListener
from webapp.jobs.models import Job, LogLine, Metric, ModelEntry, Rollout
from workers.sink import DatabaseSink

pytestmark = pytest.mark.django_db(transaction=True)


def core_rollout(example_id: int, reward: float) -> CoreRollout:
    return CoreRollout(
        example_id=example_id, seed=1, group=0, prompt_len=1,
        messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "bad\x00byte"}],
        rewards={"outcome": reward}, reward=reward, outcome="win", completion_tokens=3,
        state={"invalid_moves": 2, "moves": []}, info={"random_move_prob": 0.25},
        facts={"invalid_moves": 2, "random_move_prob": 0.25, "note": "a\x00b"},
    )  # fmt: skip


def receive(listener: GroupListener, count: int) -> list[dict]:
    async def run():
        return [
            await asyncio.wait_for(listener.layer.receive(listener.channel), 10)
            for _ in range(count)
        ]

    return async_to_sync(run)()


def test_the_sink_writes_batches_and_sends_one_message_per_step(alice):
    job = Job.objects.create(owner=alice, kind="rl", status="running", config={})
    listener = GroupListener(job.pk)
    sink = DatabaseSink(job).start()

    async def training_loop():  # rlcore calls the sink from inside its event loop
        for step in (1, 2):
            sink.rollouts(step, [core_rollout(step, 0.5), core_rollout(step + 10, 1.0)])
            sink.metric(step, {"reward/mean": 0.75, "loss/policy": float("nan")})
            sink.progress(step, 2, "rl")
            sink.log(f"step {step} done")
        sink.checkpoint(2, "/runs/job-x/step_000002")

    asyncio.run(training_loop())
    sink.close()
    step_1, step_2 = receive(listener, 2)
    assert step_1["last_step"] == 1 and {m["step"] for m in step_1["metrics"]} == {1}
    assert step_2["since_step"] == 1 and step_2["last_step"] == 2
    assert len(step_1["rollouts"]) == 2 and step_1["rollouts"][0]["outcome"] == "win"
    assert step_2["checkpoints"][0]["path"] == "/runs/job-x/step_000002"
    job.refresh_from_db()
    assert (job.last_step, job.progress_done, job.progress_total) == (2, 2, 2)
    assert Metric.objects.filter(job=job, name="reward/mean").count() == 2
    assert not Metric.objects.filter(job=job, name="loss/policy").exists()  # NaN is logged instead
    assert (
        LogLine.objects.filter(
            job=job, level="warning", message__contains="loss/policy = nan"
        ).count()
        == 2
    )
    row = Rollout.objects.filter(job=job).first()
    assert row.facts == {"invalid_moves": 2, "random_move_prob": 0.25, "note": "a\ufffdb"}
    assert "\x00" not in row.messages[1]["content"]
    entry = ModelEntry.objects.get(checkpoint__job=job)
    assert (
        entry.kind == "checkpoint"
        and entry.owner == alice
        and entry.location.endswith("step_000002")
    )


def test_should_stop_follows_cancel_requested(alice):
    job = Job.objects.create(owner=alice, kind="eval", status="running", config={})
    sink = DatabaseSink(job, cancel_poll_seconds=0.1).start()
    assert not sink.should_stop()
    Job.objects.filter(pk=job.pk).update(cancel_requested=True)
    deadline = time.monotonic() + 5
    while not sink.should_stop() and time.monotonic() < deadline:
        time.sleep(0.05)
    sink.close()
    assert sink.should_stop()
