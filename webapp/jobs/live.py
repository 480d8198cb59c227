"""Live notifications: one Channels group per job, fed through the Redis channel layer.

Messages only tell a page that something changed and carry the new points; the database
stays the source of truth, and a page re-reads it after any reconnect. A failed send (Redis
briefly away, a full channel) is logged and never fails the job that sent it.
"""

from __future__ import annotations

import logging

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer

log = logging.getLogger(__name__)


def job_group(job_id: int) -> str:
    return f"job-{job_id}"


def notify_job(job_id: int, message: dict) -> bool:
    """Send `message` (its "type" names the consumer handler) to the job's group."""
    layer = get_channel_layer()
    if layer is None:
        return False
    try:
        async_to_sync(layer.group_send)(job_group(job_id), message)
    except Exception as exc:  # the page catches up from the database on reconnect
        log.warning("could not notify job %s: %s", job_id, exc)
        return False
    return True
