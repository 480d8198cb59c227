"""The Celery app "rllab": Redis broker and result backend, queues cpu, gpu, inference.

Configuration lives in Django settings (CELERY_* names, read from REDIS_URL); see
webapp/settings.py for why jobs are acknowledged late and redelivered when a worker dies.
"""

import importlib.util
import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")

# workers.play_tasks arrives with the Play page; until then a worker runs without it.
TASK_MODULES = [
    name for name in ("workers.tasks", "workers.play_tasks") if importlib.util.find_spec(name)
]

app = Celery("rllab", include=TASK_MODULES)
app.config_from_object("django.conf:settings", namespace="CELERY")
