"""The Celery app "rllab": Redis broker and result backend, queues cpu, gpu, inference.

Configuration lives in Django settings (CELERY_* names, read from REDIS_URL); see
webapp/settings.py for why jobs are acknowledged late and redelivered when a worker dies,
and why workers retry the broker forever.

`Consumer` is the worker's consumer with one fix for a Redis restart. Celery 5.7.0 added a
`connection.close()` after `connection.collect()` when the broker connection is lost.
`collect()` has by then detached the kombu transport from the connection
(`transport.client = None`), but when Redis went away while the consumer's channel was
inside a BRPOP, that channel's first close failed half-way and it is still the connection's
default channel. The second close then restores the channel's unacknowledged messages (the
running job's, acknowledged late) through a new Redis pool, whose parameters are read from
`transport.client.hostname`: AttributeError, which is not a connection error, so the worker
stopped with "Unrecoverable error" once the running job finished. Celery 5.6 only collected.
"""

import importlib.util
import os

from celery import Celery
from celery.worker.consumer import Consumer as CeleryConsumer

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")

# workers.play_tasks arrives with the Play page; until then a worker runs without it.
TASK_MODULES = [
    name for name in ("workers.tasks", "workers.play_tasks") if importlib.util.find_spec(name)
]


class Consumer(CeleryConsumer):
    """Celery's consumer, surviving a broker restart with a late-acknowledged task running."""

    def on_connection_error_after_connected(self, exc):
        connection = self.connection
        if connection is not None:
            collect = connection.collect

            def collect_and_forget_default_channel(*args, **kwargs):
                collect(*args, **kwargs)
                # The transport is gone: a channel that could not be closed now cannot be
                # closed later either. Its unacknowledged messages stay in Redis's unacked
                # hash (restored after the visibility timeout, like any lost worker's), and
                # the database, not the broker, says which jobs still need a worker.
                connection._default_channel = None

            connection.collect = collect_and_forget_default_channel
        return super().on_connection_error_after_connected(exc)


app = Celery("rllab", include=TASK_MODULES)
app.config_from_object("django.conf:settings", namespace="CELERY")
