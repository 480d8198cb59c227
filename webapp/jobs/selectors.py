"""Reading the lab's data: who may see what, metric series, filtered rollouts.

Every page and API call goes through these, so access control is in one place: a user
sees their own jobs, configs and models; staff see everyone's.
"""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from dataclasses import dataclass, field
from operator import itemgetter

from django.core.cache import cache
from django.db import connection
from django.db.models import Count, Exists, FloatField, Func, OrderBy, OuterRef, QuerySet
from django.db.models.fields.json import KeyTransform
from django.shortcuts import get_object_or_404

from rlcore.envs import Environment, Fact, get_env_class
from webapp.jobs.models import (
    EnvironmentConfig,
    Job,
    LogLine,
    Metric,
    ModelEntry,
    Rollout,
    RolloutFlag,
)

DEFAULT_MAX_POINTS = 2000
# A version of a series never changes (its key does), so this only bounds the memory
# that series nobody asks for again hold.
METRIC_CACHE_SECONDS = 600
VERSION_FIELDS = ("id", "owner", "status", "last_step", "heartbeat")


def jobs_for_user(user) -> QuerySet[Job]:
    jobs = Job.objects.select_related("owner", "model", "env_config")
    return jobs if user.is_staff else jobs.filter(owner=user)


def job_for_user(user, job_id: int) -> Job:
    """The job if `user` may see it; 404 otherwise (whether or not it exists)."""
    return get_object_or_404(jobs_for_user(user), pk=job_id)


def job_version_for_user(user, job_id: int) -> Job:
    """Like job_for_user, loading only what versions the job's stored data (see
    metric_series_version): a third of the cost, for endpoints that answer many viewers."""
    jobs = jobs_for_user(user).select_related(None).only(*VERSION_FIELDS)
    return get_object_or_404(jobs, pk=job_id)


def env_configs_for_user(user) -> QuerySet[EnvironmentConfig]:
    configs = EnvironmentConfig.objects.select_related("owner")
    return configs if user.is_staff else configs.filter(owner=user)


def models_for_user(user) -> QuerySet[ModelEntry]:
    models = ModelEntry.objects.select_related("owner", "checkpoint")
    return models if user.is_staff else models.filter(owner=user)


def synth_datasets_for_user(user) -> list[tuple[str, str]]:
    """(path, label) of datasets written by the user's own finished synth jobs, newest
    first."""
    jobs = Job.objects.filter(owner=user, kind=Job.Kind.SYNTH, status=Job.Status.SUCCEEDED)
    return [
        (job.result["path"], f"job #{job.pk}: {job.result.get('kept', '?')} conversations")
        for job in jobs
        if job.result and job.result.get("path")
    ]


# ---------------------------------------------------------------------------------------
# Metrics


class EpochSeconds(Func):
    """A datetime column as float seconds since the Unix epoch, computed by the database:
    converting thousands of timestamps to aware datetimes in Python costs more than the
    query itself."""

    output_field = FloatField()
    template = "EXTRACT(EPOCH FROM %(expressions)s)::double precision"

    def as_sqlite(self, compiler, connection, **extra_context):
        # Django stores datetimes as UTC text, "YYYY-MM-DD HH:MM:SS[.ffffff]"; SQLite's date
        # functions keep only milliseconds, so whole seconds come from julianday() and the
        # fraction from the text.
        return self.as_sql(
            compiler,
            connection,
            template=(
                "(round((julianday(substr(%(expressions)s, 1, 19)) - 2440587.5) * 86400.0)"
                " + CAST('0' || substr(%(expressions)s, 20) AS REAL))"
            ),
            **extra_context,
        )


def downsample(points: list[tuple], max_points: int) -> list[tuple]:
    """At most about `max_points` points: the series cut into bins, keeping each bin's
    lowest and highest value (in step order), so spikes survive downsampling."""
    if max_points < 2 or len(points) <= max_points:
        return points
    bins = max_points // 2
    size = len(points) / bins
    by_value = itemgetter(1)
    kept = []
    for b in range(bins):
        chunk = points[int(b * size) : int((b + 1) * size)]
        if not chunk:
            continue
        low, high = min(chunk, key=by_value), max(chunk, key=by_value)
        if low == high:
            kept.append(low)
        else:
            kept.extend((low, high) if low[0] <= high[0] else (high, low))
    return kept


def metric_series(
    job: Job,
    *,
    since: int | None = None,
    names: list[str] | None = None,
    max_points: int = DEFAULT_MAX_POINTS,
) -> dict[str, list[dict]]:
    """{name: [{step, value, t}, ...]} for steps after `since`, downsampled per series."""
    rows = Metric.objects.filter(job=job)
    if since is not None:
        rows = rows.filter(step__gt=since)
    if names:
        rows = rows.filter(name__in=names)
    by_name: dict[str, list[tuple]] = defaultdict(list)
    for name, step, value, t in (
        rows.order_by("name", "step", "id")
        .annotate(t=EpochSeconds("created"))
        .values_list("name", "step", "value", "t")
    ):
        by_name[name].append((step, value, t))
    return {
        name: [{"step": s, "value": v, "t": t} for s, v, t in downsample(points, max_points)]
        for name, points in sorted(by_name.items())
    }


def metric_series_version(job: Job, *, since: int | None, names: list[str], max_points: int) -> str:
    """A digest that changes whenever `metric_series` with these arguments could: the
    worker's sink bumps the job's heartbeat (and step cursor) in the same transaction as
    every batch of points it writes, and a requeue that drops the points resets them and
    the status. Serves as the cache key and the ETag."""
    heartbeat = job.heartbeat.timestamp() if job.heartbeat else None
    parts = (job.pk, job.status, job.last_step, heartbeat, since, sorted(names), max_points)
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).hexdigest()


def metric_series_json(
    job: Job,
    *,
    since: int | None = None,
    names: list[str] | None = None,
    max_points: int = DEFAULT_MAX_POINTS,
    version: str | None = None,
) -> bytes:
    """`metric_series` encoded as JSON, from Django's cache when this version of the job's
    series was encoded before. Encoded bytes are what is cached: a finished job's series is
    read by every viewer alike, and decoding and re-encoding thousands of points on each
    hit would cost most of what the cache saves."""
    names = names or []
    version = version or metric_series_version(job, since=since, names=names, max_points=max_points)
    key = f"metric-series:{version}"
    encoded = cache.get(key)
    if encoded is None:
        series = metric_series(job, since=since, names=names, max_points=max_points)
        encoded = json.dumps(series, separators=(",", ":")).encode()
        cache.set(key, encoded, METRIC_CACHE_SECONDS)
    return encoded


def metric_names(jobs) -> list[str]:
    return list(
        Metric.objects.filter(job__in=jobs)
        .values_list("name", flat=True)
        .distinct()
        .order_by("name")
    )


def metric_rows(job: Job) -> QuerySet[Metric]:
    return Metric.objects.filter(job=job).order_by("step", "name", "id")


def logs_after(job: Job, *, after: int | None = None, limit: int = 500) -> list[LogLine]:
    """Log lines with id > `after`; without a cursor, the last `limit` lines."""
    lines = LogLine.objects.filter(job=job)
    if after is not None:
        return list(lines.filter(id__gt=after).order_by("id")[:limit])
    return list(reversed(lines.order_by("-id")[:limit]))


def recent_rollouts(job: Job, *, since: int | None = None, limit: int = 50) -> list[Rollout]:
    rows = Rollout.objects.filter(job=job).defer("messages", "state", "info")
    if since is not None:
        rows = rows.filter(step__gt=since)
    return list(reversed(rows.order_by("-step", "-id")[:limit]))


# ---------------------------------------------------------------------------------------
# Rollouts


def job_env_class(job: Job) -> type[Environment] | None:
    """The class of the environment `job` ran, which declares what the inspector filters
    rollouts on and how it draws them; None for a job without one (SFT) or whose env is
    no longer registered."""
    name = job.config.get("env") or (job.env_config.env_name if job.env_config_id else "")
    try:
        return get_env_class(name) if name else None
    except KeyError:
        return None


def job_facts(job: Job) -> list[Fact]:
    env_class = job_env_class(job)
    return list(env_class.facts) if env_class else []


@dataclass
class FactFilter:
    """One declared fact's filter: a range for a number, equality for text."""

    name: str
    low: float | None = None
    high: float | None = None
    equals: str | None = None


@dataclass
class RolloutFilters:
    """The inspector's filters; every field optional. `sort` is a key of SORTS, or a
    fact's name after FACT_PREFIX (with a leading "-" for descending)."""

    outcome: str = ""
    reward_min: float | None = None
    reward_max: float | None = None
    step: int | None = None
    example_id: int | None = None
    facts: list[FactFilter] = field(default_factory=list)
    search: str = ""
    errors_only: bool = False
    flagged_only: bool = False
    sort: str = "step"


SORTS = {
    "step": ("step", "id"),
    "-step": ("-step", "-id"),
    "reward": ("reward", "id"),
    "-reward": ("-reward", "id"),
    "example": ("example_id", "step", "id"),
    "length": ("completion_tokens", "id"),
    "-length": ("-completion_tokens", "id"),
}
# A fact's filter and sort names in URLs start with this: `fact_<name>_min`, `sort=fact_<name>`.
FACT_PREFIX = "fact_"


def _fact_value(name: str) -> KeyTransform:
    # The key as an expression rather than `facts__<name>`, so a fact named like a lookup
    # ("contains", "gte") is still a key.
    return KeyTransform(name, "facts")


def _filter_fact(rows: QuerySet[Rollout], index: int, fact: FactFilter) -> QuerySet[Rollout]:
    if fact.equals is not None:
        if connection.vendor == "postgresql":
            # Containment is what the GIN index on facts serves (migration 0003).
            return rows.filter(facts__contains={fact.name: fact.equals})
        alias = f"fact_{index}"
        return rows.alias(**{alias: _fact_value(fact.name)}).filter(**{alias: fact.equals})
    alias = f"fact_{index}"
    rows = rows.alias(**{alias: _fact_value(fact.name)})
    if fact.low is not None:
        rows = rows.filter(**{f"{alias}__gte": fact.low})
    if fact.high is not None:
        rows = rows.filter(**{f"{alias}__lte": fact.high})
    return rows


def _ordering(sort: str) -> tuple:
    name = sort.removeprefix("-")
    if name.startswith(FACT_PREFIX):
        # Rollouts without the fact come last either way.
        key = OrderBy(
            _fact_value(name.removeprefix(FACT_PREFIX)),
            descending=sort.startswith("-"),
            nulls_last=True,
        )
        return (key, "id")
    return SORTS.get(sort, SORTS["step"])


def rollouts_filtered(job: Job, filters: RolloutFilters) -> QuerySet[Rollout]:
    rows = Rollout.objects.filter(job=job)
    if filters.outcome:
        rows = rows.filter(outcome=filters.outcome)
    if filters.reward_min is not None:
        rows = rows.filter(reward__gte=filters.reward_min)
    if filters.reward_max is not None:
        rows = rows.filter(reward__lte=filters.reward_max)
    if filters.step is not None:
        rows = rows.filter(step=filters.step)
    if filters.example_id is not None:
        rows = rows.filter(example_id=filters.example_id)
    for index, fact in enumerate(filters.facts):
        rows = _filter_fact(rows, index, fact)
    if filters.search:
        # The messages' JSON as text: finds words in any message, role or tool call.
        rows = rows.filter(messages__icontains=filters.search)
    if filters.errors_only:
        rows = rows.exclude(error="")
    if filters.flagged_only:
        rows = rows.filter(Exists(RolloutFlag.objects.filter(rollout=OuterRef("pk"))))
    return rows.order_by(*_ordering(filters.sort))


def rollout_outcomes(job: Job) -> list[str]:
    return list(
        Rollout.objects.filter(job=job)
        .exclude(outcome="")
        .values_list("outcome", flat=True)
        .distinct()
        .order_by("outcome")
    )


def rollout_reward_names(job: Job, rollouts) -> list[str]:
    names: list[str] = []
    for rollout in rollouts:
        names += [n for n in rollout.rewards if n not in names]
    return names


def rollout_for_job(job: Job, rollout_id: int) -> Rollout:
    return get_object_or_404(Rollout, job=job, pk=rollout_id)


# ---------------------------------------------------------------------------------------
# The verifier checklist


def flags_for_user(user) -> QuerySet[RolloutFlag]:
    """Flags on the rollouts of jobs `user` may see (their own; staff: all), with what an
    export row needs."""
    flags = RolloutFlag.objects.select_related("rollout__job", "user")
    return flags if user.is_staff else flags.filter(rollout__job__owner=user)


def env_config_flags(user, env_config: EnvironmentConfig) -> QuerySet[RolloutFlag]:
    """The flags on rollouts of jobs run on `env_config`."""
    return flags_for_user(user).filter(rollout__job__env_config=env_config)


def flagged_rollouts(flags: QuerySet[RolloutFlag]) -> int:
    """How many rollouts `flags` are on (two people flagging one rollout count once)."""
    return flags.values("rollout").distinct().count()


def job_flag_count(job: Job) -> int:
    return flagged_rollouts(RolloutFlag.objects.filter(rollout__job=job))


def env_configs_with_flags(user) -> QuerySet[EnvironmentConfig]:
    """The user's env configs, each with `flagged`: its jobs' rollouts flagged as wrongly
    scored."""
    return env_configs_for_user(user).annotate(
        flagged=Count("jobs__rollouts__flags__rollout", distinct=True)
    )


def last_audit(user, env_config: EnvironmentConfig) -> Job | None:
    """The newest audit of `env_config` that `user` may see."""
    return jobs_for_user(user).filter(kind=Job.Kind.AUDIT, env_config=env_config).first()


def deltas_for_user(user) -> QuerySet[Job]:
    return jobs_for_user(user).filter(kind=Job.Kind.DELTA)


def job_deltas(job: Job) -> QuerySet[Job]:
    """The held-out deltas run on a checkpoint of `job`, newest first."""
    return Job.objects.filter(kind=Job.Kind.DELTA, parent_checkpoint__job=job).order_by("-created")
