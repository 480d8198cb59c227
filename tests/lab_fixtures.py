"""Shared fixtures for the web lab: users alice and bob (bob must never see alice's
work), staff carol, the real Redis on a test database number, and a real Celery worker.

Run with PostgreSQL, e.g.
  DATABASE_URL=postgres://postgres@127.0.0.1:5432/rllab .venv/bin/pytest tests/web
pytest-django creates test_rllab next to it. Redis DB 14 (TEST_REDIS_URL) is used for the
broker and the channel layer so a running `make run` on DB 0 is not disturbed; under
pytest-xdist (make test) each further process takes the database two below the last.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
from asgiref.sync import async_to_sync
from channels.layers import DEFAULT_CHANNEL_LAYER, channel_layers, get_channel_layer
from channels.testing import WebsocketCommunicator
from django.conf import settings
from django.db import connection, transaction
from django.test import Client, override_settings

from webapp.jobs import services
from webapp.jobs.live import job_group
from webapp.jobs.models import Job
from workers.celery import app as celery_app

REPO = Path(__file__).resolve().parents[1]


def _own_database(url: str) -> str:
    """`url` for this test process: under pytest-xdist each worker (gw0, gw1, ...) takes its
    own Redis database number (14, 12, 10, ...), so that its Celery worker, broker queues
    and channel layer never meet another's; PostgreSQL is kept apart by pytest-django."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    base, _, number = url.rpartition("/")
    own = int(number or 0) - 2 * int(worker.removeprefix("gw"))
    if own < 1:  # never database 0, where `make run` keeps the lab's queues
        raise RuntimeError(
            f"test worker {worker} has no Redis database left below {url}: "
            "run fewer processes (TEST_WORKERS) or a higher TEST_REDIS_URL database"
        )
    return f"{base}/{own}"


TEST_REDIS_URL = _own_database(os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379/14"))
os.environ["REDIS_URL"] = TEST_REDIS_URL  # for what the tests start as subprocesses
TERMINAL = tuple(Job.TERMINAL)


@pytest.fixture(scope="session", autouse=True)
def real_services(tmp_path_factory):
    """PostgreSQL and the test Redis database, for the whole session."""
    engine = settings.DATABASES["default"]["ENGINE"]
    if engine != "django.db.backends.postgresql":
        pytest.fail(
            f"tests/web run on PostgreSQL, but DATABASE_URL gives {engine}; run them with "
            "DATABASE_URL=postgres://postgres@127.0.0.1:5432/rllab"
        )
    redis.Redis.from_url(TEST_REDIS_URL).flushdb()
    runs_dir = tmp_path_factory.mktemp("runs")
    override = override_settings(
        REDIS_URL=TEST_REDIS_URL,
        CELERY_BROKER_URL=TEST_REDIS_URL,
        CELERY_RESULT_BACKEND=TEST_REDIS_URL,
        CHANNEL_LAYERS={
            "default": {
                "BACKEND": "channels_redis.core.RedisChannelLayer",
                "CONFIG": {
                    **settings.CHANNEL_LAYERS["default"]["CONFIG"],
                    "hosts": [{"address": TEST_REDIS_URL, "socket_timeout": 30}],
                },
            }
        },
        RUNS_DIR=runs_dir,
        CHECKPOINT_ROOT=runs_dir,
        MODEL_ROOTS=[*settings.MODEL_ROOTS, runs_dir],
    )
    override.enable()
    celery_app.conf.update(broker_url=TEST_REDIS_URL, result_backend=TEST_REDIS_URL)
    yield runs_dir
    override.disable()


@pytest.fixture(autouse=True)
def fresh_channel_layer():
    """Each test gets a channel layer of its own. Channels keeps one per process, but a
    Redis layer's receive state (lock, buffers, cleanup tasks) belongs to the event loop
    that used it, and pytest-asyncio (like async_to_sync) runs each test on a new loop;
    the old loop's pools are closed with it (channels_redis wraps loop.close)."""
    channel_layers.backends.pop(DEFAULT_CHANNEL_LAYER, None)
    yield
    channel_layers.backends.pop(DEFAULT_CHANNEL_LAYER, None)


@pytest.fixture
def alice(django_user_model):
    return django_user_model.objects.create_user("alice", password="alice-password")


@pytest.fixture
def bob(django_user_model):
    return django_user_model.objects.create_user("bob", password="bob-password")


@pytest.fixture
def carol(django_user_model):
    return django_user_model.objects.create_user("carol", password="carol-password", is_staff=True)


def job_form_data(user, kind: str, **changes) -> dict:
    """A full post of the job form of `kind` as the page renders it (every setting at its
    initial value), with `changes` (form field names) on top."""
    from webapp.jobs.forms import JobForm

    fields = JobForm(kind=kind, user=user).fields
    data = {name: field.initial for name, field in fields.items() if field.initial is not None}
    data = {name: value for name, value in data.items() if value is not False}  # unticked
    return {"kind": kind, **data, **changes}


def client_for(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def alice_client(alice):
    return client_for(alice)


@pytest.fixture
def bob_client(bob):
    return client_for(bob)


@pytest.fixture
def ttt_config(alice):
    """Alice's tic-tac-toe config: short games, a fixed mark so examples vary little."""
    return services.env_config_save(
        owner=alice, name="ttt", env_name="tictactoe", params={"max_turns": 6}
    )


@pytest.fixture
def oracle(alice):
    return services.model_create(owner=alice, name="oracle", kind="builtin", location="oracle")


def announce_node(name: str, *, queues=("cpu",), gpus=()) -> None:
    """A worker node's announcement as workers/nodes.py writes it, for tests of routing
    that need nodes of a kind this machine has not (GPUs of a given size)."""
    from webapp.jobs.nodes import node_announce

    node_announce(
        name=name,
        host=name.partition("@")[2] or name,
        queues=list(queues),
        concurrency=1,
        gpus=[
            {"index": index, "name": f"GPU {size:g} GiB", "total_gib": size, "free_gib": size}
            for index, size in enumerate(gpus)
        ],
        versions={"python": "3", "commit": "test"},
        engines=["local"],
        checkpoint_root="",
        pid=1,
    )


@pytest.fixture
def gpu_node(db):
    """A live worker node on the gpu queue with one 80 GiB GPU."""
    announce_node("gpu@box", queues=("gpu",), gpus=(80,))


@pytest.fixture
def tiny(alice):
    return services.model_create(owner=alice, name="tiny", kind="tiny")


# ---------------------------------------------------------------------------------------
# The real Celery worker


def _database_url() -> str:
    db = connection.settings_dict
    auth = db["USER"] + (f":{db['PASSWORD']}" if db.get("PASSWORD") else "")
    return f"postgres://{auth}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}"


@pytest.fixture(scope="session")
def celery_worker(django_db_setup, django_db_blocker, real_services, tmp_path_factory):
    """`celery -A workers worker -Q cpu,inference` against the test database and the
    test Redis, as a user would start it; yields its node name."""
    node = f"rllab-test-{os.getpid()}@{socket.gethostname()}"
    var_dir = tmp_path_factory.mktemp("var")
    log_path = var_dir / "worker.log"
    with django_db_blocker.unblock():
        database_url = _database_url()
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "webapp.settings",
        "DATABASE_URL": database_url,
        "REDIS_URL": TEST_REDIS_URL,
        "RUNS_DIR": str(real_services),
        "RLLAB_VAR_DIR": str(var_dir),
        "SECRET_KEY": "test-worker",
        "PYTHONUNBUFFERED": "1",
    }
    # No gpu queue: this machine has no GPU, and a live node on gpu without one would
    # (rightly) keep GPU jobs off that queue in the routing tests that share this database.
    command = [
        sys.executable, "-m", "celery", "-A", "workers", "worker",
        "-Q", "cpu,inference", "-c", "1", "-n", node,
        "--without-gossip", "--without-mingle", "-l", "INFO",
    ]  # fmt: skip
    with log_path.open("w") as log_file:
        process = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=log_file, stderr=subprocess.STDOUT
        )
    deadline = time.monotonic() + 90
    while not celery_app.control.ping(destination=[node], timeout=0.5):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"the Celery worker did not start:\n{log_path.read_text()[-4000:]}")
    yield {"node": node, "process": process, "log": log_path}
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def wait_for_job(job: Job, statuses=TERMINAL, timeout: float = 240) -> Job:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job.refresh_from_db()
        if job.status in statuses:
            return job
        time.sleep(0.2)
    raise AssertionError(f"job {job.pk} still {job.status} after {timeout}s: {job.error}")


class GroupListener:
    """A plain channel subscribed to a job's group on the real Redis layer."""

    def __init__(self, job_id: int):
        self.layer = get_channel_layer()
        self.channel = f"test.listener.{job_id}.{os.getpid()}"
        self.group = job_group(job_id)
        async_to_sync(self.layer.group_add)(self.group, self.channel)

    def collect(self, *, until_status=TERMINAL, timeout: float = 240) -> list[dict]:
        """Every message until a job.status with one of `until_status` (or timeout)."""

        async def run() -> list[dict]:
            received = []
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                # Only the overall deadline may cancel a read: cancelling a blocking pop
                # midway can drop the message it was receiving.
                try:
                    message = await asyncio.wait_for(
                        self.layer.receive(self.channel), timeout=deadline - time.monotonic()
                    )
                except (TimeoutError, redis.exceptions.TimeoutError):
                    break
                received.append(message)
                if message["type"] == "job.status" and message["status"] in until_status:
                    return received
            raise AssertionError(f"no final status within {timeout}s; got {received[-3:]}")

        return async_to_sync(run)()


async def refused(socket: WebsocketCommunicator) -> int:
    """Connect, expect a refusal, and return its close code. The consumer that refused
    still listens on the channel layer until it gets the disconnect, so it is stopped
    here, in the test's own loop: a consumer left running is cancelled only when the
    loop closes, mid-read on Redis, and one CI run hung there for 600 s."""
    connected, code = await socket.connect()
    await socket.disconnect(timeout=5)
    assert not connected
    return code


def create_job_with_listener(**kwargs) -> tuple[Job, GroupListener]:
    """Create (and, on commit, enqueue) a job with a listener subscribed before the
    worker can send anything."""
    with transaction.atomic():
        job = services.job_create(**kwargs)
        listener = GroupListener(job.pk)
    return job, listener


# ---------------------------------------------------------------------------------------
# A finished eval without a worker: real rlcore rollouts stored as the worker would


@pytest.fixture
def alice_eval(alice, ttt_config, oracle):
    """A succeeded eval job of alice's with metrics at steps 1..30, and 8 real rollouts
    of the oracle (played in-process by rlcore) at steps 4 and 8."""
    from rlcore.evaluate import EvalConfig, run_eval
    from rlcore.events import RecordingSink
    from webapp.jobs.models import Metric
    from workers.sink import rollout_row

    config = EvalConfig(env="tictactoe", model="oracle", env_args=dict(ttt_config.params),
                        num_examples=8, max_tokens=24, concurrency=4)  # fmt: skip
    result = run_eval(config, RecordingSink())
    job = Job.objects.create(
        owner=alice, kind="eval", status="succeeded", config=config.to_dict(),
        env_config=ttt_config, model=oracle, summary=result.summary, last_step=30,
        progress_done=8, progress_total=8,
    )  # fmt: skip
    Metric.objects.bulk_create(
        Metric(job=job, step=step, name=name, value=value)
        for step in range(1, 31)
        for name, value in (("reward/mean", step / 30), ("loss/kl", 0.01 * step))
    )
    rows = [rollout_row(job.pk, 4 if i < 4 else 8, r) for i, r in enumerate(result.rollouts)]
    from webapp.jobs.models import Rollout

    Rollout.objects.bulk_create(rows)
    return job
