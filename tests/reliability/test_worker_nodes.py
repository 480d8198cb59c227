"""Real Celery workers as nodes: each announces itself (host, queues, GPUs, versions) and
heartbeats, says when it stops, and is marked gone by the others when killed; two workers
with different queues on one machine each get the jobs meant for them; an eval asked to
run on vllm is served by a child server (here `python -m rlcore serve`, the stand-in
for `vllm serve`) that the job's worker starts and stops, and records the engine."""

import importlib.metadata
import os
import platform
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch
from django.core.exceptions import ValidationError
from django.db import transaction

from tests.lab_fixtures import REPO, wait_for_job
from tests.reliability.conftest import FAST_WATCHDOG_ENV
from webapp.jobs import services
from webapp.jobs.models import LogLine, Rollout, WorkerNode

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.worker]

NODE_ENV = FAST_WATCHDOG_ENV | {"NODE_LOST_SECONDS": "4"}
SHORT_EVAL = {"num_examples": 2, "max_tokens": 16, "concurrency": 2}
STAND_IN = (
    "{python} -m rlcore serve {model} --host {host} --port {port} --served-name {name} --device cpu"
)


def node_row(name: str, timeout: float = 60, **where) -> WorkerNode:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        node = WorkerNode.objects.filter(name=name, **where).first()
        if node is not None:
            return node
        time.sleep(0.2)
    raise AssertionError(
        f"no node {name} with {where} after {timeout}s: {list(WorkerNode.objects.values())}"
    )


def test_a_worker_announces_itself_heartbeats_and_says_it_stopped(workers, real_services):
    worker = workers.start("announcer", queues="cpu,inference", concurrency=1, env=NODE_ENV)
    node = node_row(worker["node"])
    commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO,
                            capture_output=True, text=True).stdout.strip()  # fmt: skip
    assert node.status == "live" and node.is_live and node.host == socket.gethostname()
    assert node.queues == ["cpu", "inference"] and node.concurrency == 1
    assert node.versions["python"] == platform.python_version()
    assert node.versions["torch"] == importlib.metadata.version("torch")
    assert node.versions["commit"] == commit and node.versions["transformers"]
    # This machine's GPUs as torch sees them (none here: the list is empty).
    assert len(node.gpus) == torch.cuda.device_count()
    assert node.engines[0] == "local" and node.checkpoint_root == str(real_services)
    first_seen = node.last_seen
    time.sleep(3)
    node.refresh_from_db()
    assert node.last_seen > first_seen  # the watchdog's heartbeat
    os.killpg(worker["process"].pid, signal.SIGTERM)
    worker["process"].wait(timeout=30)
    assert node_row(worker["node"], timeout=5, status="stopped").ended is not None


def test_a_killed_worker_is_marked_gone_by_the_other_nodes(workers):
    victim = workers.start("victim", queues="cpu", concurrency=1, env=NODE_ENV)
    workers.start("witness", queues="inference", concurrency=1, env=NODE_ENV)
    node_row(victim["node"])
    os.killpg(victim["process"].pid, signal.SIGKILL)
    killed = time.monotonic()
    gone = node_row(victim["node"], timeout=30, status="gone")
    print(f"\nkilled node marked gone after {time.monotonic() - killed:.1f} s "
          f"(NODE_LOST_SECONDS={NODE_ENV['NODE_LOST_SECONDS']})")  # fmt: skip
    assert gone.silent_seconds >= float(NODE_ENV["NODE_LOST_SECONDS"])
    assert not gone.is_live


def test_two_workers_with_different_queues_each_get_their_jobs(
    alice, ttt_config, tiny, workers, alice_client
):
    cpu = workers.start("cpuworker", queues="cpu", concurrency=1, env=NODE_ENV)
    gpu = workers.start("gpuworker", queues="gpu", concurrency=1, env=NODE_ENV)
    node_row(cpu["node"])
    node_row(gpu["node"])
    # This machine has no GPU: the gpu worker's row gets the card a GPU machine's worker
    # would announce (its heartbeat measures nothing to overwrite it). The job asks for a
    # GPU with device auto, so it routes as a GPU job and still runs on this CPU.
    WorkerNode.objects.filter(name=gpu["node"]).update(
        gpus=[{"index": 0, "name": "NVIDIA H100", "total_gib": 79.6, "free_gib": 79.0}]
    )
    on_cpu = services.job_create(
        owner=alice, kind="eval", env_config=ttt_config, model=tiny, options=SHORT_EVAL
    )
    on_gpu = services.job_create(
        owner=alice, kind="eval", env_config=ttt_config, model=tiny,
        options=SHORT_EVAL | {"gpus": 1, "gpu_memory_gib": 40},
    )  # fmt: skip
    assert (on_cpu.queue, on_gpu.queue) == ("cpu", "gpu")
    on_cpu, on_gpu = wait_for_job(on_cpu), wait_for_job(on_gpu)
    assert (on_cpu.status, on_gpu.status) == ("succeeded", "succeeded"), (
        on_cpu.error,
        on_gpu.error,
    )
    assert on_cpu.worker == cpu["node"] and on_gpu.worker == gpu["node"]
    assert on_gpu.engine_used == "local" and on_gpu.result["engine"] == "local"
    page = alice_client.get(f"/jobs/{on_gpu.pk}/").content.decode()
    assert "NVIDIA H100" in page and 'id="job-needs">1 GPU of at least 40 GiB<' in page
    # A node that lost its card after the job was routed to it does not start the job.
    with transaction.atomic():  # the job is sent when this commits, the card already gone
        stale = services.job_retry(job=on_gpu)
        WorkerNode.objects.filter(name=gpu["node"]).update(gpus=[])
    stale = wait_for_job(stale)
    assert stale.status == "failed" and stale.worker == gpu["node"]
    assert "cannot run a job on 1 GPU of at least 40 GiB: it has 0 such GPU(s)" in stale.error
    WorkerNode.objects.filter(name=gpu["node"]).update(
        gpus=[{"index": 0, "name": "NVIDIA H100", "total_gib": 79.6, "free_gib": 79.0}]
    )
    # A 100 GiB card is more than any live node has: refused, naming the field.
    with pytest.raises(
        ValidationError, match="no live worker node can run a job on 1 GPU"
    ) as caught:
        services.job_create(owner=alice, kind="eval", env_config=ttt_config, model=tiny,
                            options=SHORT_EVAL | {"gpus": 1, "gpu_memory_gib": 100})  # fmt: skip
    assert "gpus" in caught.value.message_dict


def test_an_eval_on_vllm_is_served_by_a_server_the_worker_starts_and_stops(
    alice, ttt_config, tiny, workers, alice_client
):
    workers.start("served", queues="cpu", concurrency=1,
                  env=NODE_ENV | {"VLLM_SERVE_COMMAND": STAND_IN})  # fmt: skip
    job = services.job_create(
        owner=alice, kind="eval", env_config=ttt_config, model=tiny,
        options=SHORT_EVAL | {"engine": "vllm"},
    )  # fmt: skip
    job = wait_for_job(job)
    assert job.status == "succeeded", job.error
    assert job.engine_used == "vllm" and job.result["engine"] == "vllm"
    assert not LogLine.objects.filter(job=job, message__startswith="engine:").exists()
    assert Rollout.objects.filter(job=job).count() == 2
    log = (Path(job.config["out_dir"]) / "vllm-serve.log").read_text()
    assert f"serving 'job-{job.pk}'" in log and "POST /v1/chat/completions" in log
    port = int(re.search(r"http://127\.0\.0\.1:(\d+)/v1", log).group(1))
    with socket.socket() as sock:  # the server is gone with the job
        assert sock.connect_ex(("127.0.0.1", port)) != 0
    page = alice_client.get(f"/jobs/{job.pk}/").content.decode()
    assert 'data-engine="vllm"' in page


def test_rl_on_vllm_where_vllm_cannot_run_falls_back_to_local_and_says_why(
    alice, ttt_config, tiny, workers, alice_client
):
    workers.start("trainer", queues="cpu", concurrency=1, env=NODE_ENV)
    job = services.job_create(
        owner=alice, kind="rl", env_config=ttt_config, model=tiny,
        options={"batch_size": 4, "rollouts_per_example": 2, "max_steps": 1,
                 "sampling.max_tokens": 8, "engine": "vllm"},
    )  # fmt: skip
    job = wait_for_job(job)
    assert job.status == "succeeded", job.error
    assert job.engine_used == "local" and job.result["engine"] == "local"
    warning = LogLine.objects.get(job=job, level="warning", message__startswith="engine:")
    assert "not the vllm asked for" in warning.message and "vllm" in warning.message
    page = alice_client.get(f"/jobs/{job.pk}/").content.decode()
    assert 'data-engine="local"' in page and "vllm asked; see the log" in page
