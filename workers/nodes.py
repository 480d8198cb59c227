"""What a worker tells the lab about its machine: host, queues, GPUs, software.

`node_facts` gathers it when the worker is ready (workers/tasks.py announces it);
`NodeReporter` keeps the row fresh from the watchdog thread, measuring the GPUs' free
memory every NODE_GPU_REFRESH_SECONDS.

The GPUs are measured in a short-lived child process, never in the worker's main process:
a prefork worker forks its pool from the main process, and a process that touched CUDA
cannot hand a working CUDA to a forked child ("Cannot re-initialize CUDA in forked
subprocess"). The child prints one JSON line per GPU.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import platform
import socket
import subprocess
import sys
import time

from django.conf import settings

GIB = 2**30
GPU_PROBE = """
import json, torch
if torch.cuda.is_available():
    for index in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(index)
        print(json.dumps({"index": index, "name": torch.cuda.get_device_name(index),
                          "total_bytes": total, "free_bytes": free}))
"""


def gpu_inventory(timeout: float = 120.0) -> tuple[list[dict], str]:
    """This machine's GPUs as [{index, name, total_gib, free_gib}] and, when they could not
    be measured, why (else "")."""
    try:
        probe = subprocess.run(
            [sys.executable, "-c", GPU_PROBE],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return [], f"GPU probe failed: {type(exc).__name__}: {exc}"
    if probe.returncode != 0:
        return [], f"GPU probe exited with {probe.returncode}: {probe.stderr.strip()[-500:]}"
    gpus = []
    for line in probe.stdout.splitlines():
        row = json.loads(line)
        gpus.append(
            {
                "index": row["index"],
                "name": row["name"],
                "total_gib": round(row["total_bytes"] / GIB, 2),
                "free_gib": round(row["free_bytes"] / GIB, 2),
            }
        )
    return gpus, ""


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def git_commit() -> str:
    """The lab's commit: RLLAB_COMMIT when set (a deployment without .git), else git's."""
    if os.environ.get("RLLAB_COMMIT"):
        return os.environ["RLLAB_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"],
            cwd=settings.BASE_DIR,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 else "unknown"


def software_versions() -> dict:
    return {
        "python": platform.python_version(),
        "torch": _version("torch"),
        "transformers": _version("transformers"),
        "vllm": _version("vllm"),
        "celery": _version("celery"),
        "commit": git_commit(),
    }


def engines_available() -> list[str]:
    """The inference engines this node can run: local always, vllm where it is installed."""
    return ["local"] + (["vllm"] if importlib.util.find_spec("vllm") is not None else [])


def node_facts(*, queues: list[str], concurrency: int) -> dict:
    """What a worker announces about itself (WorkerNode's fields)."""
    gpus, _ = gpu_inventory()
    return {
        "host": socket.gethostname(),
        "queues": sorted(queues),
        "concurrency": concurrency,
        "gpus": gpus,
        "versions": software_versions(),
        "engines": engines_available(),
        "checkpoint_root": str(settings.CHECKPOINT_ROOT),
        "pid": os.getpid(),
    }


class NodeReporter:
    """The announcement and heartbeat of one node: `announce()` when the worker is ready,
    `beat()` from the watchdog (announcing again when the row is missing, e.g. the
    database was away at start), GPUs re-measured when due."""

    def __init__(self, name: str, facts: dict):
        self.name = name
        self.facts = facts
        self.measured = time.monotonic()

    def announce(self) -> None:
        from webapp.jobs.nodes import node_announce

        node_announce(name=self.name, **self.facts)

    def beat(self) -> None:
        from webapp.jobs.nodes import node_heartbeat

        gpus = None
        due = time.monotonic() - self.measured >= settings.NODE_GPU_REFRESH_SECONDS
        if self.facts["gpus"] and due:
            measured, error = gpu_inventory()
            if not error:
                gpus = self.facts["gpus"] = measured
            self.measured = time.monotonic()
        if not node_heartbeat(name=self.name, gpus=gpus):
            self.announce()
