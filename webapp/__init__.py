"""The rllab web lab: a Django project whose apps show environments, models, jobs,
metrics and rollouts, and enqueue work for the Celery workers."""
