"""The job websocket on the real Redis channel layer: who may subscribe, and that a
worker's group_send reaches the page."""

import pytest
from channels.db import database_sync_to_async
from channels.layers import get_channel_layer
from channels.testing import WebsocketCommunicator
from channels_redis.core import RedisChannelLayer
from django.test import Client

from tests.lab_fixtures import refused
from webapp.asgi import application
from webapp.jobs.live import job_group
from webapp.jobs.models import Job

pytestmark = pytest.mark.django_db(transaction=True)


@database_sync_to_async
def make_job_and_cookies():
    from django.contrib.auth import get_user_model

    User = get_user_model()
    alice = User.objects.create_user("alice", password="pw")
    bob = User.objects.create_user("bob", password="pw")
    job = Job.objects.create(
        owner=alice, kind="eval", config={"env": "tictactoe"}, status="running"
    )
    cookies = {}
    for user in (alice, bob):
        client = Client()
        client.force_login(user)
        cookies[user.username] = f"sessionid={client.cookies['sessionid'].value}".encode()
    return job, cookies


def communicator(job_id: int, cookie: bytes | None) -> WebsocketCommunicator:
    headers = [(b"origin", b"http://localhost"), (b"host", b"localhost")]
    if cookie:
        headers.append((b"cookie", cookie))
    return WebsocketCommunicator(application, f"/ws/jobs/{job_id}/", headers=headers)


async def test_the_layer_is_the_real_redis_one():
    assert isinstance(get_channel_layer(), RedisChannelLayer)


async def test_unauthenticated_sockets_are_refused():
    job, _ = await make_job_and_cookies()
    assert await refused(communicator(job.pk, None)) == 4401


async def test_bob_cannot_subscribe_to_alices_job():
    job, cookies = await make_job_and_cookies()
    assert await refused(communicator(job.pk, cookies["bob"])) == 4403


async def test_alice_receives_a_batch_sent_to_her_jobs_group():
    job, cookies = await make_job_and_cookies()
    socket = communicator(job.pk, cookies["alice"])
    connected, _ = await socket.connect()
    assert connected
    assert await socket.receive_json_from(timeout=5) == {"type": "hello", "job": job.pk}
    batch = {
        "type": "job.update",
        "job": job.pk,
        "since_step": 2,
        "last_step": 3,
        "progress": {"done": 3, "total": 10, "desc": "rl"},
        "metrics": [{"step": 3, "name": "reward/mean", "value": 0.5, "t": 1.0}],
        "rollouts": [{"id": 7, "step": 3, "example_id": 1, "outcome": "win", "reward": 1.0}],
        "logs": [],
        "checkpoints": [],
    }
    await get_channel_layer().group_send(job_group(job.pk), batch)
    assert await socket.receive_json_from(timeout=5) == batch
    await get_channel_layer().group_send(
        job_group(job.pk),
        {"type": "job.status", "job": job.pk, "status": "failed", "reason": "worker_lost"},
    )
    status = await socket.receive_json_from(timeout=5)
    assert status["status"] == "failed" and status["reason"] == "worker_lost"
    await socket.disconnect()


async def test_a_socket_from_a_foreign_origin_is_refused():
    job, cookies = await make_job_and_cookies()
    socket = WebsocketCommunicator(
        application,
        f"/ws/jobs/{job.pk}/",
        headers=[(b"origin", b"http://evil.example"), (b"cookie", cookies["alice"])],
    )
    await refused(socket)


async def test_an_idle_socket_still_gets_batches_after_the_redis_read_timeout():
    import asyncio

    job, cookies = await make_job_and_cookies()
    socket = communicator(job.pk, cookies["alice"])
    assert (await socket.connect())[0]
    await socket.receive_json_from(timeout=5)
    await asyncio.sleep(6)  # longer than redis-py's default 5 s read timeout
    await get_channel_layer().group_send(
        job_group(job.pk), {"type": "job.status", "job": job.pk, "status": "running"}
    )
    assert (await socket.receive_json_from(timeout=5))["status"] == "running"
    await socket.disconnect()
