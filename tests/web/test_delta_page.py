"""The held-out delta page: a person picks a trained checkpoint and its starting model,
the real worker runs rlcore's held-out delta on the tiny models, and the page shows each
metric's difference with its 95% interval and whether training helped; the training job's
page then warns when its train reward rose and the held-out reward did not."""

import json

import pytest

from tests.lab_fixtures import wait_for_job
from webapp.jobs import services
from webapp.jobs.models import Checkpoint, Job, Metric, ModelEntry

pytestmark = [pytest.mark.django_db(transaction=True)]


@pytest.fixture
def reverse_config(alice):
    return services.env_config_save(
        owner=alice, name="rev", env_name="reverse_text", params={"min_chars": 4, "max_chars": 8}
    )


@pytest.fixture
def rl_job(alice, tiny, reverse_config, tiny_model):
    """A finished RL job of alice's that started from the tiny model, its train reward
    rising over 8 steps, and its final checkpoint (another tiny model) registered as the
    worker registers one."""
    job = Job.objects.create(
        owner=alice, kind="rl", status="succeeded", config={"env": "reverse_text"},
        env_config=reverse_config, model=tiny, last_step=8,
    )  # fmt: skip
    Metric.objects.bulk_create(
        Metric(job=job, step=step, name="reward/mean", value=step / 10) for step in range(1, 9)
    )
    checkpoint = Checkpoint.objects.create(job=job, step=8, path=tiny_model)
    ModelEntry.objects.create(
        owner=alice, name=f"job-{job.pk}/final", kind="checkpoint", location=tiny_model,
        checkpoint=checkpoint,
    )  # fmt: skip
    return job


def delta_form(job, **changes) -> dict:
    trained = ModelEntry.objects.get(checkpoint__job=job)
    form = {
        "env_config": job.env_config_id, "trained": trained.pk, "base": job.model_id,
        "num_examples": 3, "rollouts_per_example": 1, "seed": 1000003, "max_tokens": 8,
        "temperature": 0.0,
    }  # fmt: skip
    return form | changes


def test_the_delta_form_starts_from_a_training_job(alice_client, rl_job):
    form = alice_client.get(f"/delta/?job={rl_job.pk}").context["form"]
    trained = ModelEntry.objects.get(checkpoint__job=rl_job)
    assert form.initial == {
        "trained": trained.pk,
        "base": rl_job.model_id,
        "env_config": rl_job.env_config_id,
    }
    job_page = alice_client.get(rl_job.get_absolute_url()).content.decode()
    assert f'href="/delta/?job={rl_job.pk}"' in job_page
    assert 'id="held-out-none"' in job_page and "the train reward rose" in job_page


@pytest.mark.worker
def test_a_delta_runs_on_the_worker_and_the_rl_job_page_reads_it(
    alice_client, rl_job, celery_worker
):
    queued = alice_client.post("/delta/", delta_form(rl_job))
    assert queued.status_code == 302
    job = wait_for_job(Job.objects.get(kind="delta"))
    assert job.status == "succeeded", job.error
    assert queued["Location"] == f"/delta/{job.pk}/"
    assert job.progress_done == job.progress_total == 6  # 3 examples, 2 models
    delta = job.result["delta"]
    reward = delta["metrics"][0]
    assert reward["name"] == "reward" and delta["num_examples"] == 3
    assert reward["low"] <= reward["delta"] <= reward["high"]

    page = alice_client.get(f"/delta/{job.pk}/").content.decode()
    assert 'id="delta-verdict"' in page and "Did training help?" in page
    assert all(f'data-metric="{m["name"]}"' in page for m in delta["metrics"])
    download = alice_client.get(f"/jobs/{job.pk}/report.json")
    assert json.loads(download.content) == delta
    listed = alice_client.get("/delta/").content.decode()
    assert f'href="/delta/{job.pk}/"' in listed

    # The training job's page reads the delta: a warning unless held-out rose too.
    job_page = alice_client.get(rl_job.get_absolute_url()).content.decode()
    assert f'href="/delta/{job.pk}/"' in job_page
    assert ('id="held-out-warning"' in job_page) == (reward["verdict"] != "higher")


def test_the_rl_job_page_warns_only_when_train_rose_and_held_out_did_not(
    alice, alice_client, rl_job
):
    def finished_delta(verdict: str) -> Job:
        metric = {"name": "reward", "base": 0.2, "trained": 0.2, "delta": 0.0, "low": -0.1,
                  "high": 0.1, "verdict": verdict}  # fmt: skip
        return Job.objects.create(
            owner=alice, kind="delta", status="succeeded", config={},
            parent_checkpoint=rl_job.checkpoints.get(), model=rl_job.model,
            result={"delta": {"metrics": [metric], "num_examples": 3}},
        )  # fmt: skip

    finished_delta("no clear difference")
    assert 'id="held-out-warning"' in alice_client.get(rl_job.get_absolute_url()).content.decode()
    finished_delta("higher")  # the newest delta decides
    page = alice_client.get(rl_job.get_absolute_url()).content.decode()
    assert 'id="held-out-warning"' not in page and 'id="held-out-result"' in page
    # A train reward that fell: no warning whatever held-out says.
    Metric.objects.filter(job=rl_job).update(value=0.0)
    finished_delta("lower")
    Metric.objects.filter(job=rl_job, step=1).update(value=1.0)
    assert (
        'id="held-out-warning"' not in alice_client.get(rl_job.get_absolute_url()).content.decode()
    )


def test_the_api_queues_a_delta(alice_client, rl_job):
    body = delta_form(rl_job)
    answer = alice_client.post("/api/delta/", body, "application/json")
    assert answer.status_code == 201
    job = Job.objects.get(pk=answer.json()["id"])
    assert job.kind == "delta" and job.parent_checkpoint.job == rl_job
    assert job.config["base"] == {"model": "tiny"} and job.config["num_examples"] == 3
    services.job_cancel(job=job)  # no worker in this test


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"num_examples": 1}, "num_examples"),
        ({"num_examples": "9" * 5000}, "num_examples"),
        ({"rollouts_per_example": 0}, "rollouts_per_example"),
        ({"temperature": "nan"}, "temperature"),
        ({"max_tokens": [1]}, "max_tokens"),
        ({"seed": -5}, "seed"),
        ({"base": "1 OR 1=1"}, "base"),
        ({"env_config": {"id": 1}}, "env_config"),
    ],
)
def test_hostile_delta_settings_are_refused_naming_the_field(alice_client, rl_job, changes, field):
    answer = alice_client.post("/api/delta/", delta_form(rl_job, **changes), "application/json")
    assert answer.status_code == 400 and field in answer.json()["errors"]
    assert not Job.objects.filter(kind="delta").exists()


def test_a_delta_goes_to_a_node_with_the_gpus_it_asks_for(alice_client, rl_job, gpu_node):
    answer = alice_client.post("/api/delta/", delta_form(rl_job, gpus=1), "application/json")
    assert answer.status_code == 201
    job = Job.objects.get(pk=answer.json()["id"])
    assert job.queue == "gpu" and job.gpus == 1
    services.job_cancel(job=job)
    too_big = delta_form(rl_job, gpus=1, gpu_memory_gib=200)
    answer = alice_client.post("/api/delta/", too_big, "application/json")
    assert answer.status_code == 400 and "gpus" in answer.json()["errors"]
    sized_nothing = delta_form(rl_job, gpu_memory_gib=40)
    answer = alice_client.post("/api/delta/", sized_nothing, "application/json")
    assert answer.status_code == 400 and "gpu_memory_gib" in answer.json()["errors"]


def test_a_delta_against_itself_or_on_others_models_is_refused(
    alice_client, bob, bob_client, rl_job
):
    same = delta_form(rl_job)
    same["base"] = same["trained"]
    page = alice_client.post("/delta/", same)
    assert page.status_code == 400 and "trained" in page.context["form"].errors
    bobs = services.model_create(owner=bob, name="bob-tiny", kind="tiny")
    answer = alice_client.post("/api/delta/", delta_form(rl_job, base=bobs.pk), "application/json")
    assert answer.status_code == 400 and "base" in answer.json()["errors"]
    # Bob may not use alice's models or config, nor read her deltas.
    answer = bob_client.post("/api/delta/", delta_form(rl_job, base=bobs.pk), "application/json")
    assert set(answer.json()["errors"]) == {"env_config", "trained"}
    assert not Job.objects.filter(kind="delta").exists()
    alices = Job.objects.create(owner=rl_job.owner, kind="delta", status="queued", config={})
    assert bob_client.get(f"/delta/{alices.pk}/").status_code == 404
    assert bob_client.get(f"/delta/?job={rl_job.pk}").context["form"].initial == {}
