"""rlcore: environments with verifiable rewards, policies, evaluation and training.

Plain library and CLI (`python -m rlcore`); it never imports Django, Celery or Channels.
"""

__version__ = "0.1.0"
