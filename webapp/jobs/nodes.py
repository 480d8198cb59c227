"""Worker nodes and what a job needs of one: the services behind the Nodes page and the
routing of jobs to queues.

A worker writes its WorkerNode row when it is ready (`node_announce`), keeps it fresh from
its watchdog (`node_heartbeat`) and closes it when it stops (`node_stop`); a node silent
for NODE_LOST_SECONDS is gone (`nodes_mark_gone`, run by every watchdog and by the Nodes
page). A job states what it needs (`JobNeeds`: CPU, or n GPUs of at least M GiB, and an
inference engine); `queue_for_needs` picks a queue whose every live node can serve it and
refuses, naming the field, what no live node can.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError
from django.utils import timezone

from webapp.jobs.models import Job, WorkerNode

ENGINES = ("local", "vllm")


@dataclass
class JobNeeds:
    """What a job asks of the node that runs it (job settings beside rlcore's config)."""

    gpus: int = 0
    """GPUs the job runs on (0: a CPU job, on the cpu queue)"""
    gpu_memory_gib: float = 0.0
    """the memory each of those GPUs must have, in GiB (0: any card)"""
    engine: str = "local"
    """inference engine for rollouts: local (transformers) or vllm (GPU nodes with vLLM
    installed; elsewhere the job runs on local and its log says why)"""


# Bounds and choices of the needs, as rlcore's config.BOUNDS and CHOICES are for its settings.
NEEDS_BOUNDS: dict[str, tuple[float, float]] = {"gpus": (0, 64), "gpu_memory_gib": (0.0, 4096.0)}
NEEDS_CHOICES: dict[str, tuple[str, ...]] = {"engine": ENGINES}
NEEDS_KEYS = tuple(f.name for f in fields(JobNeeds))


def needs_schema() -> list[dict]:
    """The needs as config_schema rows (name, type, default, help, min, max, choices), so
    the job form builds their fields like every other setting's."""
    from rlcore.train.config import field_docs

    docs = field_docs(JobNeeds)
    rows = []
    for f in fields(JobNeeds):
        low, high = NEEDS_BOUNDS.get(f.name, (None, None))
        rows.append(
            {
                "name": f.name,
                "type": f.type if isinstance(f.type, str) else f.type.__name__,
                "default": f.default,
                "help": docs[f.name],
                "min": low,
                "max": high,
                "choices": list(NEEDS_CHOICES[f.name]) if f.name in NEEDS_CHOICES else None,
            }
        )
    return rows


def needs_resolve(values: dict[str, Any], *, kind: str) -> JobNeeds:
    """`values` (any of gpus, gpu_memory_gib, engine) checked against their bounds and
    choices; ValidationError naming each bad one."""
    errors: dict[str, str] = {}
    checked: dict[str, Any] = {}
    for key in NEEDS_KEYS:
        if values.get(key) is None or values.get(key) == "":
            continue
        value = values[key]
        if key in NEEDS_CHOICES:
            if value not in NEEDS_CHOICES[key]:
                errors[key] = f"must be one of {list(NEEDS_CHOICES[key])}, got {value!r}"
                continue
        else:
            low, high = NEEDS_BOUNDS[key]
            integer = key == "gpus"
            if isinstance(value, bool) or not isinstance(value, int | float):
                errors[key] = f"expected {'an integer' if integer else 'a number'}, got {value!r}"
                continue
            if integer and value != int(value):
                errors[key] = f"expected an integer, got {value!r}"
                continue
            if not low <= value <= high:
                errors[key] = f"must be between {low:g} and {high:g}, got {value!r}"
                continue
            value = int(value) if integer else float(value)
        checked[key] = value
    needs = JobNeeds(**checked)
    if not errors and needs.gpu_memory_gib and not needs.gpus:
        errors["gpu_memory_gib"] = "sizes the job's GPUs: set gpus to 1 or more, or leave it 0"
    if not errors and needs.engine == "vllm" and kind == "sft":
        errors["engine"] = "sft samples nothing; the engine applies to eval, synth and rl jobs"
    if errors:
        raise ValidationError(errors)
    return needs


def gpus_needed(needs: JobNeeds, device: str) -> tuple[int, str]:
    """The GPUs a job needs and the field that asked for them: `gpus`, or a config whose
    device is cuda (one GPU); a cpu device with GPUs is a contradiction."""
    device = str(device or "auto")
    if needs.gpus and device == "cpu":
        raise ValidationError(
            {"gpus": f"asks for {needs.gpus} GPU(s) but device is cpu; set device to auto or cuda"}
        )
    if needs.gpus:
        return needs.gpus, "gpus"
    if device.startswith("cuda"):
        return 1, "device"
    return 0, "gpus"


# ---------------------------------------------------------------------------------------
# Nodes


def nodes_mark_gone() -> list[str]:
    """Mark gone the live nodes silent for NODE_LOST_SECONDS; their names."""
    cutoff = timezone.now() - timedelta(seconds=settings.NODE_LOST_SECONDS)
    silent = list(
        WorkerNode.objects.filter(status=WorkerNode.Status.LIVE, last_seen__lt=cutoff).values_list(
            "name", flat=True
        )
    )
    if silent:
        WorkerNode.objects.filter(
            name__in=silent, status=WorkerNode.Status.LIVE, last_seen__lt=cutoff
        ).update(status=WorkerNode.Status.GONE, ended=timezone.now())
    return silent


def nodes_live() -> list[WorkerNode]:
    return [
        node for node in WorkerNode.objects.filter(status=WorkerNode.Status.LIVE) if node.is_live
    ]


def node_announce(*, name: str, **facts) -> WorkerNode:
    """Record worker `name` as live with `facts` (host, queues, concurrency, gpus,
    versions, engines, checkpoint_root, pid); a restarted worker takes its old row."""
    now = timezone.now()
    node, _ = WorkerNode.objects.update_or_create(
        name=name,
        defaults={
            **facts,
            "status": WorkerNode.Status.LIVE,
            "started": now,
            "last_seen": now,
            "ended": None,
        },
    )
    return node


def node_heartbeat(*, name: str, gpus: list[dict] | None = None) -> bool:
    """Worker `name` is alive (with its GPUs' latest free memory when measured); False
    when it has no row (announced to another database, or deleted in the admin)."""
    fields_ = {"last_seen": timezone.now(), "status": WorkerNode.Status.LIVE, "ended": None}
    if gpus is not None:
        fields_["gpus"] = gpus
    return bool(WorkerNode.objects.filter(name=name).update(**fields_))


def node_stop(*, name: str) -> None:
    WorkerNode.objects.filter(name=name).update(
        status=WorkerNode.Status.STOPPED, ended=timezone.now()
    )


def nodes_overview() -> list[dict]:
    """Every node (live first) with the jobs it runs now, for the Nodes page."""
    nodes_mark_gone()
    nodes = list(WorkerNode.objects.all())
    running: dict[str, list[Job]] = {}
    for job in Job.objects.filter(status=Job.Status.RUNNING, worker__in=[n.name for n in nodes]):
        running.setdefault(job.worker, []).append(job)
    order = {WorkerNode.Status.LIVE: 0, WorkerNode.Status.STOPPED: 1, WorkerNode.Status.GONE: 2}
    nodes.sort(key=lambda node: (order.get(node.status, 3), node.name))
    return [{"node": node, "jobs": running.get(node.name, [])} for node in nodes]


# ---------------------------------------------------------------------------------------
# Routing


def queue_for_needs(needs: JobNeeds, *, device: str = "auto") -> str:
    """The queue a job with `needs` goes to: `cpu` for a CPU job (queued even while no
    worker is up: it waits for one), else a gpu queue (`gpu`, or another whose name begins
    with gpu) every live node of which can serve it. ValidationError naming the field when
    no live node can, or when the ones that can share every queue with ones that cannot."""
    count, field = gpus_needed(needs, device)
    if count == 0:
        return "cpu"
    memory = needs.gpu_memory_gib
    asked = f"{count} GPU(s)" + (f" of at least {memory:g} GiB" if memory else "")
    live = nodes_live()
    refusals = {node.name: node.cannot_serve(gpus=count, gpu_memory_gib=memory) for node in live}
    able = [node for node in live if refusals[node.name] is None]
    if not able:
        why = "; ".join(f"{name} {reason}" for name, reason in refusals.items())
        raise ValidationError(
            {
                field: f"no live worker node can run a job on {asked}: "
                + (why or "no worker node is live")
                + " (the Nodes page lists them; a GPU node starts with -Q gpu)"
            }
        )
    candidates = sorted(
        {q for node in able for q in node.gpu_queues()}, key=lambda q: (q != "gpu", q)
    )
    for queue in candidates:
        if all(refusals[node.name] is None for node in live if queue in node.queues):
            return queue
    unable = sorted(
        node.name for node in live if refusals[node.name] and set(node.queues) & set(candidates)
    )
    raise ValidationError(
        {
            field: f"the nodes that can run a job on {asked} ({', '.join(n.name for n in able)}) "
            f"share every gpu queue with nodes that cannot ({', '.join(unable)}); start the "
            "larger ones with a queue of their own as well, e.g. -Q gpu,gpu-large"
        }
    )
