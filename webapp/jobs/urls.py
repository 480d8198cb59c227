"""The lab's pages."""

from django.urls import path

from webapp.jobs import views

app_name = "jobs"

urlpatterns = [
    path("", views.home, name="home"),
    path("envs/", views.env_list, name="env_list"),
    path("envs/<str:env_name>/new/", views.env_config_create, name="env_config_create"),
    path("envs/<str:env_name>/preview/", views.env_preview, name="env_preview"),
    path("envs/configs/<int:pk>/", views.env_config_edit, name="env_config_edit"),
    path("envs/configs/<int:pk>/delete/", views.env_config_delete, name="env_config_delete"),
    path("envs/configs/<int:pk>/audit/", views.env_config_audit, name="env_config_audit"),
    path(
        "envs/configs/<int:pk>/flags.<str:fmt>",
        views.env_config_flags,
        name="env_config_flags",
    ),
    path("models/", views.model_list, name="model_list"),
    path("models/<int:pk>/delete/", views.model_delete, name="model_delete"),
    path("jobs/", views.job_list, name="job_list"),
    path("jobs/new/", views.job_create, name="job_create"),
    path("jobs/<int:pk>/", views.job_detail, name="job_detail"),
    path("jobs/<int:pk>/cancel/", views.job_cancel, name="job_cancel"),
    path("jobs/<int:pk>/metrics.csv", views.job_metrics_csv, name="job_metrics_csv"),
    path("jobs/<int:pk>/rollouts/", views.rollout_list, name="rollout_list"),
    path("jobs/<int:pk>/rollouts.jsonl", views.rollouts_jsonl, name="rollouts_jsonl"),
    path("jobs/<int:pk>/rollouts/compare/", views.rollout_compare, name="rollout_compare"),
    path("jobs/<int:pk>/rollouts/<int:rollout_id>/", views.rollout_detail, name="rollout_detail"),
    path(
        "jobs/<int:pk>/rollouts/<int:rollout_id>/image", views.rollout_image, name="rollout_image"
    ),
    path("jobs/<int:pk>/rollouts/<int:rollout_id>/flag/", views.rollout_flag, name="rollout_flag"),
    path("jobs/<int:pk>/report.json", views.job_report_json, name="job_report_json"),
    path("delta/", views.delta_page, name="delta"),
    path("delta/<int:pk>/", views.delta_detail, name="delta_detail"),
    path("compare/", views.compare, name="compare"),
    path("nodes/", views.node_list, name="node_list"),
]
