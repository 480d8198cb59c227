"""Bob never sees or touches alice's jobs; staff see everyone's; anonymous users log in."""

import pytest

from webapp.jobs.models import Job

pytestmark = pytest.mark.django_db


def job_urls(job):
    rollout = job.rollouts.first()
    return [
        f"/jobs/{job.pk}/",
        f"/jobs/{job.pk}/rollouts/",
        f"/jobs/{job.pk}/rollouts/{rollout.pk}/",
        f"/jobs/{job.pk}/rollouts.jsonl",
        f"/jobs/{job.pk}/metrics.csv",
        f"/api/jobs/{job.pk}/",
        f"/api/jobs/{job.pk}/metrics/",
        f"/api/jobs/{job.pk}/rollouts/",
        f"/api/jobs/{job.pk}/rollouts/{rollout.pk}/",
        f"/api/jobs/{job.pk}/logs/",
        f"/api/jobs/{job.pk}/updates/",
        f"/api/jobs/{job.pk}/metrics.csv",
    ]


def test_owner_sees_every_page_of_the_job(alice_client, alice_eval):
    for url in job_urls(alice_eval):
        assert alice_client.get(url).status_code == 200, url


def test_bob_gets_404_for_every_page_of_alices_job(bob_client, alice_eval):
    for url in job_urls(alice_eval):
        assert bob_client.get(url).status_code == 404, url


def test_bob_cannot_cancel_alices_job(bob_client, alice_eval):
    Job.objects.filter(pk=alice_eval.pk).update(status="running")
    assert bob_client.post(f"/jobs/{alice_eval.pk}/cancel/").status_code == 404
    assert bob_client.post(f"/api/jobs/{alice_eval.pk}/cancel/").status_code == 404
    alice_eval.refresh_from_db()
    assert alice_eval.status == "running" and not alice_eval.cancel_requested


def test_bob_does_not_see_alices_job_in_lists(bob_client, alice_eval):
    assert f'data-job-id="{alice_eval.pk}"' not in bob_client.get("/jobs/").content.decode()
    assert bob_client.get("/api/jobs/").json()["jobs"] == []
    assert f"#{alice_eval.pk} " not in bob_client.get("/compare/").content.decode()


def test_bob_cannot_edit_alices_env_config_or_delete_her_models(bob_client, alice_eval):
    assert bob_client.get(f"/envs/configs/{alice_eval.env_config_id}/").status_code == 404
    assert bob_client.post(f"/models/{alice_eval.model_id}/delete/").status_code == 404
    assert (
        f'data-model-id="{alice_eval.model_id}"' not in bob_client.get("/models/").content.decode()
    )


def test_staff_see_everyones_jobs(carol, alice_eval):
    from tests.lab_fixtures import client_for

    client = client_for(carol)
    assert client.get(f"/jobs/{alice_eval.pk}/").status_code == 200
    assert [j["id"] for j in client.get("/api/jobs/").json()["jobs"]] == [alice_eval.pk]


def test_anonymous_users_are_sent_to_login_and_the_api_says_401(client, alice_eval):
    response = client.get(f"/jobs/{alice_eval.pk}/")
    assert response.status_code == 302 and response["Location"].startswith("/accounts/login/")
    response = client.get(f"/api/jobs/{alice_eval.pk}/")
    assert response.status_code == 401 and "log in" in response.json()["error"]


def test_login_and_logout_work(client, alice):
    response = client.post("/accounts/login/", {"username": "alice", "password": "alice-password"})
    assert response.status_code == 302
    assert client.get("/jobs/").status_code == 200
    client.post("/accounts/logout/")
    assert client.get("/jobs/").status_code == 302
