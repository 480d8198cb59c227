"""The web server's bulkhead (webapp/limits.py): bulk reads enter Django a few at a time,
everything else goes straight in."""

from __future__ import annotations

import asyncio

import pytest

from webapp.asgi import application
from webapp.limits import ConcurrencyLimit


class Recording:
    """An ASGI app that holds each request for a moment and records how many were inside
    at once."""

    def __init__(self):
        self.inside = 0
        self.most = 0
        self.order: list[str] = []

    async def __call__(self, scope, receive, send):
        self.inside += 1
        self.most = max(self.most, self.inside)
        self.order.append(scope["path"])
        await asyncio.sleep(0.05)
        self.inside -= 1
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


async def request(app, path: str) -> int:
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    await app({"type": "http", "path": path, "method": "GET", "headers": []}, receive, send)
    return sent[0]["status"]


async def test_at_most_the_limit_of_bulk_reads_are_inside_at_once_and_others_pass():
    inner = Recording()
    app = ConcurrencyLimit(inner, pattern=r"^/api/jobs/\d+/metrics/", limit=3)
    bulk = [request(app, "/api/jobs/7/metrics/") for _ in range(20)]
    statuses = await asyncio.gather(*bulk)
    assert statuses == [200] * 20 and inner.most == 3

    # A move posted behind a burst of 20 goes in at once: the burst waits, not the move.
    inner = Recording()
    app = ConcurrencyLimit(inner, pattern=r"^/api/jobs/\d+/metrics/", limit=2)
    burst = [asyncio.ensure_future(request(app, "/api/jobs/7/metrics/")) for _ in range(20)]
    await asyncio.sleep(0.01)
    await request(app, "/play/api/games/1/move/")
    assert inner.order.index("/play/api/games/1/move/") == 2  # after the 2 let in, not 20
    await asyncio.gather(*burst)


def test_the_lab_serves_http_through_the_limit_on_the_bulk_paths():
    from django.conf import settings

    assert isinstance(application.application_mapping["http"], ConcurrencyLimit)
    limit = application.application_mapping["http"]
    assert limit.limit == settings.BULK_READ_CONCURRENCY
    for path in (
        "/api/jobs/3/metrics/",
        "/api/jobs/3/metrics.csv",
        "/api/jobs/3/rollouts/",
        "/api/jobs/3/updates/",
    ):
        assert limit.pattern.match(path), path
    for path in (
        "/play/api/games/3/move/",
        "/api/jobs/",
        "/api/jobs/3/rollouts/5/",
        "/jobs/3/",
        "/api/jobs/3/cancel/",
    ):
        assert not limit.pattern.match(path), path


def test_a_limit_under_one_is_refused():
    with pytest.raises(ValueError, match="at least 1"):
        ConcurrencyLimit(Recording(), pattern="x", limit=0)
