"""The job task: load a Job row, run its rlcore config, record how it ended.

`run_job(job_id)` claims a queued job (status running, worker hostname, start time), builds
the config class for its kind from the stored config, runs it with a DatabaseSink, and
marks it succeeded, cancelled (the sink saw `cancel_requested`) or failed (with the
exception's text; the traceback goes to the job's log).

A worker that dies does not lose its job silently. Tasks are acknowledged late and
rejected back to the queue when the worker process is lost, so the message comes round
again; run_job then finds the job still "running" and, unless another live worker still
has it, marks it failed with the reason and sends a `worker_lost` status message. On
startup a worker also fails the jobs its previous incarnation (same hostname) left
running, and the job page pings the worker of a job whose heartbeat went stale
(webapp.jobs.services.job_check_worker).
"""

from __future__ import annotations

import traceback

from celery import signals
from celery.utils.log import get_task_logger
from django.db import close_old_connections
from django.utils import timezone

from webapp.jobs.live import notify_job
from webapp.jobs.models import ApiKey, Checkpoint, Job, LogLine, ModelEntry, checkpoint_model_name
from workers.celery import app
from workers.sink import DatabaseSink, text_safe

logger = get_task_logger(__name__)

TERMINAL = Job.TERMINAL


def _status_message(job: Job, **extra) -> dict:
    return {
        "type": "job.status",
        "job": job.pk,
        "status": job.status,
        "error": job.error,
        "worker": job.worker,
        "cancel_requested": job.cancel_requested,
        "progress": job.progress_dict(),
        "last_step": job.last_step,
        **extra,
    }


def worker_has_task(hostname: str, task_id: str, timeout: float = 1.0) -> bool:
    """Whether worker `hostname` answers and is running task `task_id` right now."""
    if not hostname:
        return False
    replies = app.control.inspect(destination=[hostname], timeout=timeout).active() or {}
    return any(task.get("id") == task_id for task in replies.get(hostname, []))


def job_mark_worker_lost(*, job_id: int, reason: str) -> bool:
    """Fail a running job whose worker is gone; True if this call changed it."""
    changed = Job.objects.filter(pk=job_id, status=Job.Status.RUNNING).update(
        status=Job.Status.FAILED, error=f"worker lost: {reason}", finished=timezone.now()
    )
    if changed:
        job = Job.objects.get(pk=job_id)
        LogLine.objects.create(job=job, level="error", message=job.error)
        notify_job(job_id, _status_message(job, reason="worker_lost"))
    return bool(changed)


def _finish(job_id: int, status: str, **fields) -> Job:
    Job.objects.filter(pk=job_id).update(status=status, finished=timezone.now(), **fields)
    job = Job.objects.get(pk=job_id)
    notify_job(job_id, _status_message(job))
    return job


def _claim(job_id: int, hostname: str) -> Job | None:
    """The job, now running on `hostname`, or None when there is nothing to run."""
    job = Job.objects.filter(pk=job_id).first()
    if job is None:
        logger.warning("job %s does not exist (deleted before a worker took it)", job_id)
        return None
    if job.status in TERMINAL:
        return None  # cancelled while queued, or already handled after a redelivery
    if job.status == Job.Status.RUNNING:
        # The message came round again: the worker that had it died, unless it is another
        # worker that is still running it (a redelivery after the visibility timeout).
        if job.worker != hostname and worker_has_task(job.worker, job.celery_task_id):
            logger.warning(
                "job %s is still running on %s; not starting it twice", job_id, job.worker
            )
            return None
        job_mark_worker_lost(
            job_id=job_id,
            reason=f"the worker process running it on {job.worker or '?'} died "
            "(killed, out of memory, or the machine went away)",
        )
        return None
    now = timezone.now()
    claimed = Job.objects.filter(pk=job_id, status=Job.Status.QUEUED).update(
        status=Job.Status.RUNNING, worker=hostname, started=now, heartbeat=now
    )
    if not claimed:
        return None
    job = Job.objects.get(pk=job_id)
    notify_job(job_id, _status_message(job))
    return job


def execute(job: Job, sink: DatabaseSink) -> tuple[dict | None, dict]:
    """Run the job's config with rlcore; returns (summary, result)."""
    config = dict(job.config)
    # Whatever the stored config says, a key only goes where staff declared it may.
    ApiKey.check_use(base_url=config.get("base_url"), env_var=config.get("api_key_env"))
    if job.kind == Job.Kind.EVAL:
        from rlcore.evaluate import EvalConfig, format_summary, run_eval
        from rlcore.train.config import build_config

        outcome = run_eval(build_config(EvalConfig, [("job config", config)]), sink)
        report = format_summary(outcome.summary, outcome.baselines or None)
        return outcome.summary, {
            "out_dir": outcome.out_dir,
            "report": report,
            "baselines": outcome.baselines,
        }
    if job.kind == Job.Kind.SYNTH:
        from rlcore.train.config import SynthConfig, build_config
        from rlcore.train.synth import run_synth

        stats = run_synth(build_config(SynthConfig, [("job config", config)]), sink)
        return stats, stats
    if job.kind == Job.Kind.SFT:
        from rlcore.train.config import SFTConfig, build_config
        from rlcore.train.sft import run_sft

        path = run_sft(build_config(SFTConfig, [("job config", config)]), sink)
        return dict(sink.last_metrics), {"checkpoint": path}
    if job.kind == Job.Kind.RL:
        from rlcore.train.config import RLConfig, build_config
        from rlcore.train.grpo import run_rl

        path = run_rl(build_config(RLConfig, [("job config", config)]), sink)
        return dict(sink.last_metrics), {"checkpoint": path}
    raise ValueError(f"job {job.pk} has unknown kind {job.kind!r}; expected eval, synth, sft or rl")


def _record_final_checkpoint(job: Job, result: dict, last_step: int | None) -> None:
    """The directory a training run returns is a checkpoint even if it was not reported."""
    path = result.get("checkpoint")
    if not path or Checkpoint.objects.filter(job=job, path=path).exists():
        return
    checkpoint = Checkpoint.objects.create(
        job=job, step=last_step or 0, path=path, attempt=job.attempt
    )
    ModelEntry.objects.create(
        owner=job.owner,
        name=checkpoint_model_name(job.pk, job.attempt, path),
        kind=ModelEntry.Kind.CHECKPOINT,
        location=path,
        checkpoint=checkpoint,
    )


@app.task(bind=True, name="workers.tasks.run_job")
def run_job(self, job_id: int) -> str:
    """Run job `job_id` to the end; returns its final status."""
    close_old_connections()
    job = _claim(job_id, self.request.hostname or "")
    if job is None:
        return "skipped"
    sink = DatabaseSink(job).start()
    try:
        summary, result = execute(job, sink)
        sink.close()
    except Exception as exc:
        error = text_safe(f"{type(exc).__name__}: {exc}")
        if sink.error is None:
            try:
                sink.close()
            except Exception as close_exc:  # the original error is the one to report
                logger.warning("job %s: sink close failed: %s", job_id, close_exc)
        LogLine.objects.create(
            job_id=job_id, level="error", message=text_safe(traceback.format_exc())
        )
        _finish(job_id, Job.Status.FAILED, error=error)
        return Job.Status.FAILED
    job.refresh_from_db()
    _record_final_checkpoint(job, result, job.last_step)
    cancelled = sink.should_stop() or job.cancel_requested
    status = Job.Status.CANCELLED if cancelled else Job.Status.SUCCEEDED
    progress = {}
    if status == Job.Status.SUCCEEDED and job.progress_total:
        progress = {"progress_done": job.progress_total}
    _finish(job_id, status, summary=summary, result=result, **progress)
    return status


@signals.worker_ready.connect
def fail_jobs_left_running(sender=None, **kwargs) -> None:
    """A worker starting under a hostname that still has running jobs was restarted
    while running them: those jobs are lost."""
    hostname = getattr(sender, "hostname", "")
    if not hostname:
        return
    for job_id in Job.objects.filter(status=Job.Status.RUNNING, worker=hostname).values_list(
        "pk", flat=True
    ):
        job_mark_worker_lost(
            job_id=job_id, reason=f"worker {hostname} restarted while the job was running"
        )
