"""The job page's websocket: ws/jobs/<id>/ joins the job's channel group.

Only a logged-in owner (or staff) may subscribe; anyone else is refused during the
handshake. Workers send one `job.update` per step batch and a `job.status` when the job
changes state; both are passed through as JSON. The page treats them as notifications
and re-reads the API after a reconnect or a gap in the step cursor.
"""

from __future__ import annotations

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from webapp.jobs.live import job_group
from webapp.jobs.models import Job

# Application close codes (4000-4999): the page shows why it was refused.
CLOSE_UNAUTHENTICATED = 4401
CLOSE_FORBIDDEN = 4403


@database_sync_to_async
def _may_watch(user, job_id: int) -> bool:
    jobs = Job.objects.filter(pk=job_id)
    if not user.is_staff:
        jobs = jobs.filter(owner=user)
    return jobs.exists()


class OwnedGroupConsumer(AsyncJsonWebsocketConsumer):
    """A one-way socket onto the channel group of one row the user may watch.

    Subclasses name the URL kwarg holding the row's id, how to check access and the group
    name; refused handshakes close with CLOSE_UNAUTHENTICATED or CLOSE_FORBIDDEN."""

    url_kwarg = "id"

    async def may_watch(self, user, pk: int) -> bool:
        raise NotImplementedError

    def group_name(self, pk: int) -> str:
        raise NotImplementedError

    async def connect(self):
        user = self.scope.get("user")
        self.group = None
        if user is None or not user.is_authenticated:
            await self.close(code=CLOSE_UNAUTHENTICATED)
            return
        pk = int(self.scope["url_route"]["kwargs"][self.url_kwarg])
        if not await self.may_watch(user, pk):
            await self.close(code=CLOSE_FORBIDDEN)
            return
        self.group = self.group_name(pk)
        await self.channel_layer.group_add(self.group, self.channel_name)
        await self.accept()
        await self.send_json({"type": "hello", self.url_kwarg.removesuffix("_id"): pk})

    async def disconnect(self, code):
        if self.group:
            await self.channel_layer.group_discard(self.group, self.channel_name)

    async def receive_json(self, content, **kwargs):
        # The socket is one-way; a ping lets the page check the connection is alive.
        if isinstance(content, dict) and content.get("type") == "ping":
            await self.send_json({"type": "pong"})


class JobConsumer(OwnedGroupConsumer):
    url_kwarg = "job_id"

    async def may_watch(self, user, pk: int) -> bool:
        return await _may_watch(user, pk)

    def group_name(self, pk: int) -> str:
        return job_group(pk)

    async def job_update(self, event):
        await self.send_json(event)

    async def job_status(self, event):
        await self.send_json(event)
