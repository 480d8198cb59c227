"""The job task: load a Job row, run its rlcore config, record how it ended.

`run_job(job_id)` claims a queued job (status running, worker hostname, start time), builds
the config class for its kind from the stored config, runs it with a DatabaseSink, and
marks it succeeded, cancelled (the sink saw `cancel_requested`) or failed (with the
exception's text; the traceback goes to the job's log).

A worker that dies does not lose its job silently; such a job ends "lost", with the
reason, a log line and a `worker_lost` status message to its page:
- a pool process that dies hands its message back (acknowledged late, rejected on worker
  loss); run_job then finds the job still running and, unless another live process still
  has it, marks it lost;
- a whole worker that dies (kill -9, out of memory, machine gone) stops the job's
  heartbeat; every worker's watchdog thread marks running jobs silent for
  WORKER_LOST_SECONDS lost (jobs_reap_lost), and a worker restarted under the same
  hostname marks the jobs its previous incarnation left running lost at once;
- the job page does the same check when it loads (webapp.jobs.services.job_check_worker),
  for a lab with no worker left at all.

The database, not the broker, says which jobs still need a worker: on startup and then
periodically a worker sends again the queued jobs whose message Redis no longer holds
(jobs_resend_queued), e.g. after Redis restarted without persistence. A duplicate message
is harmless: the claim moves a job from queued to running atomically, and a message for a
job that is already running elsewhere is skipped.
"""

from __future__ import annotations

import json
import os
import threading
import traceback
from datetime import timedelta

from celery import signals
from celery.utils.log import get_task_logger
from django.conf import settings
from django.db import close_old_connections, connection
from django.utils import timezone

from webapp.jobs.live import notify_job
from webapp.jobs.models import (
    ApiKey,
    Checkpoint,
    Job,
    LogLine,
    ModelEntry,
    WorkerNode,
    checkpoint_model_name,
)
from webapp.jobs.nodes import node_stop, nodes_mark_gone
from webapp.jobs.services import judge_key_check
from workers.celery import app
from workers.engines import job_engine, play_servers, served_config
from workers.nodes import NodeReporter, node_facts
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
        "engine_used": job.engine_used,
        "cancel_requested": job.cancel_requested,
        "progress": job.progress_dict(),
        "last_step": job.last_step,
        **extra,
    }


def task_holders(hostname: str, task_id: str, timeout: float = 1.0) -> list[int] | None:
    """The process ids of worker `hostname` running task `task_id` now; None if the
    worker does not answer within `timeout` seconds."""
    if not hostname:
        return None
    replies = app.control.inspect(destination=[hostname], timeout=timeout).active() or {}
    if hostname not in replies:
        return None
    return [task.get("worker_pid") for task in replies[hostname] if task.get("id") == task_id]


def heartbeat_is_fresh(job: Job) -> bool:
    seen = job.heartbeat or job.started
    return bool(seen) and (timezone.now() - seen).total_seconds() < settings.WORKER_LOST_SECONDS


def job_mark_worker_lost(*, job_id: int, reason: str, silent_since=None) -> bool:
    """Mark a running job whose worker is gone lost; True if this call changed it.
    With `silent_since`, only if its heartbeat is still older than that."""
    running = Job.objects.filter(pk=job_id, status=Job.Status.RUNNING)
    if silent_since is not None:
        running = running.filter(heartbeat__lt=silent_since)
    changed = running.update(
        status=Job.Status.LOST, error=f"worker lost: {reason}", finished=timezone.now()
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
        # The message came round again: the process that had it died, unless another
        # process still runs it (a message restored after a broker restart, a duplicate
        # re-sent by jobs_resend_queued). Our own request is the one with our pid.
        pids = task_holders(job.worker, job.celery_task_id)
        if pids is None:
            running_elsewhere = heartbeat_is_fresh(job)  # no answer: the reaper decides
        else:
            running_elsewhere = any(job.worker != hostname or pid != os.getpid() for pid in pids)
        if running_elsewhere:
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


def node_cannot_run(job: Job) -> str:
    """Why the node that claimed `job` cannot give it the GPUs it asked for ("" when it
    can, or when the node has no row to tell). Routing checked the nodes when the job was
    queued; a node that changed since (a card taken out) must not start it anyway."""
    if not job.gpus:
        return ""
    node = WorkerNode.objects.filter(name=job.worker).first()
    if node is None:
        return ""
    reason = node.cannot_serve(gpus=job.gpus, gpu_memory_gib=job.gpu_memory_gib)
    if reason is None:
        return ""
    return (
        f"node {job.worker} cannot run a job on {job.needs_text}: it {reason}; retry the job "
        "to route it to a node that can"
    )


def execute(job: Job, sink: DatabaseSink, engine: str = "local") -> tuple[dict | None, dict]:
    """Run the job's config with rlcore on inference `engine` (workers/engines.py);
    returns (summary, result)."""
    config = dict(job.config)
    # Whatever the stored config says, a key only goes where staff declared it may.
    ApiKey.check_use(base_url=config.get("base_url"), env_var=config.get("api_key_env"))
    if config.get("env"):
        # Nor a judge's key the env's parameters name (checked when saved, and again here).
        judge_key_check(env_name=config["env"], params=config.get("env_args") or {})
    if job.kind == Job.Kind.EVAL:
        from rlcore.evaluate import EvalConfig, format_summary, run_eval
        from rlcore.train.config import build_config

        with served_config(job, config, engine) as config:
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

        with served_config(job, config, engine) as config:
            stats = run_synth(build_config(SynthConfig, [("job config", config)]), sink)
        return stats, dict(stats)
    # A training job on n > 1 GPUs runs data-parallel over n processes (an RL config's
    # `processes`, where it asks for more), this one rank 0 (rlcore/train/distributed.py),
    # unless its RL run splits placement over two GPUs.
    if job.kind == Job.Kind.SFT:
        from rlcore.train.config import SFTConfig, build_config
        from rlcore.train.distributed import data_parallel_processes, run_sft_ranks

        sft_config = build_config(SFTConfig, [("job config", config)])
        processes = data_parallel_processes(job.gpus, sft_config)
        path = run_sft_ranks(sft_config, sink, processes=processes)
        return dict(sink.last_metrics), {"checkpoint": path}
    if job.kind == Job.Kind.RL:
        from rlcore.train.config import RLConfig, build_config
        from rlcore.train.distributed import data_parallel_processes, run_rl_ranks

        rl_config = build_config(RLConfig, [("job config", config)])
        processes = data_parallel_processes(job.gpus, rl_config)
        path = run_rl_ranks(rl_config, sink, processes=processes, engine=engine)
        return dict(sink.last_metrics), {"checkpoint": path}
    if job.kind == Job.Kind.AUDIT:
        from workers.checklist import run_audit_job

        return run_audit_job(job, sink)
    if job.kind == Job.Kind.DELTA:
        from workers.checklist import run_delta_job

        return run_delta_job(job, sink)
    raise ValueError(
        f"job {job.pk} has unknown kind {job.kind!r}; expected eval, synth, sft, rl, audit or delta"
    )


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
    if problem := node_cannot_run(job):
        LogLine.objects.create(job_id=job_id, level="error", message=problem)
        _finish(job_id, Job.Status.FAILED, error=problem)
        return Job.Status.FAILED
    sink = DatabaseSink(job, heartbeat_seconds=settings.JOB_HEARTBEAT_SECONDS).start()
    try:
        engine, why = job_engine(job, job.config)
        Job.objects.filter(pk=job_id).update(engine_used=engine)
        job.engine_used = engine
        if why:
            sink.log(f"engine: {engine}, not the {job.engine} asked for: {why}", "warning")
        summary, result = execute(job, sink, engine)
        result = {**result, "engine": engine}
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


def jobs_reap_lost() -> list[int]:
    """Mark lost the running jobs whose heartbeat is older than WORKER_LOST_SECONDS (the
    sink writes it at least every JOB_HEARTBEAT_SECONDS, also within a long step)."""
    cutoff = timezone.now() - timedelta(seconds=settings.WORKER_LOST_SECONDS)
    reaped = []
    for job_id, worker, heartbeat in Job.objects.filter(
        status=Job.Status.RUNNING, heartbeat__lt=cutoff
    ).values_list("pk", "worker", "heartbeat"):
        silent = (timezone.now() - heartbeat).total_seconds()
        reason = (
            f"worker {worker or '?'} sent no heartbeat for {silent:.0f} s (limit "
            f"{settings.WORKER_LOST_SECONDS:g} s): killed, out of memory, or the machine "
            "went away"
        )
        if job_mark_worker_lost(job_id=job_id, reason=reason, silent_since=cutoff):
            logger.warning("job %s lost: %s", job_id, reason)
            reaped.append(job_id)
    return reaped


def broker_task_ids(queues: set[str]) -> set[str]:
    """The ids of the tasks the broker holds for `queues`: waiting in a queue (at any
    priority) or delivered to a worker and not yet acknowledged."""
    ids = set()
    with app.connection_for_write() as broker:
        channel = broker.default_channel
        client = channel.client
        for queue in queues:
            for priority in channel.priority_steps:
                for raw in client.lrange(channel._q_for_pri(queue, priority), 0, -1):
                    ids.add(json.loads(raw)["headers"]["id"])
        for raw in client.hvals(channel.unacked_key):
            message = json.loads(raw)[0]
            ids.add(message["headers"]["id"])
    return ids


def jobs_resend_queued(*, hostname: str = "") -> list[int]:
    """Send again the queued jobs (older than QUEUED_RESEND_SECONDS, so a job whose message
    is being sent right now is left alone) whose message the broker does not hold."""
    cutoff = timezone.now() - timedelta(seconds=settings.QUEUED_RESEND_SECONDS)
    queued = list(
        Job.objects.filter(status=Job.Status.QUEUED, created__lt=cutoff).values_list(
            "pk", "queue", "celery_task_id"
        )
    )
    if not queued:
        return []
    in_broker = broker_task_ids({queue for _, queue, _ in queued})
    resent = []
    for job_id, queue, task_id in queued:
        if task_id in in_broker:
            continue
        run_job.apply_async(args=[job_id], queue=queue, task_id=task_id)
        message = (
            f"queued job sent again to queue {queue}{f' by {hostname}' if hostname else ''}: "
            "the broker no longer held its message (Redis restarted without persistence?)"
        )
        LogLine.objects.create(job_id=job_id, level="warning", message=message)
        logger.warning("job %s: %s", job_id, message)
        resent.append(job_id)
    return resent


def _watchdog(hostname: str, stop: threading.Event, reporter: NodeReporter) -> None:
    """Every WORKER_WATCHDOG_SECONDS: heartbeat this node, mark silent nodes gone, reap
    lost jobs, re-send queued ones. Runs in each worker's main process, beside the pool, so
    busy pool processes do not delay it; two workers doing it at once is harmless (every
    update is conditional)."""
    while not stop.wait(settings.WORKER_WATCHDOG_SECONDS):
        sweeps = (
            reporter.beat,
            nodes_mark_gone,
            jobs_reap_lost,
            lambda: jobs_resend_queued(hostname=hostname),
        )
        for sweep in sweeps:
            try:
                sweep()
            except Exception as exc:  # the database or the broker is away: try next time
                logger.warning("watchdog on %s: %s: %s", hostname, type(exc).__name__, exc)
        connection.close()


_watchdog_stop = threading.Event()
_watchdog_threads: list[threading.Thread] = []


def _consumer_facts(consumer) -> dict:
    """The node's facts (workers/nodes.py) with the queues and pool size of `consumer`."""
    queues = list(consumer.app.amqp.queues.consume_from or consumer.app.amqp.queues)
    concurrency = getattr(consumer.controller, "concurrency", 0) or 0
    return node_facts(queues=queues, concurrency=concurrency)


@signals.worker_ready.connect
def fail_jobs_left_running(sender=None, **kwargs) -> None:
    """A worker starting under a hostname that still has running jobs was restarted
    while running them: those jobs are lost. Then the node announces itself (host,
    queues, GPUs, versions), queued jobs the broker lost are sent again, and the watchdog
    starts."""
    hostname = getattr(sender, "hostname", "")
    if not hostname:
        return
    reporter = NodeReporter(hostname, _consumer_facts(sender))
    try:
        reporter.announce()
    except Exception as exc:  # the database is away: the watchdog's heartbeat announces it
        logger.warning("worker %s announce: %s: %s", hostname, type(exc).__name__, exc)
    try:
        for job_id in Job.objects.filter(status=Job.Status.RUNNING, worker=hostname).values_list(
            "pk", flat=True
        ):
            job_mark_worker_lost(
                job_id=job_id, reason=f"worker {hostname} restarted while the job was running"
            )
        jobs_resend_queued(hostname=hostname)
    except Exception as exc:  # the database or the broker is away: the watchdog tries again
        logger.warning("worker %s start: %s: %s", hostname, type(exc).__name__, exc)
    finally:
        # Pool processes forked later must not share this process's database socket.
        connection.close()
    _watchdog_threads.append(
        threading.Thread(
            target=_watchdog,
            args=(hostname, _watchdog_stop, reporter),
            name="rllab-watchdog",
            daemon=True,
        )
    )
    _watchdog_threads[-1].start()


@signals.worker_shutdown.connect
def stop_watchdog(sender=None, **kwargs) -> None:
    """The watchdog stops, Play's model servers stop, and the node says it stopped (not
    gone: it was not lost)."""
    _watchdog_stop.set()
    for thread in _watchdog_threads:
        thread.join(timeout=30)  # a heartbeat in flight must not mark the node live again
    play_servers.stop_all()
    hostname = getattr(sender, "hostname", "")
    if not hostname:
        return
    try:
        close_old_connections()
        node_stop(name=hostname)
    except Exception as exc:  # the database is away: the node is marked gone later instead
        logger.warning("worker %s stop: %s: %s", hostname, type(exc).__name__, exc)
    finally:
        connection.close()


@signals.worker_process_shutdown.connect
def stop_play_servers(**kwargs) -> None:
    """A pool process that served Play moves with vllm stops its servers as it exits."""
    play_servers.stop_all()
