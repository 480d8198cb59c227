"""Each attempt of a job owns its checkpoints: a requeued job starts over in a folder of
its own, its earlier checkpoints stay archived (models made from them keep working), and
a retry resumes only from the current attempt's last checkpoint."""

import pytest

from tests.lab_fixtures import wait_for_job
from webapp.jobs import services
from webapp.jobs.models import Checkpoint, Job, ModelEntry

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_retry_after_a_requeue_never_resumes_from_the_old_attempt(alice, ttt_config, tiny):
    job = Job.objects.create(owner=alice, kind="rl", status="failed", env_config=ttt_config,
                             model=tiny, config={"output_dir": "/x/job-1"})  # fmt: skip
    Checkpoint.objects.create(job=job, step=40, path="/x/job-1/step_000040")
    assert services.job_retry(job=job).config["resume_from"] == "/x/job-1/step_000040"
    services.job_requeue(job=job)
    job.refresh_from_db()
    assert job.attempt == 2 and job.config["output_dir"].endswith(f"job-{job.pk}/attempt-2")
    Job.objects.filter(pk=job.pk).update(status="failed")
    job.refresh_from_db()
    assert list(job.current_checkpoints()) == []
    retried = services.job_retry(job=job)
    assert "resume_from" not in retried.config or retried.config["resume_from"] is None
    assert retried.parent_checkpoint is None


def test_a_requeued_rl_job_writes_and_resumes_from_its_own_attempt(
    alice, ttt_config, tiny, celery_worker
):
    job = services.job_create(
        owner=alice, kind="rl", env_config=ttt_config, model=tiny,
        options={"batch_size": 4, "rollouts_per_example": 2, "max_steps": 2, "max_tokens": 16,
                 "save_every": 1, "device": "cpu", "select.num_examples": 4},
    )  # fmt: skip
    # (select.num_examples: the default recipe's choice plays 500 games a set a save,
    # minutes on a CPU for each of the test's jobs.)
    job = wait_for_job(job)
    assert job.status == "succeeded", job.error
    first = set(Checkpoint.objects.filter(job=job).values_list("path", flat=True))
    assert first and all(c.attempt == 1 for c in Checkpoint.objects.filter(job=job))

    services.job_requeue(job=job)
    job = wait_for_job(job)
    assert job.status == "succeeded", job.error
    current = list(job.current_checkpoints())
    assert job.attempt == 2 and current
    assert all(f"job-{job.pk}/attempt-2/" in c.path for c in current)
    assert not {c.path for c in current} & first
    # The first attempt's checkpoints and the models made from them are still there.
    assert (
        set(Checkpoint.objects.filter(job=job, attempt=1).values_list("path", flat=True)) == first
    )
    names = set(ModelEntry.objects.filter(checkpoint__job=job).values_list("name", flat=True))
    assert f"job-{job.pk}/final" in names and f"job-{job.pk}.2/final" in names

    retried = services.job_retry(job=job)
    newest = min(current, key=lambda c: (-c.step, c.pk))
    assert retried.config["resume_from"] == newest.path
