"""Celery workers: the bridge between the web lab and rlcore.

`celery -A workers worker -Q cpu,gpu,inference` starts a worker. Tasks load a Job row,
build the rlcore config stored with it, run it, and feed a sink that writes metrics,
rollouts and log lines to the database and notifies the job's channel group.
"""

from workers.celery import app

__all__ = ["app"]
