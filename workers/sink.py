"""DatabaseSink: rlcore's event sink for jobs run by a worker.

rlcore calls the sink from inside its own event loop (evaluation runs rollouts under
asyncio), where Django refuses database queries and `async_to_sync` refuses to run. So the
sink only buffers in the caller's thread, and one writer thread per job does all the I/O:
it bulk-inserts Metric, Rollout and LogLine rows, records checkpoints (each becomes a
Checkpoint plus a ModelEntry of kind checkpoint), updates the job's progress, step cursor
and heartbeat, and sends one message per batch to the job's channel group.

Batches follow steps: an event for a new step closes the batch of the previous one, and a
batch is also written once events stop arriving for a moment (or at the latest after a
couple of seconds), so a long step still shows up promptly. Cancellation is cooperative:
the writer reads `Job.cancel_requested` about once a second and `should_stop()` returns
the last value read, which costs rlcore nothing to poll.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from django.db import connection, transaction
from django.utils import timezone

from webapp.jobs.live import notify_job
from webapp.jobs.models import (
    Checkpoint,
    Job,
    LogLine,
    Metric,
    ModelEntry,
    Rollout,
    checkpoint_model_name,
)

if TYPE_CHECKING:
    from rlcore.types import Rollout as CoreRollout

log = logging.getLogger(__name__)

LOG_LEVELS = ("debug", "info", "warning", "error")


def json_safe(value: Any) -> Any:
    """`value` as plain JSON that PostgreSQL accepts: unknown types as text, and no NUL
    characters (jsonb rejects \\u0000, which a sampled reply may well contain)."""
    text = json.dumps(value, default=str, ensure_ascii=False).replace("\\u0000", "\\ufffd")
    return json.loads(text)


def text_safe(value: Any) -> str:
    return str(value).replace("\x00", "\ufffd")


def rollout_row(job_id: int, step: int, rollout: CoreRollout) -> Rollout:
    """A Rollout row from rlcore's Rollout; the env's facts about it (which rlcore computed
    when the rollout ended) are what the inspector filters on."""
    return Rollout(
        job_id=job_id,
        step=step,
        example_id=rollout.example_id,
        group=rollout.group,
        seed=rollout.seed,
        messages=json_safe(rollout.messages),
        prompt_len=rollout.prompt_len,
        rewards=json_safe(rollout.rewards),
        reward=float(rollout.reward),
        state=json_safe(rollout.state or {}),
        info=json_safe(rollout.info or {}),
        outcome=text_safe(rollout.outcome or ""),
        prompt_tokens=rollout.prompt_tokens,
        completion_tokens=rollout.completion_tokens,
        truncated=rollout.truncated,
        num_turns=rollout.num_turns,
        facts=json_safe(rollout.facts or {}),
        error=text_safe(rollout.error or ""),
        seconds=rollout.seconds,
    )


@dataclass
class _Batch:
    metrics: list[Metric] = field(default_factory=list)
    rollouts: list[Rollout] = field(default_factory=list)
    logs: list[LogLine] = field(default_factory=list)
    checkpoints: list[tuple[int, str]] = field(default_factory=list)
    progress: tuple[int, int, str] | None = None
    step: int | None = None
    first_event: float = 0.0
    last_event: float = 0.0

    def empty(self) -> bool:
        return not (self.metrics or self.rollouts or self.logs or self.checkpoints or self.progress)


class DatabaseSink:
    """Persists and broadcasts one job's events; use `start()` before and `close()` after."""

    def __init__(
        self,
        job: Job,
        *,
        quiet_seconds: float = 0.25,
        max_delay_seconds: float = 2.0,
        cancel_poll_seconds: float = 1.0,
        heartbeat_seconds: float = 15.0,
    ):
        self.job_id = job.pk
        self.owner_id = job.owner_id
        self.attempt = job.attempt
        self.quiet_seconds = quiet_seconds
        self.max_delay_seconds = max_delay_seconds
        self.cancel_poll_seconds = cancel_poll_seconds
        self.heartbeat_seconds = heartbeat_seconds
        self.last_step: int | None = job.last_step
        self.last_metrics: dict[str, float] = {}
        self.checkpoints: list[tuple[int, str]] = []
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._closing = False
        self._pending = _Batch()
        self._ready: list[_Batch] = []
        self._thread = threading.Thread(target=self._run, name=f"job-{job.pk}-sink", daemon=True)

    # -- the EventSink protocol (called by rlcore, possibly inside its event loop) --------
    def metric(self, step: int, values: dict[str, float]) -> None:
        now = timezone.now()
        with self._lock:
            batch = self._batch_for(step)
            for name, value in values.items():
                value = float(value)
                if value != value or value in (float("inf"), float("-inf")):
                    # JSON has no NaN/inf; keep the event visible in the log instead.
                    batch.logs.append(
                        LogLine(
                            job_id=self.job_id,
                            level="warning",
                            message=f"step {step}: {name} = {value}",
                        )
                    )
                    continue
                self.last_metrics[name] = value
                batch.metrics.append(
                    Metric(job_id=self.job_id, step=step, name=name, value=value, created=now)
                )

    def rollouts(self, step: int, rollouts: list[CoreRollout]) -> None:
        rows = [rollout_row(self.job_id, step, r) for r in rollouts]
        with self._lock:
            self._batch_for(step).rollouts.extend(rows)

    def checkpoint(self, step: int, path: str) -> None:
        with self._lock:
            self.checkpoints.append((step, str(path)))
            self._batch_for(step).checkpoints.append((step, str(path)))
        self._wake.set()

    def progress(self, done: int, total: int, desc: str = "") -> None:
        with self._lock:
            self._touch(self._pending).progress = (int(done), int(total), text_safe(desc)[:200])

    def log(self, message: str, level: str = "info") -> None:
        level = level if level in LOG_LEVELS else "info"
        with self._lock:
            self._touch(self._pending).logs.append(
                LogLine(job_id=self.job_id, level=level, message=text_safe(message))
            )

    def should_stop(self) -> bool:
        return self._stop.is_set()

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> DatabaseSink:
        self._thread.start()
        return self

    def close(self) -> None:
        """Write everything still buffered; re-raise a write error so the job fails with it."""
        with self._lock:
            self._closing = True
        self._wake.set()
        self._thread.join()
        if self.error is not None:
            raise RuntimeError(f"could not store the job's results: {self.error}") from self.error

    # -- buffering ------------------------------------------------------------------------
    def _touch(self, batch: _Batch) -> _Batch:
        now = time.monotonic()
        if batch.empty():
            batch.first_event = now
        batch.last_event = now
        return batch

    def _batch_for(self, step: int) -> _Batch:
        """The open batch, after closing it if it holds another step (one batch per step)."""
        if self._pending.step is not None and self._pending.step != step:
            self._ready.append(self._pending)
            self._pending = _Batch()
            self._wake.set()
        self._pending.step = step
        return self._touch(self._pending)

    def _take_batches(self) -> tuple[list[_Batch], bool]:
        with self._lock:
            batches, self._ready = self._ready, []
            pending, now = self._pending, time.monotonic()
            if not pending.empty() and (
                self._closing
                or now - pending.last_event >= self.quiet_seconds
                or now - pending.first_event >= self.max_delay_seconds
            ):
                batches.append(pending)
                self._pending = _Batch()
            return batches, self._closing

    # -- the writer thread ----------------------------------------------------------------
    def _run(self) -> None:
        last_poll = last_beat = 0.0
        try:
            while True:
                self._wake.wait(timeout=0.1)
                self._wake.clear()
                batches, closing = self._take_batches()
                for batch in batches:
                    self._write(batch)
                    last_beat = time.monotonic()
                now = time.monotonic()
                if now - last_poll >= self.cancel_poll_seconds:
                    last_poll = now
                    self._poll_cancel()
                if now - last_beat >= self.heartbeat_seconds:
                    last_beat = now
                    Job.objects.filter(pk=self.job_id).update(heartbeat=timezone.now())
                if closing and not batches:
                    break
        except Exception as exc:  # surfaced by close(); the job is then marked failed
            log.exception("job %s: sink writer failed", self.job_id)
            self.error = exc
        finally:
            connection.close()

    def _poll_cancel(self) -> None:
        requested = (
            Job.objects.filter(pk=self.job_id).values_list("cancel_requested", flat=True).first()
        )
        if requested:
            self._stop.set()

    def _write(self, batch: _Batch) -> None:
        since_step = self.last_step
        now = timezone.now()
        checkpoints = []
        with transaction.atomic():
            Metric.objects.bulk_create(batch.metrics)
            rollouts = Rollout.objects.bulk_create(batch.rollouts)
            logs = LogLine.objects.bulk_create(batch.logs)
            for step, path in batch.checkpoints:
                checkpoints.append(self._record_checkpoint(step, path))
            updates: dict[str, Any] = {"heartbeat": now}
            if batch.step is not None:
                self.last_step = max(
                    batch.step, self.last_step if self.last_step is not None else batch.step
                )
                updates["last_step"] = self.last_step
            if batch.progress is not None:
                done, total, desc = batch.progress
                updates |= {"progress_done": done, "progress_total": total, "progress_desc": desc}
            Job.objects.filter(pk=self.job_id).update(**updates)
        notify_job(
            self.job_id,
            {
                "type": "job.update",
                "job": self.job_id,
                "since_step": since_step,
                "last_step": self.last_step,
                "progress": (
                    dict(zip(("done", "total", "desc"), batch.progress, strict=True))
                    if batch.progress
                    else None
                ),
                "metrics": [
                    {"step": m.step, "name": m.name, "value": m.value, "t": m.created.timestamp()}
                    for m in batch.metrics
                ],
                "rollouts": [
                    {
                        "id": r.pk,
                        "step": r.step,
                        "example_id": r.example_id,
                        "outcome": r.outcome,
                        "reward": r.reward,
                    }
                    for r in rollouts
                ],
                "logs": [line.to_dict() for line in logs],
                "checkpoints": checkpoints,
            },
        )

    def _record_checkpoint(self, step: int, path: str) -> dict:
        checkpoint, created = Checkpoint.objects.get_or_create(
            job_id=self.job_id, path=path, defaults={"step": step, "attempt": self.attempt}
        )
        if created:
            ModelEntry.objects.create(
                owner_id=self.owner_id,
                name=checkpoint_model_name(self.job_id, self.attempt, path),
                kind=ModelEntry.Kind.CHECKPOINT,
                location=path,
                checkpoint=checkpoint,
            )
        return {"id": checkpoint.pk, "step": checkpoint.step, "path": checkpoint.path}
