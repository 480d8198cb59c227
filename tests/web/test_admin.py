"""The admin's job list (filters, duration) and its cancel, retry and requeue actions;
ensure_admin for `make run`."""

from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.utils import timezone

from tests.lab_fixtures import client_for
from webapp.jobs.models import Checkpoint, Job, Metric

pytestmark = pytest.mark.django_db


@pytest.fixture
def admin_client(django_user_model):
    return client_for(django_user_model.objects.create_superuser("root", password="pw"))


def run_action(client, action, jobs):
    return client.post(
        "/admin/jobs/job/",
        {"action": action, "_selected_action": [j.pk for j in jobs]},
        follow=True,
    )


def test_the_job_list_filters_and_shows_duration(admin_client, alice_eval):
    now = timezone.now()
    Job.objects.filter(pk=alice_eval.pk).update(
        started=now - timedelta(seconds=75), finished=now, worker="w1@host"
    )
    html = admin_client.get("/admin/jobs/job/?status__exact=succeeded").content.decode()
    assert "1:15" in html and "w1@host" in html
    assert "?worker=w1%40host" in html or "worker=w1" in html  # the worker filter
    assert "No jobs" not in html
    assert "0 jobs" in admin_client.get("/admin/jobs/job/?status__exact=failed").content.decode()


def test_cancel_action(admin_client, alice_eval):
    Job.objects.filter(pk=alice_eval.pk).update(status="queued")
    run_action(admin_client, "cancel_jobs", [alice_eval])
    alice_eval.refresh_from_db()
    assert alice_eval.status == "cancelled"


def test_retry_resumes_rl_from_the_last_checkpoint(
    admin_client, alice, ttt_config, tiny, django_capture_on_commit_callbacks
):
    failed = Job.objects.create(owner=alice, kind="rl", status="failed", model=tiny, env_config=ttt_config,
                                config={"model": "tiny", "output_dir": "/tmp/x", "max_steps": 10})  # fmt: skip
    Checkpoint.objects.create(job=failed, step=2, path="/runs/job-x/step_000002")
    Checkpoint.objects.create(job=failed, step=4, path="/runs/job-x/step_000004")
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        run_action(admin_client, "retry_jobs", [failed])
    retry = Job.objects.exclude(pk=failed.pk).get()
    assert retry.status == "queued" and len(callbacks) == 1
    assert retry.config["resume_from"] == "/runs/job-x/step_000004"
    assert retry.parent_checkpoint.step == 4
    assert retry.config["output_dir"].endswith(f"job-{retry.pk}")


def test_requeue_runs_the_same_job_again_from_scratch(
    admin_client, alice_eval, django_capture_on_commit_callbacks
):
    old_task = alice_eval.celery_task_id
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        run_action(admin_client, "requeue_jobs", [alice_eval])
    alice_eval.refresh_from_db()
    assert alice_eval.status == "queued" and alice_eval.celery_task_id != old_task
    assert not Metric.objects.filter(job=alice_eval).exists() and len(callbacks) == 1


def test_rollouts_are_read_only_in_the_admin(admin_client, alice_eval):
    rollout = alice_eval.rollouts.first()
    assert admin_client.get(f"/admin/jobs/rollout/{rollout.pk}/change/").status_code == 200
    admin_client.post(f"/admin/jobs/rollout/{rollout.pk}/change/", {"reward": "99"})
    rollout.refresh_from_db()
    assert rollout.reward != 99
    assert admin_client.get("/admin/jobs/rollout/add/").status_code == 403


def test_a_running_job_whose_worker_is_gone_is_lost_when_its_page_loads(
    alice_client, alice_eval, settings
):
    stale = timezone.now() - timedelta(seconds=settings.WORKER_LOST_SECONDS + 5)
    Job.objects.filter(pk=alice_eval.pk).update(
        status="running", worker="ghost@nowhere", heartbeat=stale
    )
    html = alice_client.get(f"/jobs/{alice_eval.pk}/").content.decode()
    alice_eval.refresh_from_db()
    assert alice_eval.status == "lost" and "ghost@nowhere stopped answering" in alice_eval.error
    assert 'data-status="lost"' in html


def test_a_running_job_with_a_fresh_heartbeat_is_left_alone(alice_client, alice_eval):
    Job.objects.filter(pk=alice_eval.pk).update(
        status="running", worker="ghost@nowhere", heartbeat=timezone.now()
    )
    alice_client.get(f"/jobs/{alice_eval.pk}/")
    alice_eval.refresh_from_db()
    assert alice_eval.status == "running"


def test_ensure_admin_creates_the_admin_once(monkeypatch, capsys):
    monkeypatch.delenv("RLLAB_ADMIN_PASSWORD", raising=False)
    call_command("ensure_admin")
    password = capsys.readouterr().out.strip().rsplit(" ", 1)[-1]
    admin = get_user_model().objects.get(username="admin")
    assert admin.is_superuser and admin.check_password(password)
    call_command("ensure_admin")
    assert "left unchanged" in capsys.readouterr().out
    monkeypatch.setenv("RLLAB_ADMIN_PASSWORD", "from-the-env")
    call_command("ensure_admin")
    admin.refresh_from_db()
    assert admin.check_password("from-the-env")
