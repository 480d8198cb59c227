"""The job page's progress line: the rate and ETA show from the first finished rollout
(and again from the first of a new phase), and a batch of rollouts that lands at once moves
the ETA a little, never down and back up. The page hears progress as it does from a
worker, through the Redis channel layer and the job's websocket consumer; Playwright's
clock stands in for the minutes between updates."""

from __future__ import annotations

import asyncio
import re
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta

import pytest
from channels_redis.core import RedisChannelLayer
from playwright.sync_api import Page, expect

from tests.browser.conftest import REDIS_URL

pytestmark = pytest.mark.browser

TOTAL = 200
START = datetime(2026, 1, 5, 9, 0, tzinfo=UTC)
RUNNING_JOB = """
from django.contrib.auth.models import User
from django.utils import timezone
from webapp.jobs.models import Job
now = timezone.now()
job = Job.objects.create(owner=User.objects.get(username="alice"), kind="eval",
                         status="running", worker="progress-test", started=now, heartbeat=now,
                         progress_total=%d, progress_desc="eval", config={"env": "tictactoe"})
print("job", job.pk)
"""


class Worker:
    """Sends job updates to a job's channel group the way the worker's sink does."""

    def __init__(self, job_id: int):
        self.group = f"job-{job_id}"
        self.layer = RedisChannelLayer(hosts=[REDIS_URL])
        # Playwright's sync API runs an event loop in this thread: the layer gets its own.
        self.thread = ThreadPoolExecutor(1)
        self.loop = asyncio.new_event_loop()

    def progress(self, done: int, total: int = TOTAL, desc: str = "eval") -> None:
        message = {"type": "job.update", "since_step": None, "last_step": None,
                   "progress": {"done": done, "total": total, "desc": desc},
                   "metrics": [], "rollouts": [], "logs": [], "checkpoints": []}  # fmt: skip
        send = self.layer.group_send(self.group, message)
        self.thread.submit(self.loop.run_until_complete, send).result()

    def status(self, **payload) -> None:
        message = {"type": "job.status", "status": "running", "cancel_requested": False,
                   "last_step": None, **payload}  # fmt: skip
        send = self.layer.group_send(self.group, message)
        self.thread.submit(self.loop.run_until_complete, send).result()

    def close(self) -> None:
        self.thread.submit(self.loop.run_until_complete, self.layer.close_pools()).result()
        self.thread.submit(self.loop.close).result()
        self.thread.shutdown()


def eta_seconds(text: str) -> int:
    """The ETA of a rate line such as '1.00/s · ETA 3m 17s', in seconds."""
    match = re.search(r"ETA (?:(\d+)h )?(?:(\d+)m ?)?(?:(\d+)s)?$", text)
    assert match and any(match.groups()), f"no ETA in {text!r}"
    hours, minutes, seconds = (int(part or 0) for part in match.groups())
    return 3600 * hours + 60 * minutes + seconds


@pytest.fixture
def running_job(stack) -> int:
    out = stack.django(RUNNING_JOB % TOTAL)
    return int(re.search(r"job (\d+)", out).group(1))


def test_the_eta_shows_from_the_first_rollout_and_a_batch_landing_moves_it_a_little(
    page: Page, running_job
):
    page.clock.set_fixed_time(START)
    page.goto(f"/jobs/{running_job}/")
    expect(page.locator("#live-state")).to_have_text("live")
    # The socket's opening fetches the job's state (its progress at START): let it land
    # before the clock moves, or the page takes it as heard at the first update's time
    # and has no rate yet (seen once in a clean-clone run under load).
    page.wait_for_load_state("networkidle")
    expect(page.locator("#progress-text")).to_have_text(f"eval 0/{TOTAL}")
    worker = Worker(running_job)
    rate = page.locator("#progress-rate")

    def hear(seconds: float, done: int, total: int = TOTAL, desc: str = "eval") -> str:
        """The rate line once the page has heard `done` at `seconds` after the start."""
        page.clock.set_fixed_time(START + timedelta(seconds=seconds))
        worker.progress(done, total, desc)
        expect(page.locator("#progress-text")).to_have_text(f"{desc} {done}/{total}")
        return rate.inner_text()

    try:
        # One rollout a second, three at a time: the ETA is there from the first update.
        first = hear(3, 3)
        assert "/s · ETA" in first, first
        etas = [eta_seconds(first)] + [eta_seconds(hear(3 * k, 3 * k)) for k in range(2, 21)]
        assert abs(etas[-1] - (TOTAL - 60)) <= 5, etas  # steady work: the true time left
        # A batch of 34 lands at once, in three messages.
        for seconds, done in ((62.0, 72), (62.05, 84), (62.1, 94)):
            after_batch = eta_seconds(hear(seconds, done))
        # At one a second the rest takes 106 s; the batch may shorten that, not slash it.
        assert after_batch >= 0.7 * (TOTAL - 94), (etas, after_batch)
        later = [after_batch] + [eta_seconds(hear(62 + k, 94 + k)) for k in range(3, 61, 3)]
        rises = sum(max(0, b - a) for a, b in zip(later, later[1:], strict=False))
        assert rises <= 5, later  # no swing back up once the batch has aged
        # The eval's end clears the rate; its baseline then measures its own from its start.
        hear(200, TOTAL)
        expect(rate).to_have_text("")
        hear(201, 0, desc="baseline random")
        baseline = hear(204, 6, desc="baseline random")
        assert abs(eta_seconds(baseline) - (TOTAL - 6) / 2) <= 3, baseline
    finally:
        worker.close()


def test_the_engine_a_worker_picked_shows_live_with_the_one_asked(page: Page, running_job):
    page.goto(f"/jobs/{running_job}/")
    expect(page.locator("#live-state")).to_have_text("live")
    engine = page.locator("#job-engine")
    expect(engine).to_contain_text("local (asked)")  # no worker has said yet
    worker = Worker(running_job)
    try:
        worker.status(engine_used="builtin", worker="progress-test")
        expect(engine).to_have_text("builtin (local asked; see the log)")
        worker.status(engine_used="builtin", worker="progress-test")  # said again: once
        expect(engine).to_have_text("builtin (local asked; see the log)")
    finally:
        worker.close()
