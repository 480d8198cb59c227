"""The admin: jobs with status/kind/owner/worker filters, a duration column and the
cancel, retry and requeue actions (the same services the pages use); worker nodes with
what each runs now; the rest browsable, rollouts and log lines read-only."""

from django.contrib import admin, messages
from django.core.exceptions import ValidationError

from webapp.jobs import services
from webapp.jobs.models import (
    ApiKey,
    Checkpoint,
    EnvironmentConfig,
    Job,
    LogLine,
    Metric,
    ModelEntry,
    Rollout,
    WorkerNode,
)
from webapp.jobs.nodes import nodes_mark_gone


@admin.register(Job)
class JobAdmin(admin.ModelAdmin):
    list_display = (
        "id",
        "kind",
        "status",
        "owner",
        "worker",
        "queue",
        "gpus",
        "engine_used",
        "title",
        "created",
        "duration",
    )
    list_filter = ("status", "kind", "owner", "worker", "queue", "engine_used")
    search_fields = ("id", "worker", "error", "celery_task_id")
    readonly_fields = ("created", "started", "finished", "heartbeat", "celery_task_id", "last_step")
    raw_id_fields = ("env_config", "model", "parent_checkpoint")
    actions = ["cancel_jobs", "retry_jobs", "requeue_jobs"]

    @admin.display(description="duration")
    def duration(self, job: Job) -> str:
        return job.duration_text

    def _each(self, request, queryset, action, verb: str) -> None:
        done = 0
        for job in queryset:
            try:
                action(job=job)
                done += 1
            except ValidationError as exc:
                self.message_user(request, f"job #{job.pk}: {exc.messages[0]}", messages.WARNING)
        if done:
            self.message_user(request, f"{verb} {done} job(s).", messages.SUCCESS)

    @admin.action(description="Cancel selected jobs")
    def cancel_jobs(self, request, queryset):
        self._each(request, queryset, services.job_cancel, "Cancelled")

    @admin.action(description="Retry as new jobs (RL resumes from the last checkpoint)")
    def retry_jobs(self, request, queryset):
        self._each(request, queryset, services.job_retry, "Retried")

    @admin.action(description="Requeue (run the same job again from the start)")
    def requeue_jobs(self, request, queryset):
        self._each(request, queryset, services.job_requeue, "Requeued")


@admin.register(Checkpoint)
class CheckpointAdmin(admin.ModelAdmin):
    list_display = ("id", "job", "step", "path", "created")
    list_filter = ("job__owner",)
    raw_id_fields = ("job",)


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    """Staff declare here which worker environment variables hold API keys, and the one
    endpoint each key may be sent to; users then pick a key by name."""

    list_display = ("name", "env_var", "base_url", "description", "created")
    search_fields = ("name", "env_var", "base_url")


@admin.register(ModelEntry)
class ModelEntryAdmin(admin.ModelAdmin):
    list_display = ("name", "kind", "location", "base_url", "api_key", "owner", "created")
    list_filter = ("kind", "owner")
    search_fields = ("name", "location")
    raw_id_fields = ("checkpoint",)


@admin.register(EnvironmentConfig)
class EnvironmentConfigAdmin(admin.ModelAdmin):
    list_display = ("name", "env_name", "owner", "created")
    list_filter = ("env_name", "owner")


class ReadOnlyAdmin(admin.ModelAdmin):
    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False


@admin.register(Rollout)
class RolloutAdmin(ReadOnlyAdmin):
    list_display = (
        "id",
        "job",
        "step",
        "example_id",
        "outcome",
        "reward",
        "completion_tokens",
        "facts",
    )
    list_filter = ("outcome", "truncated")
    search_fields = ("job__id",)
    raw_id_fields = ("job",)


@admin.register(LogLine)
class LogLineAdmin(ReadOnlyAdmin):
    list_display = ("id", "job", "created", "level", "message")
    list_filter = ("level",)
    raw_id_fields = ("job",)


@admin.register(Metric)
class MetricAdmin(ReadOnlyAdmin):
    list_display = ("id", "job", "step", "name", "value", "created")
    search_fields = ("name",)
    raw_id_fields = ("job",)


@admin.register(WorkerNode)
class WorkerNodeAdmin(admin.ModelAdmin):
    """Worker nodes as they announced themselves; a silent one is marked gone when the
    list loads (and by every worker's watchdog)."""

    list_display = (
        "name",
        "status",
        "host",
        "queue_list",
        "gpu_list",
        "running",
        "last_seen",
        "commit",
    )
    list_filter = ("status", "host")
    search_fields = ("name", "host")
    readonly_fields = ("started", "last_seen", "ended", "pid", "versions", "gpus", "engines")

    def changelist_view(self, request, extra_context=None):
        nodes_mark_gone()
        return super().changelist_view(request, extra_context)

    @admin.display(description="queues")
    def queue_list(self, node: WorkerNode) -> str:
        return ", ".join(node.queues)

    @admin.display(description="GPUs")
    def gpu_list(self, node: WorkerNode) -> str:
        return ", ".join(f"{gpu['name']} ({gpu['total_gib']:.0f} GiB)" for gpu in node.gpus) or "–"

    @admin.display(description="running now")
    def running(self, node: WorkerNode) -> str:
        return ", ".join(f"#{pk}" for pk in node.running_jobs().values_list("pk", flat=True)) or "–"

    @admin.display(description="commit")
    def commit(self, node: WorkerNode) -> str:
        return node.versions.get("commit", "")
