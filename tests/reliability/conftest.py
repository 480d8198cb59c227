"""Reliability tests use the web fixtures (PostgreSQL, the test Redis, a real worker), and
for the fault tests: a Redis of their own (its own port and directory, restartable without
touching the shared one) and real Celery workers that the tests start, kill and restart,
with the watchdog's intervals shortened through the environment."""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
from django.conf import settings
from django.test import override_settings

from tests.lab_fixtures import REPO, _database_url
from workers.celery import app as celery_app

# Short enough for a test, long enough that a busy 2-core machine still heartbeats in time.
FAST_WATCHDOG_ENV = {
    "WORKER_LOST_SECONDS": "8",
    "JOB_HEARTBEAT_SECONDS": "1",
    "WORKER_WATCHDOG_SECONDS": "1",
    "QUEUED_RESEND_SECONDS": "1",
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class OwnRedis:
    """redis-server on a free port with its own directory; `restart()` is the fault."""

    def __init__(self, directory: Path, *, appendonly: bool = False):
        self.port = free_port()
        self.dir = directory
        self.appendonly = appendonly
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "yes" if self.appendonly else "no", "--dir", str(self.dir),
             "--logfile", str(self.dir / "redis.log")],
        )  # fmt: skip
        deadline = time.monotonic() + 20
        while True:
            try:
                redis.Redis.from_url(self.url, socket_connect_timeout=1).ping()
                return
            except redis.exceptions.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def stop(self) -> None:
        """`redis-cli shutdown nosave`: whatever is not in the append-only file is gone."""
        if self.process and self.process.poll() is None:
            # Redis answers a shutdown by closing the connection.
            with contextlib.suppress(redis.exceptions.ConnectionError):
                redis.Redis.from_url(self.url).shutdown(nosave=True)
            self.process.wait(timeout=20)

    def restart(self, down_seconds: float = 2.0) -> None:
        self.stop()
        time.sleep(down_seconds)
        self.start()


@pytest.fixture
def own_redis(tmp_path, real_services):
    """The test's Redis as broker and channel layer of the test process and its workers."""
    server = OwnRedis(tmp_path)
    server.start()
    layer = settings.CHANNEL_LAYERS["default"]
    override = override_settings(
        REDIS_URL=server.url,
        CELERY_BROKER_URL=server.url,
        CHANNEL_LAYERS={
            "default": {
                **layer,
                "CONFIG": {**layer["CONFIG"], "hosts": [{"address": server.url, "socket_timeout": 30}]},
            }
        },
    )  # fmt: skip
    previous = celery_app.conf.broker_url
    override.enable()
    # Results stay on the shared test Redis: nothing here reads them, and a result
    # subscription on a Redis that restarts only makes noise.
    _use_broker(server.url)
    yield server
    _use_broker(previous)
    override.disable()
    server.stop()


def _use_broker(broker_url: str) -> None:
    celery_app.conf.update(broker_url=broker_url)
    # Connections and producers made for the previous broker are not used again.
    celery_app._pool = None
    celery_app.amqp._producer_pool = None


class Workers:
    """Starts `celery -A workers worker` processes as run.sh does, each in a process group
    of its own, so a test can kill a whole worker (main process and pool) at once."""

    def __init__(self, broker_url: str, database_url: str, runs_dir: Path, var_dir: Path):
        self.broker_url = broker_url
        self.database_url = database_url
        self.runs_dir = runs_dir
        self.var_dir = var_dir
        self.started: list[subprocess.Popen] = []

    def start(self, name: str, *, queues: str = "cpu,gpu,inference", concurrency: int = 2,
              env: dict | None = None, wait: bool = True) -> dict:  # fmt: skip
        node = f"{name}-{os.getpid()}@{socket.gethostname()}"
        log_path = self.var_dir / f"{name}.log"
        full_env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "webapp.settings",
            "DATABASE_URL": self.database_url,
            "REDIS_URL": self.broker_url,
            "RUNS_DIR": str(self.runs_dir),
            "RLLAB_VAR_DIR": str(self.var_dir),
            "SECRET_KEY": "test-worker",
            "PYTHONUNBUFFERED": "1",
            **(env or {}),
        }
        command = [sys.executable, "-m", "celery", "-A", "workers", "worker", "-Q", queues,
                   "-c", str(concurrency), "-n", node, "-l", "INFO"]  # fmt: skip
        with log_path.open("a") as log_file:
            process = subprocess.Popen(
                command, cwd=REPO, env=full_env, stdout=log_file, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        self.started.append(process)
        worker = {"node": node, "process": process, "log": log_path}
        if wait:
            self.wait_ready(worker)
        return worker

    def wait_ready(self, worker: dict, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while not _ping(worker["node"]):
            if worker["process"].poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"worker {worker['node']} does not answer:\n{log_tail(worker)}")

    def stop_all(self) -> None:
        for process in self.started:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in self.started:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def _ping(node: str) -> bool:
    try:
        return bool(celery_app.control.ping(destination=[node], timeout=0.5))
    except (redis.exceptions.ConnectionError, OSError):
        # This process's pooled connection died with the Redis it talked to.
        _use_broker(celery_app.conf.broker_url)
        time.sleep(0.5)
        return False


def log_tail(worker: dict, chars: int = 4000) -> str:
    return worker["log"].read_text()[-chars:]


@pytest.fixture
def workers(own_redis, real_services, django_db_blocker, tmp_path):
    with django_db_blocker.unblock():
        database_url = _database_url()
    var_dir = tmp_path / "var"
    var_dir.mkdir()
    started = Workers(own_redis.url, database_url, real_services, var_dir)
    yield started
    started.stop_all()
