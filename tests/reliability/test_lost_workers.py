"""A whole worker killed with kill -9: the watchdog of another worker marks its job lost
within WORKER_LOST_SECONDS and tells the job's page; a worker restarted under the same
name marks its previous incarnation's jobs lost at once."""

import os
import signal
import time

import pytest

from tests.lab_fixtures import create_job_with_listener, wait_for_job
from tests.reliability.conftest import FAST_WATCHDOG_ENV
from webapp.jobs.models import Job, LogLine, Rollout

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.worker]

LONG_EVAL = {"num_examples": 400, "max_tokens": 24, "concurrency": 2, "device": "cpu"}
LOST = ("lost", "failed", "succeeded", "cancelled")


def start_long_job(alice, ttt_config, tiny):
    job, listener = create_job_with_listener(
        owner=alice, kind="eval", env_config=ttt_config, model=tiny, options=LONG_EVAL
    )
    listener.collect(until_status=("running",), timeout=120)
    deadline = time.monotonic() + 120
    while not Rollout.objects.filter(job=job).exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    return job, listener


def test_a_killed_worker_s_job_is_marked_lost_by_the_watchdog(
    alice, ttt_config, tiny, own_redis, workers
):
    victim = workers.start("victim", queues="cpu", concurrency=1, env=FAST_WATCHDOG_ENV)
    workers.start("witness", queues="inference", concurrency=1, env=FAST_WATCHDOG_ENV)
    job, listener = start_long_job(alice, ttt_config, tiny)
    assert Job.objects.get(pk=job.pk).worker == victim["node"]

    os.killpg(victim["process"].pid, signal.SIGKILL)
    killed = time.monotonic()
    messages = listener.collect(until_status=LOST, timeout=60)
    seconds = time.monotonic() - killed
    print(f"\nkilled worker's job marked lost after {seconds:.1f} s "
          f"(WORKER_LOST_SECONDS={FAST_WATCHDOG_ENV['WORKER_LOST_SECONDS']})")  # fmt: skip

    job = wait_for_job(job, statuses=("lost",), timeout=5)
    assert "no heartbeat" in job.error and victim["node"] in job.error
    assert job.finished is not None
    assert LogLine.objects.filter(job=job, level="error", message=job.error).exists()
    final = messages[-1]
    assert final["status"] == "lost" and final["reason"] == "worker_lost"


def test_a_live_job_is_not_reaped(alice, ttt_config, tiny, own_redis, workers):
    """The same tight limits leave a job alone while it heartbeats, even with a watchdog
    looking every second."""
    workers.start("alive", queues="cpu", concurrency=1, env=FAST_WATCHDOG_ENV)
    job, _ = start_long_job(alice, ttt_config, tiny)
    time.sleep(3 * float(FAST_WATCHDOG_ENV["WORKER_LOST_SECONDS"]) / 2)
    assert Job.objects.get(pk=job.pk).status == "running"


def test_a_worker_restarted_under_its_name_marks_its_jobs_lost(
    alice, ttt_config, tiny, own_redis, workers
):
    # The default limits: only the restart can mark the job lost within this test.
    first = workers.start("phoenix", queues="cpu", concurrency=1)
    job, listener = start_long_job(alice, ttt_config, tiny)
    os.killpg(first["process"].pid, signal.SIGKILL)
    workers.start("phoenix", queues="cpu", concurrency=1)
    messages = listener.collect(until_status=LOST, timeout=60)
    job = wait_for_job(job, statuses=("lost",), timeout=5)
    assert "restarted while the job was running" in job.error
    assert messages[-1]["reason"] == "worker_lost"
