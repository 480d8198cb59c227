"""The JSON API: metrics after a step cursor with min/max downsampling, CSV export,
filtered rollouts, job creation with errors that name the bad field."""

import csv
import io

import pytest

from tests.lab_fixtures import announce_node
from webapp.jobs.models import Job, Metric
from webapp.jobs.selectors import downsample

pytestmark = pytest.mark.django_db


def test_metrics_since_a_step_cursor(alice_client, alice_eval):
    body = alice_client.get(f"/api/jobs/{alice_eval.pk}/metrics/?since=27").json()
    assert body["last_step"] == 30
    assert [p["step"] for p in body["metrics"]["reward/mean"]] == [28, 29, 30]
    assert body["metrics"]["reward/mean"][-1]["value"] == pytest.approx(1.0)
    only = alice_client.get(f"/api/jobs/{alice_eval.pk}/metrics/?since=0&names=loss/kl").json()
    assert list(only["metrics"]) == ["loss/kl"] and len(only["metrics"]["loss/kl"]) == 30


def test_a_bad_cursor_is_a_400_naming_it(alice_client, alice_eval):
    response = alice_client.get(f"/api/jobs/{alice_eval.pk}/metrics/?since=yesterday")
    assert response.status_code == 400
    assert "since" in response.json()["errors"]


def test_long_series_are_downsampled_keeping_each_bins_extremes(alice_client, alice_eval):
    Metric.objects.bulk_create(
        Metric(job=alice_eval, step=s, name="spiky", value=100.0 if s == 517 else 0.0)
        for s in range(1000)
    )
    body = alice_client.get(f"/api/jobs/{alice_eval.pk}/metrics/?names=spiky&max_points=100").json()
    points = body["metrics"]["spiky"]
    assert len(points) <= 100
    assert {
        k: v for k, v in points[[p["step"] for p in points].index(517)].items() if k != "t"
    } == {"step": 517, "value": 100.0}
    assert [p["step"] for p in points] == sorted(p["step"] for p in points)


def test_downsample_keeps_min_and_max_in_step_order():
    points = [(s, v, 0.0) for s, v in enumerate([5, 1, 9, 3, 3, 8, 0, 2])]
    assert downsample(points, 4) == [(1, 1, 0.0), (2, 9, 0.0), (5, 8, 0.0), (6, 0, 0.0)]
    assert downsample(points, 100) == points


def test_metrics_csv_export(alice_client, alice_eval):
    response = alice_client.get(f"/jobs/{alice_eval.pk}/metrics.csv")
    assert response["Content-Type"] == "text/csv"
    rows = list(csv.reader(io.StringIO(b"".join(response.streaming_content).decode())))
    assert rows[0] == ["step", "name", "value", "created"]
    assert len(rows) == 1 + 60
    assert rows[1][:3] == ["1", "loss/kl", "0.01"]


def test_rollouts_are_filtered_and_paged(alice_client, alice_eval):
    url = f"/api/jobs/{alice_eval.pk}/rollouts/"
    everything = alice_client.get(url).json()
    assert everything["count"] == 8
    step_8 = alice_client.get(url, {"step": 8, "page_size": 3}).json()
    assert step_8["count"] == 4 and step_8["num_pages"] == 2 and len(step_8["results"]) == 3
    assert all(r["step"] == 8 for r in step_8["results"])
    by_reward = alice_client.get(url, {"sort": "-reward"}).json()["results"]
    assert [r["reward"] for r in by_reward] == sorted(
        (r["reward"] for r in by_reward), reverse=True
    )
    full = alice_client.get(url, {"full": 1, "page_size": 1}).json()["results"][0]
    assert full["messages"][0]["role"] == "system" and "moves" in full["state"]


def test_rollout_filter_errors_name_the_field(alice_client, alice_eval):
    url = f"/api/jobs/{alice_eval.pk}/rollouts/"
    response = alice_client.get(url, {"fact_random_move_prob_min": "2"})
    assert response.status_code == 400 and "fact_random_move_prob_min" in response.json()["errors"]
    response = alice_client.get(f"/api/jobs/{alice_eval.pk}/rollouts/", {"page": "9"})
    assert response.status_code == 400 and "page" in response.json()["errors"]


def test_updates_bundle_for_a_reconnecting_page(alice_client, alice_eval):
    body = alice_client.get(f"/api/jobs/{alice_eval.pk}/updates/", {"since": 6}).json()
    assert body["job"]["status"] == "succeeded" and body["job"]["last_step"] == 30
    assert min(p["step"] for p in body["metrics"]["reward/mean"]) == 7
    assert {r["step"] for r in body["rollouts"]} == {8}


def test_creating_a_job_over_json(alice_client, alice_eval, django_capture_on_commit_callbacks):
    payload = {"kind": "eval", "env_config": alice_eval.env_config_id, "model": alice_eval.model_id,
               "options": {"num_examples": 3}}  # fmt: skip
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        response = alice_client.post("/api/jobs/", payload, content_type="application/json")
    assert response.status_code == 201, response.content
    job = Job.objects.get(pk=response.json()["id"])
    assert job.config["num_examples"] == 3 and job.status == "queued" and len(callbacks) == 1


def test_an_rl_job_over_json_names_its_recipe(
    alice, alice_client, ttt_config, tiny, django_capture_on_commit_callbacks
):
    body = {"kind": "rl", "env_config": ttt_config.pk, "model": tiny.pk, "recipe": "rl_gpu"}
    # The GPU profile's recipe asks for a GPU unless the job says otherwise.
    response = alice_client.post("/api/jobs/", body, content_type="application/json")
    assert response.status_code == 400 and "1 GPU(s)" in response.json()["errors"]["gpus"][0]
    announce_node("gpu@box", queues=("gpu",), gpus=(80,))
    with django_capture_on_commit_callbacks(execute=False):
        response = alice_client.post("/api/jobs/", body, content_type="application/json")
    assert response.status_code == 201, response.content
    job = Job.objects.get(pk=response.json()["id"])
    assert job.queue == "gpu" and response.json()["needs"]["gpus"] == 1
    assert job.config["batch_size"] == 256 and job.config["env_args"]["self_play"] == 0.5
    on_cpu = {**body, "options": {"gpus": 0}}
    with django_capture_on_commit_callbacks(execute=False):
        response = alice_client.post("/api/jobs/", on_cpu, content_type="application/json")
    assert response.status_code == 201 and Job.objects.get(pk=response.json()["id"]).queue == "cpu"
    default = {**body, "recipe": None}
    with django_capture_on_commit_callbacks(execute=False):
        response = alice_client.post("/api/jobs/", default, content_type="application/json")
    assert Job.objects.get(pk=response.json()["id"]).config["batch_size"] == 64  # rl_sound
    for bad in ("../../etc/passwd", "rl_gpu.toml", 7, ["rl"]):
        response = alice_client.post(
            "/api/jobs/", {**body, "recipe": bad}, content_type="application/json"
        )
        assert response.status_code == 400 and set(response.json()["errors"]) == {"recipe"}, bad


def test_json_job_creation_errors_name_each_bad_field(alice_client, bob_client, alice_eval):
    response = alice_client.post(
        "/api/jobs/",
        {"kind": "dance", "model": 99999, "options": []},
        content_type="application/json",
    )
    assert response.status_code == 400
    assert set(response.json()["errors"]) == {"kind", "model", "options"}
    response = bob_client.post(
        "/api/jobs/",
        {"kind": "eval", "env_config": alice_eval.env_config_id, "model": alice_eval.model_id},
        content_type="application/json",
    )
    assert response.status_code == 400
    assert set(response.json()["errors"]) == {"model", "env_config"}  # not bob's to use
    response = alice_client.post("/api/jobs/", "{not json", content_type="application/json")
    assert response.status_code == 400 and "body" in response.json()["errors"]
    response = alice_client.post(
        "/api/jobs/",
        {"kind": "eval", "env_config": alice_eval.env_config_id, "model": alice_eval.model_id,
         "options": {"num_examples": "many"}},
        content_type="application/json",
    )  # fmt: skip
    assert response.status_code == 400


def test_cancel_over_json(alice_client, alice_eval):
    response = alice_client.post(f"/api/jobs/{alice_eval.pk}/cancel/")
    assert (
        response.status_code == 400
        and "already succeeded" in response.json()["errors"]["status"][0]
    )
    Job.objects.filter(pk=alice_eval.pk).update(status="running")
    response = alice_client.post(f"/api/jobs/{alice_eval.pk}/cancel/")
    assert response.status_code == 200 and response.json()["cancel_requested"] is True
