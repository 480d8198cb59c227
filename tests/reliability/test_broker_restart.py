"""Redis restarts under a real worker: the worker rides them out, queued jobs the broker
lost are sent again from the database, and a duplicate message never runs a job twice."""

import time

import pytest
import redis

from tests.lab_fixtures import wait_for_job
from tests.reliability.conftest import FAST_WATCHDOG_ENV, log_tail
from webapp.jobs import services
from webapp.jobs.models import Job, LogLine, Rollout
from workers.tasks import run_job

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.worker]

LONG_EVAL = {"num_examples": 400, "max_tokens": 24, "concurrency": 2, "device": "cpu"}
SHORT_EVAL = {"num_examples": 6, "max_tokens": 24, "concurrency": 2}


def wait_until(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"{what} within {timeout}s")


def test_a_worker_rides_out_a_redis_restart_with_a_job_running(
    alice, ttt_config, tiny, oracle, own_redis, workers
):
    # Two pool processes, as `make run` had: one runs the job (acknowledged late), the other
    # keeps the consumer inside a BRPOP, which is when Celery 5.7.0 crashed on reconnecting.
    worker = workers.start("restart", concurrency=2)
    job = services.job_create(
        owner=alice, kind="eval", env_config=ttt_config, model=tiny, options=LONG_EVAL
    )
    wait_until(lambda: Rollout.objects.filter(job=job).exists(), 180, "no rollout stored")

    own_redis.restart(down_seconds=3)

    # The worker reconnects and answers again; it did not stop.
    workers.wait_ready(worker)
    assert worker["process"].poll() is None
    # The running job went on through the outage and ends when asked to.
    services.job_cancel(job=Job.objects.get(pk=job.pk))
    job = wait_for_job(job, timeout=120)
    assert job.status == "cancelled", job.error
    # The worker still takes new jobs from the restarted Redis.
    after = services.job_create(
        owner=alice, kind="eval", env_config=ttt_config, model=oracle, options=SHORT_EVAL
    )
    after = wait_for_job(after, timeout=120)
    assert after.status == "succeeded", after.error
    assert worker["process"].poll() is None
    assert "Unrecoverable error" not in worker["log"].read_text(), log_tail(worker)


def test_queued_jobs_the_broker_lost_are_sent_again(alice, ttt_config, oracle, own_redis, workers):
    # No worker yet: the job waits in Redis, which restarts without persistence.
    job = services.job_create(
        owner=alice, kind="eval", env_config=ttt_config, model=oracle, options=SHORT_EVAL
    )
    assert Job.objects.get(pk=job.pk).status == "queued"
    own_redis.restart(down_seconds=0.5)
    time.sleep(1.5)  # older than QUEUED_RESEND_SECONDS
    workers.start("resend", env=FAST_WATCHDOG_ENV)
    job = wait_for_job(job, timeout=120)
    assert job.status == "succeeded", job.error
    assert LogLine.objects.filter(job=job, message__startswith="queued job sent again").exists()


def test_a_job_whose_message_is_still_queued_is_not_sent_twice(
    alice, ttt_config, oracle, own_redis, workers
):
    worker = workers.start("nodup", queues="inference", env=FAST_WATCHDOG_ENV)
    job = services.job_create(
        owner=alice, kind="eval", env_config=ttt_config, model=oracle, options=SHORT_EVAL
    )
    # The worker does not serve the cpu queue, so the message waits there while its watchdog
    # sweeps a few times (every second, for jobs older than a second).
    time.sleep(4)
    assert own_redis_queue_length(own_redis, "cpu") == 1
    assert not LogLine.objects.filter(job=job).exists()
    assert Job.objects.get(pk=job.pk).status == "queued"
    assert worker["process"].poll() is None


def own_redis_queue_length(server, queue: str) -> int:
    return redis.Redis.from_url(server.url).llen(queue)


def test_a_duplicate_message_runs_the_job_once(alice, ttt_config, tiny, own_redis, workers):
    """Both pool processes get the job's message; the second finds it running in the first
    and leaves it alone (before, a worker took its own duplicate for a dead process and
    failed the job while it ran)."""
    worker = workers.start("dup", concurrency=2)
    job = services.job_create(
        owner=alice, kind="eval", env_config=ttt_config, model=tiny,
        options={**LONG_EVAL, "num_examples": 8},
    )  # fmt: skip
    wait_until(lambda: Job.objects.get(pk=job.pk).status == "running", 120, "job not running")
    run_job.apply_async(args=[job.pk], queue=job.queue, task_id=job.celery_task_id)
    job = wait_for_job(job, timeout=480)
    assert job.status == "succeeded", job.error
    assert Rollout.objects.filter(job=job).count() == 8
    # The duplicate did arrive while the job ran, and was turned away.
    assert "not starting it twice" in worker["log"].read_text(), log_tail(worker)
