"""A bulkhead for the web server: bulk reads can't starve what a person waits on.

Django serves each request's synchronous view on a thread of its own, and all of a
process's threads share one interpreter lock. A burst of 200 metric GETs is 200 threads
taking turns with a Play move's POST, which then waits for its turn behind every one of
them (bench/load.py: the tail of move latency under GET bursts). `ConcurrencyLimit` lets
at most `limit` requests of the bulk paths into Django at once per process; the rest wait
on the event loop, holding no thread and no lock, and go in as earlier ones finish, in
arrival order. Everything else (Play, job pages, websockets) never waits on it.
"""

from __future__ import annotations

import asyncio
import re


class ConcurrencyLimit:
    """ASGI middleware: at most `limit` HTTP requests whose path matches `pattern` are
    inside `app` at once (in this process)."""

    def __init__(self, app, *, pattern: str, limit: int):
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        self.app = app
        self.pattern = re.compile(pattern)
        self.limit = limit
        self._semaphore: asyncio.Semaphore | None = None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.pattern.match(scope.get("path", "")):
            return await self.app(scope, receive, send)
        if self._semaphore is None:  # made on the server's own event loop
            self._semaphore = asyncio.Semaphore(self.limit)
        async with self._semaphore:
            return await self.app(scope, receive, send)
