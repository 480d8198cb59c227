"""The JSON API, mounted under /api/."""

from django.urls import path

from webapp.jobs import api, views

app_name = "api"

urlpatterns = [
    path("jobs/", api.jobs, name="jobs"),
    path("jobs/<int:pk>/", api.job_detail, name="job_detail"),
    path("jobs/<int:pk>/cancel/", api.job_cancel, name="job_cancel"),
    path("jobs/<int:pk>/metrics/", api.job_metrics, name="job_metrics"),
    path("jobs/<int:pk>/metrics.csv", views.job_metrics_csv, name="job_metrics_csv"),
    path("jobs/<int:pk>/rollouts/", api.job_rollouts, name="job_rollouts"),
    path("jobs/<int:pk>/rollouts/<int:rollout_id>/", api.rollout_detail, name="rollout_detail"),
    path("jobs/<int:pk>/logs/", api.job_logs, name="job_logs"),
    path("jobs/<int:pk>/rollouts/<int:rollout_id>/flag/", api.rollout_flag, name="rollout_flag"),
    path("env-configs/<int:pk>/audit/", api.env_config_audit, name="env_config_audit"),
    path("env-configs/<int:pk>/flags/", api.env_config_flags, name="env_config_flags"),
    path("delta/", api.delta_create, name="delta"),
    path("jobs/<int:pk>/updates/", api.job_updates, name="job_updates"),
]
