"""The lab's data: environment configs, registered models, jobs and what jobs report
(metrics, rollouts, log lines, checkpoints).

A Job row stores its fully resolved rlcore config, so what ran can always be read back.
Workers write Metric, Rollout and LogLine rows in batches; pages and the JSON API read
them. Behaviour that is about one row (its URL, whether it can be cancelled, how long it
ran, its compact JSON form) lives here on the model.
"""

from __future__ import annotations

import re
from pathlib import Path

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import models
from django.urls import reverse
from django.utils import timezone


class EnvironmentConfig(models.Model):
    """A named set of parameters for one registered environment, validated by its schema."""

    name = models.CharField(max_length=100)
    env_name = models.CharField(max_length=100)
    params = models.JSONField(default=dict, blank=True)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE)
    created = models.DateTimeField(default=timezone.now)
    updated = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]
        constraints = [
            models.UniqueConstraint(fields=["owner", "name"], name="unique_env_config_name")
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.env_name})"

    def get_absolute_url(self) -> str:
        return reverse("jobs:env_config_edit", args=[self.pk])


class ApiKey(models.Model):
    """An API key staff declared for one endpoint: the key's value lives in environment
    variable `env_var` on the workers, and is only ever sent to `base_url`.

    Users pick a key by name when they register an endpoint model; they can never name an
    environment variable themselves, so no request can make a worker send a server secret
    (SECRET_KEY, REDIS_URL, a cloud token) anywhere.
    """

    name = models.CharField(max_length=100, unique=True)
    env_var = models.CharField(
        max_length=100, help_text="The environment variable holding the key on the workers."
    )
    base_url = models.CharField(
        max_length=500,
        help_text="The only endpoint the key is sent to, e.g. https://api.openai.com/v1",
    )
    description = models.CharField(max_length=200, blank=True)
    created = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["name"]
        verbose_name = "API key"

    def __str__(self) -> str:
        return f"{self.name} ({self.base_url})"

    def clean(self) -> None:
        from webapp.jobs.validation import looks_like_secret

        errors = {}
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", self.env_var or "") or looks_like_secret(
            self.env_var
        ):
            errors["env_var"] = (
                "the NAME of the variable that holds the key on the workers (letters, digits, "
                "underscores, e.g. OPENAI_API_KEY), never the key itself"
            )
        if not re.fullmatch(r"https?://\S+", self.base_url or ""):
            errors["base_url"] = "an http(s) URL such as https://api.openai.com/v1"
        if errors:
            raise ValidationError(errors)

    def serves(self, base_url: str) -> bool:
        """Whether `base_url` is the endpoint this key was declared for."""
        return self.base_url.strip().rstrip("/") == (base_url or "").strip().rstrip("/")

    @classmethod
    def check_use(cls, *, base_url: str | None, env_var: str | None) -> None:
        """PermissionError unless the key in `env_var` may be sent to `base_url`: no
        endpoint, no key, or a key staff declared for exactly that endpoint. Workers call
        this before any request leaves, whatever a stored config or game says."""
        if not base_url or not env_var:
            return
        if not any(key.serves(base_url) for key in cls.objects.filter(env_var=env_var)):
            raise PermissionError(
                f"refusing to send the key in ${env_var} to {base_url}: no API key declared "
                "by staff pairs that variable with that endpoint"
            )


class ModelEntry(models.Model):
    """A policy a job can use: the tiny model, a checkpoint directory, a hub id, an
    OpenAI-compatible endpoint, or an environment's built-in player.

    An endpoint may use one of the API keys staff declared (ApiKey), and only with the
    base URL that key was declared for; the key itself never enters the database.
    """

    class Kind(models.TextChoices):
        TINY = "tiny", "built-in tiny model"
        HF = "hf", "Hugging Face directory or hub id"
        CHECKPOINT = "checkpoint", "checkpoint directory"
        OPENAI = "openai", "OpenAI-compatible endpoint"
        BUILTIN = "builtin", "environment built-in player"

    name = models.CharField(max_length=200)
    kind = models.CharField(max_length=20, choices=Kind.choices)
    location = models.CharField(
        max_length=500, help_text="Directory, hub id, served model name or player name."
    )
    base_url = models.CharField(max_length=500, blank=True)
    api_key = models.ForeignKey(
        ApiKey, null=True, blank=True, on_delete=models.SET_NULL, related_name="models"
    )
    generation = models.JSONField(default=dict, blank=True)
    checkpoint = models.OneToOneField(
        "Checkpoint", null=True, blank=True, on_delete=models.CASCADE, related_name="model_entry"
    )
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE)
    created = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-created"]
        verbose_name = "model"
        constraints = [models.UniqueConstraint(fields=["owner", "name"], name="unique_model_name")]

    def __str__(self) -> str:
        return self.name

    def policy_args(self) -> dict:
        """The `model`, `base_url` and `api_key_env` fields of an rlcore config."""
        tiny = self.kind == self.Kind.TINY
        args: dict = {"model": (self.location or "tiny") if tiny else self.location}
        if self.kind == self.Kind.OPENAI:
            args["base_url"] = self.base_url
            # No declared key: none is sent (the client sends the placeholder "EMPTY").
            args["api_key_env"] = self.api_key.env_var if self.api_key else ""
        return args

    @property
    def is_local(self) -> bool:
        """Whether it runs as torch weights on the worker (and can be trained)."""
        return self.kind in (self.Kind.TINY, self.Kind.HF, self.Kind.CHECKPOINT)


class Job(models.Model):
    """One eval, synth, SFT or RL run, or a verifier audit or held-out delta, executed by
    a Celery worker."""

    class Kind(models.TextChoices):
        EVAL = "eval", "eval"
        SYNTH = "synth", "synth"
        SFT = "sft", "sft"
        RL = "rl", "rl"
        AUDIT = "audit", "audit"
        DELTA = "delta", "delta"

    class Status(models.TextChoices):
        QUEUED = "queued", "queued"
        RUNNING = "running", "running"
        SUCCEEDED = "succeeded", "succeeded"
        FAILED = "failed", "failed"
        CANCELLED = "cancelled", "cancelled"
        LOST = "lost", "lost"

    ACTIVE = (Status.QUEUED, Status.RUNNING)
    TERMINAL = (Status.SUCCEEDED, Status.FAILED, Status.CANCELLED, Status.LOST)

    kind = models.CharField(max_length=10, choices=Kind.choices)
    status = models.CharField(max_length=12, choices=Status.choices, default=Status.QUEUED)
    config = models.JSONField(default=dict)
    env_config = models.ForeignKey(
        EnvironmentConfig, null=True, blank=True, on_delete=models.SET_NULL, related_name="jobs"
    )
    model = models.ForeignKey(
        ModelEntry, null=True, blank=True, on_delete=models.SET_NULL, related_name="jobs"
    )
    parent_checkpoint = models.ForeignKey(
        "Checkpoint", null=True, blank=True, on_delete=models.SET_NULL, related_name="child_jobs"
    )
    retry_of = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.SET_NULL, related_name="retries"
    )
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE)
    worker = models.CharField(max_length=200, blank=True)
    queue = models.CharField(max_length=20, default="cpu")
    celery_task_id = models.CharField(max_length=100, blank=True)
    progress_done = models.IntegerField(default=0)
    progress_total = models.IntegerField(default=0)
    progress_desc = models.CharField(max_length=200, blank=True)
    error = models.TextField(blank=True)
    summary = models.JSONField(null=True, blank=True)
    result = models.JSONField(null=True, blank=True)
    cancel_requested = models.BooleanField(default=False)
    attempt = models.IntegerField(
        default=1, help_text="1 for the first run; each requeue starts the next attempt."
    )
    last_step = models.IntegerField(null=True, blank=True)
    created = models.DateTimeField(default=timezone.now)
    started = models.DateTimeField(null=True, blank=True)
    finished = models.DateTimeField(null=True, blank=True)
    heartbeat = models.DateTimeField(
        null=True, blank=True, help_text="Last time the worker reported anything."
    )
    gpus = models.PositiveSmallIntegerField(default=0, help_text="GPUs the job asked for.")
    gpu_memory_gib = models.FloatField(
        default=0.0, help_text="The memory each of its GPUs must have, in GiB (0: any)."
    )
    engine = models.CharField(
        max_length=10, default="local", help_text="The inference engine the job asked for."
    )
    engine_used = models.CharField(
        max_length=10, blank=True, help_text="The inference engine that ran it."
    )

    class Meta:
        ordering = ["-created"]
        indexes = [models.Index(fields=["owner", "-created"]), models.Index(fields=["status"])]

    def __str__(self) -> str:
        return f"#{self.pk} {self.kind} {self.title}"

    @property
    def title(self) -> str:
        """Env and model, and where the job came from: "tictactoe · tiny · attempt 2 ·
        retry of #4" (attempts and retries otherwise share one title)."""
        env = self.config.get("env") or (self.env_config.env_name if self.env_config else "")
        model = self.model.name if self.model else self.config.get("model", "")
        attempt = f"attempt {self.attempt}" if self.attempt > 1 else ""
        retry = f"retry of #{self.retry_of_id}" if self.retry_of_id else ""
        return " · ".join(part for part in (env, model, attempt, retry) if part)

    def current_checkpoints(self):
        """The checkpoints of this attempt (a requeued job's earlier ones stay archived)."""
        return self.checkpoints.filter(attempt=self.attempt)

    @property
    def stored_share(self) -> str:
        """How many of the rollouts the job played it keeps for the inspector."""
        if self.kind != self.Kind.RL:
            return "every rollout"
        batch = int(self.config.get("batch_size") or 0)
        kept = min(int(self.config.get("log_rollouts", batch) or 0), batch)
        if kept >= batch:
            return f"every rollout ({batch} a step)"
        return f"{kept} of the {batch} rollouts of each step (log_rollouts)"

    @property
    def group_name(self) -> str:
        """The Channels group its live updates go to."""
        return f"job-{self.pk}"

    def get_absolute_url(self) -> str:
        return reverse("jobs:job_detail", args=[self.pk])

    @property
    def is_active(self) -> bool:
        return self.status in self.ACTIVE

    @property
    def can_cancel(self) -> bool:
        return self.is_active and not self.cancel_requested

    @property
    def duration(self):
        """Wall time from start to end (or to now while running); None before it starts."""
        if self.started is None:
            return None
        return (self.finished or timezone.now()) - self.started

    @property
    def duration_text(self) -> str:
        """The duration as h:mm:ss (or m:ss), "–" before the job starts."""
        if self.duration is None:
            return "–"
        seconds = int(self.duration.total_seconds())
        hours, rest = divmod(seconds, 3600)
        minutes, seconds = divmod(rest, 60)
        return f"{hours}:{minutes:02d}:{seconds:02d}" if hours else f"{minutes}:{seconds:02d}"

    @property
    def progress_fraction(self) -> float:
        if not self.progress_total:
            return 1.0 if self.status == self.Status.SUCCEEDED else 0.0
        return min(1.0, self.progress_done / self.progress_total)

    def needs_dict(self) -> dict:
        """What the job asked to run on: GPUs, their memory, the inference engine."""
        return {"gpus": self.gpus, "gpu_memory_gib": self.gpu_memory_gib, "engine": self.engine}

    @property
    def needs_text(self) -> str:
        """ "CPU", "1 GPU", "2 GPUs of at least 40 GiB"."""
        if not self.gpus:
            return "CPU"
        text = f"{self.gpus} GPU{'s' if self.gpus > 1 else ''}"
        return text + (f" of at least {self.gpu_memory_gib:g} GiB" if self.gpu_memory_gib else "")

    def progress_dict(self) -> dict:
        return {
            "done": self.progress_done,
            "total": self.progress_total,
            "desc": self.progress_desc,
        }

    def to_dict(self) -> dict:
        duration = self.duration
        return {
            "id": self.pk,
            "kind": self.kind,
            "status": self.status,
            "title": self.title,
            "owner": self.owner.get_username(),
            "env_config": self.env_config_id,
            "model": self.model_id,
            "parent_checkpoint": self.parent_checkpoint_id,
            "retry_of": self.retry_of_id,
            "attempt": self.attempt,
            "worker": self.worker,
            "queue": self.queue,
            "needs": self.needs_dict(),
            "engine_used": self.engine_used,
            "progress": self.progress_dict(),
            "last_step": self.last_step,
            "cancel_requested": self.cancel_requested,
            "error": self.error,
            "summary": self.summary,
            "result": self.result,
            "config": self.config,
            "created": self.created.isoformat(),
            "started": self.started.isoformat() if self.started else None,
            "finished": self.finished.isoformat() if self.finished else None,
            "duration_s": duration.total_seconds() if duration is not None else None,
            "url": self.get_absolute_url(),
        }


def checkpoint_model_name(job_id: int, attempt: int, path: str) -> str:
    """The model entry name of a job's checkpoint: job-4/final, job-4.2/step_000010 for
    the second attempt."""
    prefix = f"job-{job_id}" if attempt == 1 else f"job-{job_id}.{attempt}"
    return f"{prefix}/{Path(path).name}"


class Checkpoint(models.Model):
    """A model saved by a training job; a ModelEntry of kind checkpoint points at it."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="checkpoints")
    attempt = models.IntegerField(default=1, help_text="The job attempt that wrote it.")
    step = models.IntegerField()
    path = models.CharField(max_length=500)
    created = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["job", "step"]

    def __str__(self) -> str:
        return f"job {self.job_id} step {self.step}"


class Metric(models.Model):
    """One value of one named series (`reward/mean`, `loss/kl`, ...) at one step."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="metrics")
    step = models.IntegerField()
    name = models.CharField(max_length=200)
    value = models.FloatField()
    created = models.DateTimeField(default=timezone.now)

    class Meta:
        indexes = [
            models.Index(fields=["job", "step"]),
            models.Index(fields=["job", "name", "step"]),
        ]


class Rollout(models.Model):
    """One episode as rlcore reported it, with columns pulled out for filtering.

    What is particular to one environment (tic-tac-toe's invalid moves and opponent
    strength, say) is in `facts`, the values of the facts the env declares
    (`Environment.facts`), so a new environment needs no new column. On PostgreSQL a GIN
    index (migration 0003) serves equality filters on them.
    """

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="rollouts")
    step = models.IntegerField()
    example_id = models.IntegerField()
    group = models.IntegerField(default=0)
    seed = models.BigIntegerField(default=0)
    messages = models.JSONField(default=list)
    prompt_len = models.IntegerField(default=0)
    rewards = models.JSONField(default=dict)
    reward = models.FloatField(default=0.0)
    state = models.JSONField(default=dict)
    info = models.JSONField(default=dict)
    outcome = models.CharField(max_length=50, blank=True)
    prompt_tokens = models.IntegerField(default=0)
    completion_tokens = models.IntegerField(default=0)
    truncated = models.BooleanField(default=False)
    num_turns = models.IntegerField(default=0)
    facts = models.JSONField(default=dict, blank=True)
    error = models.TextField(blank=True)
    seconds = models.FloatField(default=0.0)
    created = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["step", "id"]
        indexes = [
            models.Index(fields=["job", "step"]),
            models.Index(fields=["job", "example_id"]),
        ]

    def __str__(self) -> str:
        return f"rollout {self.pk} (job {self.job_id}, step {self.step})"

    def get_absolute_url(self) -> str:
        return reverse("jobs:rollout_detail", args=[self.job_id, self.pk])

    @property
    def completion(self) -> list[dict]:
        return self.messages[self.prompt_len :]

    def to_summary(self) -> dict:
        """The compact form the live feed and the table use."""
        return {
            "id": self.pk,
            "step": self.step,
            "example_id": self.example_id,
            "group": self.group,
            "outcome": self.outcome,
            "reward": self.reward,
            "rewards": self.rewards,
            "completion_tokens": self.completion_tokens,
            "num_turns": self.num_turns,
            "facts": self.facts,
            "truncated": self.truncated,
            "error": bool(self.error),
            "url": self.get_absolute_url(),
        }

    def to_dict(self) -> dict:
        """The full row; the same shape as one line of rlcore's results.jsonl, plus ids."""
        return {
            "id": self.pk,
            "job": self.job_id,
            "step": self.step,
            "example_id": self.example_id,
            "seed": self.seed,
            "group": self.group,
            "messages": self.messages,
            "prompt_len": self.prompt_len,
            "rewards": self.rewards,
            "reward": self.reward,
            "state": self.state,
            "outcome": self.outcome or None,
            "tokens": {"prompt": self.prompt_tokens, "completion": self.completion_tokens},
            "num_turns": self.num_turns,
            "truncated": self.truncated,
            "error": self.error or None,
            "info": self.info,
            "facts": self.facts,
            "seconds": self.seconds,
        }


class RolloutFlag(models.Model):
    """A person's word that a rollout was scored wrongly (a false negative of the
    verifier, or a reward it should not have earned), with an optional short reason; one
    per person and rollout. Counted per environment config and exported for whoever
    fixes the verifier."""

    rollout = models.ForeignKey(Rollout, on_delete=models.CASCADE, related_name="flags")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE)
    reason = models.CharField(max_length=200, blank=True)
    created = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-created"]
        constraints = [
            models.UniqueConstraint(fields=["rollout", "user"], name="one_flag_per_user")
        ]

    def __str__(self) -> str:
        return f"flag on rollout {self.rollout_id} by {self.user_id}"

    def to_dict(self) -> dict:
        """The flagged rollout as an export row: where it came from, what was asked, what
        the model replied, what it earned, and why it was flagged."""
        rollout = self.rollout
        return {
            "flag": self.pk,
            "job": rollout.job_id,
            "rollout": rollout.pk,
            "env": rollout.job.config.get("env", ""),
            "step": rollout.step,
            "example_id": rollout.example_id,
            "prompt": message_text(rollout.messages[: rollout.prompt_len]),
            "reply": message_text(rollout.completion),
            "reward": rollout.reward,
            "rewards": rollout.rewards,
            "outcome": rollout.outcome,
            "reason": self.reason,
            "flagged_by": self.user.get_username(),
            "flagged": self.created.isoformat(),
        }


def message_text(messages: list) -> str:
    """Messages as plain text, one "role: content" block each."""
    return "\n\n".join(
        f"{m.get('role', '?')}: {m.get('content') or ''}" for m in messages if isinstance(m, dict)
    )


class LogLine(models.Model):
    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="log_lines")
    created = models.DateTimeField(default=timezone.now)
    level = models.CharField(max_length=10, default="info")
    message = models.TextField()

    class Meta:
        ordering = ["id"]
        indexes = [models.Index(fields=["job", "id"])]

    def to_dict(self) -> dict:
        return {
            "id": self.pk,
            "created": self.created.isoformat(),
            "level": self.level,
            "message": self.message,
        }


class WorkerNode(models.Model):
    """A Celery worker as it announced itself: where it runs, which queues it serves, its
    GPUs and software, and when it was last heard from.

    A worker announces itself when it is ready and heartbeats from its watchdog thread
    (workers/nodes.py); one that stops cleanly says so. A node silent for
    NODE_LOST_SECONDS is gone: the watchdogs of the others mark it, and so does the Nodes
    page when it loads. `name` is the Celery node name (`jobs@host`), the same name a
    job's `worker` field holds.
    """

    class Status(models.TextChoices):
        LIVE = "live", "live"
        STOPPED = "stopped", "stopped"
        GONE = "gone", "gone"

    name = models.CharField(max_length=200, unique=True)
    host = models.CharField(max_length=200)
    queues = models.JSONField(default=list)
    concurrency = models.IntegerField(default=0)
    gpus = models.JSONField(
        default=list, blank=True, help_text="[{index, name, total_gib, free_gib}] per GPU."
    )
    versions = models.JSONField(default=dict, blank=True)
    engines = models.JSONField(default=list, blank=True, help_text="Inference engines it can run.")
    checkpoint_root = models.CharField(max_length=500, blank=True)
    pid = models.IntegerField(null=True, blank=True)
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.LIVE)
    started = models.DateTimeField(default=timezone.now)
    last_seen = models.DateTimeField(default=timezone.now)
    ended = models.DateTimeField(
        null=True, blank=True, help_text="When it stopped or was marked gone."
    )

    class Meta:
        ordering = ["status", "name"]

    def __str__(self) -> str:
        return self.name

    @property
    def silent_seconds(self) -> float:
        return (timezone.now() - self.last_seen).total_seconds()

    @property
    def is_live(self) -> bool:
        """Live and heard from within NODE_LOST_SECONDS."""
        return self.status == self.Status.LIVE and self.silent_seconds < settings.NODE_LOST_SECONDS

    def gpu_queues(self) -> list[str]:
        return [queue for queue in self.queues if queue.startswith("gpu")]

    def cannot_serve(self, *, gpus: int, gpu_memory_gib: float) -> str | None:
        """Why this node cannot run a job needing `gpus` GPUs of at least `gpu_memory_gib`
        GiB each (None when it can). Cards count by their size, not their free memory:
        what is free changes with every job."""
        if gpus == 0:
            return None if "cpu" in self.queues else "serves no cpu queue"
        if not self.gpu_queues():
            return f"serves no gpu queue (queues {', '.join(self.queues) or 'none'})"
        big_enough = [gpu for gpu in self.gpus if gpu.get("total_gib", 0) >= gpu_memory_gib]
        if len(big_enough) < gpus:
            cards = ", ".join(f"{g['name']} {g['total_gib']:.0f} GiB" for g in self.gpus)
            return f"has {len(big_enough)} such GPU(s) ({cards or 'no GPU'})"
        return None

    def running_jobs(self):
        return Job.objects.filter(worker=self.name, status=Job.Status.RUNNING)

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "host": self.host,
            "status": self.status,
            "live": self.is_live,
            "queues": self.queues,
            "concurrency": self.concurrency,
            "gpus": self.gpus,
            "versions": self.versions,
            "engines": self.engines,
            "checkpoint_root": self.checkpoint_root,
            "started": self.started.isoformat(),
            "last_seen": self.last_seen.isoformat(),
            "ended": self.ended.isoformat() if self.ended else None,
            "running_jobs": list(self.running_jobs().values_list("pk", flat=True)),
        }
