"""The event sink: how rlcore reports what it does without knowing who listens.

Evaluation, data generation and training call `metric`, `rollouts`, `checkpoint`,
`progress` and `log` on the sink they were given, and poll `should_stop()` between steps
for cooperative cancellation. The CLI passes a `ConsoleSink` (progress bar with rate and
ETA); the Celery workers pass a sink that writes rows and notifies the job's channel group.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from rlcore.types import Rollout


class EventSink(Protocol):
    def metric(self, step: int, values: dict[str, float]) -> None: ...
    def rollouts(self, step: int, rollouts: list[Rollout]) -> None: ...
    def checkpoint(self, step: int, path: str) -> None: ...
    def progress(self, done: int, total: int, desc: str = "") -> None: ...
    def log(self, message: str, level: str = "info") -> None: ...
    def should_stop(self) -> bool: ...


class NullSink:
    """Listens to nothing; the default for library calls."""

    def metric(self, step: int, values: dict[str, float]) -> None:
        pass

    def rollouts(self, step: int, rollouts: list[Rollout]) -> None:
        pass

    def checkpoint(self, step: int, path: str) -> None:
        pass

    def progress(self, done: int, total: int, desc: str = "") -> None:
        pass

    def log(self, message: str, level: str = "info") -> None:
        pass

    def should_stop(self) -> bool:
        return False


class RecordingSink(NullSink):
    """Keeps every event in memory; used by tests and by callers that post-process."""

    def __init__(self) -> None:
        self.metrics: list[tuple[int, dict[str, float]]] = []
        self.rollout_batches: list[tuple[int, list[Rollout]]] = []
        self.checkpoints: list[tuple[int, str]] = []
        self.progress_events: list[tuple[int, int, str]] = []
        self.logs: list[tuple[str, str]] = []
        self.stop_requested = False

    def metric(self, step: int, values: dict[str, float]) -> None:
        self.metrics.append((step, dict(values)))

    def rollouts(self, step: int, rollouts: list[Rollout]) -> None:
        self.rollout_batches.append((step, list(rollouts)))

    def checkpoint(self, step: int, path: str) -> None:
        self.checkpoints.append((step, path))

    def progress(self, done: int, total: int, desc: str = "") -> None:
        self.progress_events.append((done, total, desc))

    def log(self, message: str, level: str = "info") -> None:
        self.logs.append((level, message))

    def should_stop(self) -> bool:
        return self.stop_requested


class ConsoleSink(NullSink):
    """Prints a progress bar with rate and ETA (tqdm), logs, and a compact metric line."""

    def __init__(self, *, stream=None, metric_keys: list[str] | None = None) -> None:
        self.stream = stream or sys.stderr
        self.metric_keys = metric_keys
        self._bar = None
        self._bar_desc = None
        self._started = time.monotonic()

    def _ensure_bar(self, total: int, desc: str):
        from tqdm import tqdm

        if self._bar is not None and self._bar_desc == desc and self._bar.total != total:
            self._bar.total = total  # the same work, re-estimated: keep the bar and its rate
            return self._bar
        if self._bar is None or self._bar_desc != desc:
            if self._bar is not None:
                self._bar.close()
            self._bar = tqdm(total=total, desc=desc or None, file=self.stream, dynamic_ncols=True)
            self._bar_desc = desc
        return self._bar

    def progress(self, done: int, total: int, desc: str = "") -> None:
        bar = self._ensure_bar(total, desc)
        bar.update(done - bar.n)  # update() honours tqdm's refresh interval; refresh() does not
        if done >= total:
            bar.close()
            self._bar = None

    def log(self, message: str, level: str = "info") -> None:
        text = message if level == "info" else f"[{level}] {message}"
        if self._bar is not None:
            self._bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream)

    def metric(self, step: int, values: dict[str, float]) -> None:
        keys = self.metric_keys or sorted(values)
        shown = " ".join(f"{k}={values[k]:.4g}" for k in keys if k in values)
        self.log(f"step {step}: {shown}")

    def checkpoint(self, step: int, path: str) -> None:
        self.log(f"checkpoint at step {step}: {path}")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
