"""Settings for the rllab web lab, read from the environment with documented defaults.

Environment variables (all optional):
  SECRET_KEY     signing key; default: generated once and kept in RLLAB_VAR_DIR/secret_key
  DEBUG          "1"/"true" for development pages with tracebacks; default off
  ALLOWED_HOSTS  comma-separated host names; default localhost,127.0.0.1,[::1]
  DATABASE_URL   e.g. postgres://postgres@127.0.0.1:5432/rllab; default sqlite
                 RLLAB_VAR_DIR/db.sqlite3
  DB_POOL_MAX_SIZE  PostgreSQL connections pooled per web process (default 0: no pool;
                 make run sets 8 for the web server; never for Celery workers, whose forked
                 pool processes must not inherit pooled connections)
  REDIS_URL      Celery broker + result backend and the Channels layer;
                 default redis://127.0.0.1:6379/0
  RLLAB_VAR_DIR  where the lab keeps its files; default ./var
  RUNS_DIR       job outputs (eval results, synth datasets); default RLLAB_VAR_DIR/runs
  CHECKPOINT_ROOT  where SFT and RL jobs write their checkpoints: a path every node
                 shares (NFS or the like, docs/DEPLOY.md); default RUNS_DIR
  MODEL_ROOTS    os.pathsep-separated directories a model path may live under;
                 default RUNS_DIR, CHECKPOINT_ROOT, RLLAB_VAR_DIR/models,
                 ~/.cache/rlcore/models, ./runs
  WORKER_LOST_SECONDS   a running job whose worker sent no heartbeat for this long is
                        marked lost (default 45: with the watchdog's 10 s, a dead worker's
                        job is lost within 55 s)
  JOB_HEARTBEAT_SECONDS how often a running job's sink writes its heartbeat, even within a
                        long step; default WORKER_LOST_SECONDS / 4, at most 15
  WORKER_WATCHDOG_SECONDS  how often each worker looks for lost jobs and queued jobs whose
                        broker message is gone (default 10)
  QUEUED_RESEND_SECONDS a queued job this old whose message is not in the broker is sent
                        again (default 30)
  NODE_LOST_SECONDS     a worker node silent this long is shown (and marked) gone
                        (default WORKER_LOST_SECONDS)
  NODE_GPU_REFRESH_SECONDS  how often a node measures its GPUs' free memory (default 60)
  INFERENCE_ENGINE      Play moves of local models on this worker: local (default) or
                        vllm (a `vllm serve` per model, docs/DEPLOY.md)
  VLLM_SERVE_COMMAND    the command that serves a checkpoint for the vllm engine; {model},
                        {host}, {port} and {name} are filled in (default: vllm serve ...)
  VLLM_STARTUP_SECONDS  how long a starting server may take to answer (default 600)
"""

from __future__ import annotations

import importlib.util
import os
import secrets
from pathlib import Path

import dj_database_url
import plotly

BASE_DIR = Path(__file__).resolve().parent.parent


def _env_bool(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    return value.strip().lower() in ("1", "true", "yes", "on")


def _dir(value: str) -> Path:
    path = Path(value).expanduser()
    return path if path.is_absolute() else BASE_DIR / path


VAR_DIR = _dir(os.environ.get("RLLAB_VAR_DIR", "var"))
RUNS_DIR = _dir(os.environ.get("RUNS_DIR", str(VAR_DIR / "runs")))
CHECKPOINT_ROOT = _dir(os.environ.get("CHECKPOINT_ROOT") or str(RUNS_DIR))
MODEL_ROOTS = [
    _dir(p)
    for p in os.environ.get(
        "MODEL_ROOTS",
        os.pathsep.join(
            dict.fromkeys(
                [str(RUNS_DIR), str(CHECKPOINT_ROOT), str(VAR_DIR / "models"),
                 "~/.cache/rlcore/models", "runs"]
            )
        ),
    ).split(os.pathsep)
    if p.strip()
]  # fmt: skip


def _secret_key() -> str:
    # A key kept on disk keeps sessions valid across restarts without a default that
    # every installation would share.
    if os.environ.get("SECRET_KEY"):
        return os.environ["SECRET_KEY"]
    key_file = VAR_DIR / "secret_key"
    if not key_file.exists():
        VAR_DIR.mkdir(parents=True, exist_ok=True)
        key_file.write_text(secrets.token_urlsafe(50))
        key_file.chmod(0o600)
    return key_file.read_text().strip()


SECRET_KEY = _secret_key()
DEBUG = _env_bool("DEBUG", False)
ALLOWED_HOSTS = [
    h.strip()
    for h in os.environ.get("ALLOWED_HOSTS", "localhost,127.0.0.1,[::1]").split(",")
    if h.strip()
]
CSRF_TRUSTED_ORIGINS = [
    o.strip() for o in os.environ.get("CSRF_TRUSTED_ORIGINS", "").split(",") if o.strip()
]

# The Play page is written separately; it joins the project as soon as its package exists.
PLAY_ENABLED = importlib.util.find_spec("webapp.play") is not None

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "channels",
    "webapp.accounts",
    "webapp.jobs",
] + (["webapp.play"] if PLAY_ENABLED else [])

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "webapp.urls"
WSGI_APPLICATION = "webapp.wsgi.application"
ASGI_APPLICATION = "webapp.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "webapp.jobs.context_processors.lab",
            ],
        },
    },
]

DATABASES = {
    "default": dj_database_url.parse(
        os.environ.get("DATABASE_URL") or f"sqlite:///{VAR_DIR / 'db.sqlite3'}",
        conn_max_age=0,
    )
}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    VAR_DIR.mkdir(parents=True, exist_ok=True)
elif int(os.environ.get("DB_POOL_MAX_SIZE", "0")) > 0:
    # Each request in flight runs in a thread of its own; without a pool each opens a
    # PostgreSQL connection, and a burst of 200 requests runs past the server's 100
    # (docs/BENCHMARKS.md, "Load"). A small pool per process serves them in turn.
    DATABASES["default"].setdefault("OPTIONS", {})["pool"] = {
        "min_size": 1,
        "max_size": int(os.environ.get("DB_POOL_MAX_SIZE", "0")),
        "timeout": 30,
    }
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "jobs:job_list"
LOGOUT_REDIRECT_URL = "login"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

STATIC_URL = "/static/"
STATIC_ROOT = BASE_DIR / "static_root"
# Plotly.js comes from the plotly Python package we already depend on: no CDN, no copy.
STATICFILES_DIRS = [
    BASE_DIR / "static",
    ("vendor/plotly", Path(plotly.__file__).parent / "package_data"),
]

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
CHANNEL_LAYERS = {
    "default": {
        "BACKEND": "channels_redis.core.RedisChannelLayer",
        # The socket only notifies; pages re-read the database on (re)connect, so a short
        # expiry is safe.
        # redis-py 8 times reads out after 5 s by default, the same 5 s channels_redis
        # blocks for in receive(): an idle socket would then die of a TimeoutError.
        "CONFIG": {
            "hosts": [{"address": REDIS_URL, "socket_timeout": 30}],
            "capacity": 500,
            "expiry": 30,
        },
    }
}

CELERY_BROKER_URL = REDIS_URL
CELERY_RESULT_BACKEND = REDIS_URL
CELERY_TASK_DEFAULT_QUEUE = "cpu"
CELERY_TASK_ROUTES = {
    "workers.tasks.run_job": {"queue": "cpu"},
    "workers.play_tasks.*": {"queue": "inference"},
}
# A job is acknowledged only when it ends, one at a time per worker process, and a worker
# process that dies hands its message back instead of losing it; run_job then sees the
# job still "running" and marks it failed with the reason (see workers/tasks.py).
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
# Redis redelivers unacknowledged messages after this long; training jobs run for hours.
CELERY_BROKER_TRANSPORT_OPTIONS = {"visibility_timeout": 24 * 3600}
CELERY_RESULT_EXPIRES = 24 * 3600
CELERY_TASK_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
# A worker rides out broker restarts: it retries the connection forever (the default gives
# up after 100 tries and the worker exits), at startup as well, and lets running jobs go on
# while the broker is away (their rows, not the broker, are the record). The consumer class
# fixes Celery 5.7.0's crash on reconnecting with a job running (see workers/celery.py).
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_BROKER_CONNECTION_MAX_RETRIES = None
CELERY_WORKER_CANCEL_LONG_RUNNING_TASKS_ON_CONNECTION_LOSS = False
CELERY_WORKER_CONSUMER = "workers.celery:Consumer"

# Every worker runs a watchdog thread (workers/tasks.py): jobs whose heartbeat is older than
# WORKER_LOST_SECONDS are marked lost, and queued jobs whose message the broker no longer
# holds (Redis restarted without persistence) are sent again.
WORKER_LOST_SECONDS = float(os.environ.get("WORKER_LOST_SECONDS", "45"))
JOB_HEARTBEAT_SECONDS = float(
    os.environ.get("JOB_HEARTBEAT_SECONDS") or min(15.0, WORKER_LOST_SECONDS / 4)
)
WORKER_WATCHDOG_SECONDS = float(os.environ.get("WORKER_WATCHDOG_SECONDS", "10"))
QUEUED_RESEND_SECONDS = float(os.environ.get("QUEUED_RESEND_SECONDS", "30"))
# Worker nodes (workers/nodes.py): each announces itself and heartbeats from its watchdog.
NODE_LOST_SECONDS = float(os.environ.get("NODE_LOST_SECONDS") or WORKER_LOST_SECONDS)
NODE_GPU_REFRESH_SECONDS = float(os.environ.get("NODE_GPU_REFRESH_SECONDS", "60"))
# The vllm engine (workers/engines.py): how a checkpoint is served, and Play's engine.
INFERENCE_ENGINE = os.environ.get("INFERENCE_ENGINE", "local")
VLLM_SERVE_COMMAND = os.environ.get(
    "VLLM_SERVE_COMMAND",
    "vllm serve {model} --host {host} --port {port} --served-model-name {name}",
)
VLLM_STARTUP_SECONDS = float(os.environ.get("VLLM_STARTUP_SECONDS", "600"))

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "root": {"handlers": ["console"], "level": "INFO" if DEBUG else "WARNING"},
}
