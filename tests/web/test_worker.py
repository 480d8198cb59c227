"""A real Celery worker (subprocess, real Redis broker, test PostgreSQL) runs jobs from
the queue: eval with the oracle and with the tiny model, a few RL steps of the tiny
model, cancellation, and a worker that dies mid-job."""

import os
import re
import signal
import subprocess
import time

import pytest

from tests.lab_fixtures import create_job_with_listener, wait_for_job
from webapp.jobs import services
from webapp.jobs.models import Checkpoint, Job, LogLine, Metric, ModelEntry, Rollout

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.worker]


def updates(messages):
    return [m for m in messages if m["type"] == "job.update"]


def logged(client, job) -> list[str]:
    """The log lines the job page's Log panel gets."""
    return [line["message"] for line in client.get(f"/api/jobs/{job.pk}/updates/").json()["logs"]]


def test_an_oracle_eval_runs_on_the_worker(alice, alice_client, ttt_config, oracle, celery_worker):
    job, listener = create_job_with_listener(
        owner=alice, kind="eval", env_config=ttt_config, model=oracle,
        options={"num_examples": 12, "max_tokens": 24, "concurrency": 4},
    )  # fmt: skip
    messages = listener.collect()
    job = wait_for_job(job)
    assert job.status == "succeeded", job.error
    assert job.worker == celery_worker["node"] and job.queue == "cpu"
    assert job.started and job.finished and job.progress_done == job.progress_total == 12
    # The oracle never loses: the summary and the stored rollouts say so.
    assert job.summary["num_rollouts"] == 12 and job.summary["outcomes"]["loss"]["count"] == 0
    assert Rollout.objects.filter(job=job).count() == 12
    assert not Rollout.objects.filter(job=job, outcome="loss").exists()
    assert Rollout.objects.filter(job=job, facts__has_key="random_move_prob").count() == 12
    assert Metric.objects.filter(job=job, name="reward/mean").exists()
    assert "reward" in job.result["report"]
    # The Log panel says what it did: settings, milestones, the summary.
    lines = logged(alice_client, job)
    assert lines[0].startswith("eval: oracle on tictactoe: 12 examples x 1 rollouts")
    assert any(line.startswith("eval: 6/12 rollouts (50%)") for line in lines)
    assert any(line.startswith("eval: done: 12 rollouts in") for line in lines)
    assert lines[-1].startswith("baseline constant: 12 rollouts in")  # baselines are on
    # Channel messages: running, per-step batches with metrics and rollout ids, succeeded.
    statuses = [m["status"] for m in messages if m["type"] == "job.status"]
    assert statuses[0] == "running" and statuses[-1] == "succeeded"
    batches = updates(messages)
    assert batches and all(len({p["step"] for p in b["metrics"]}) <= 1 for b in batches)
    sent_ids = {r["id"] for b in batches for r in b["rollouts"]}
    assert sent_ids == set(Rollout.objects.filter(job=job).values_list("id", flat=True))


def test_a_tiny_model_eval_runs_on_the_worker(alice, ttt_config, tiny, celery_worker):
    job, listener = create_job_with_listener(
        owner=alice, kind="eval", env_config=ttt_config, model=tiny,
        options={"num_examples": 4, "max_tokens": 24, "concurrency": 4, "device": "cpu"},
    )  # fmt: skip
    messages = listener.collect()
    job = wait_for_job(job)
    assert job.status == "succeeded", job.error
    rows = Rollout.objects.filter(job=job)
    assert rows.count() == 4
    assert all(
        r.completion_tokens > 0 and r.messages[-1]["role"] in ("assistant", "user") for r in rows
    )
    assert any(m["metrics"] for m in updates(messages))


def test_a_few_rl_steps_of_the_tiny_model(alice, alice_client, ttt_config, tiny, celery_worker):
    job, listener = create_job_with_listener(
        owner=alice, kind="rl", env_config=ttt_config, model=tiny,
        options={"batch_size": 4, "rollouts_per_example": 2, "max_steps": 2, "max_tokens": 24,
                 "save_every": 1, "device": "cpu", "num_examples": 3},
    )  # fmt: skip
    messages = listener.collect()
    job = wait_for_job(job)
    assert job.status == "succeeded", job.error
    steps = sorted(
        set(Metric.objects.filter(job=job, name="loss/policy").values_list("step", flat=True))
    )
    assert steps == [1, 2]
    assert Metric.objects.filter(job=job, name="reward/mean").count() == 2
    assert Rollout.objects.filter(job=job).exists()
    # Checkpoints became models alice can pick.
    checkpoints = Checkpoint.objects.filter(job=job)
    assert checkpoints.exists()
    assert (
        ModelEntry.objects.filter(owner=alice, kind="checkpoint", checkpoint__job=job).count()
        == checkpoints.count()
    )
    assert job.result["checkpoint"] in set(checkpoints.values_list("path", flat=True))
    lines = logged(alice_client, job)
    assert re.fullmatch(
        r"rl: \w+ on tictactoe, 2 examples x 2 rollouts per step, steps 1..2, training on cpu",
        lines[0],
    )
    # The default recipe (rl_sound) ends by choosing among the last saves on validation
    # games (3 a set here): the result is best/, a checkpoint alice can pick too.
    out = job.config["output_dir"]
    assert lines[-3:-1] == [
        f"rl: final checkpoint {out}/final",
        "select: 2 saves (steps 1..2) x 3 greedy games of random, optimal",
    ]
    assert lines[-1].startswith("select: chose ") and lines[-1].endswith(f"copied to {out}/best")
    assert job.result["checkpoint"] == f"{out}/best"
    assert Metric.objects.filter(job=job, name="select/score").count() == 2
    batch_steps = [b["last_step"] for b in updates(messages) if b["metrics"]]
    assert 1 in batch_steps and 2 in batch_steps


def test_cancelling_a_running_job_stops_it(alice, ttt_config, tiny, celery_worker):
    job, listener = create_job_with_listener(
        owner=alice, kind="eval", env_config=ttt_config, model=tiny,
        options={"num_examples": 400, "max_tokens": 24, "concurrency": 2, "device": "cpu"},
    )  # fmt: skip
    listener.collect(until_status=("running",))
    deadline = time.monotonic() + 120
    while not Rollout.objects.filter(job=job).exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    services.job_cancel(job=Job.objects.get(pk=job.pk))
    messages = listener.collect()
    job = wait_for_job(job)
    assert job.status == "cancelled"
    assert job.summary["cancelled"] is True
    assert Rollout.objects.filter(job=job).count() < 400
    assert messages[-1]["status"] == "cancelled"


def test_cancelling_a_queued_job_is_immediate(alice, ttt_config, oracle):
    job = services.job_create(owner=alice, kind="eval", env_config=ttt_config, model=oracle)
    job = services.job_cancel(job=job)
    assert job.status == "cancelled" and job.finished is not None


def test_a_job_whose_worker_process_dies_is_marked_lost(alice, ttt_config, tiny, celery_worker):
    job, listener = create_job_with_listener(
        owner=alice, kind="eval", env_config=ttt_config, model=tiny,
        options={"num_examples": 400, "max_tokens": 24, "concurrency": 2, "device": "cpu"},
    )  # fmt: skip
    listener.collect(until_status=("running",))
    children = subprocess.run(
        ["pgrep", "-P", str(celery_worker["process"].pid)], capture_output=True, text=True
    ).stdout.split()
    assert children, "the prefork pool has a child process"
    for pid in children:
        os.kill(int(pid), signal.SIGKILL)
    messages = listener.collect()
    job = wait_for_job(job)
    assert job.status == "lost"
    assert job.error.startswith("worker lost") and "died" in job.error
    assert LogLine.objects.filter(
        job=job, level="error", message__startswith="worker lost"
    ).exists()
    assert messages[-1]["reason"] == "worker_lost"


def test_synth_then_sft_on_the_worker(alice, alice_client, ttt_config, tiny, celery_worker):
    random_player = services.model_create(
        owner=alice, name="random", kind="builtin", location="random"
    )
    synth, listener = create_job_with_listener(
        owner=alice, kind="synth", env_config=ttt_config, model=random_player,
        options={"num_examples": 40, "max_kept": 8, "exclude_outcomes": ["loss"]},
    )  # fmt: skip
    listener.collect()
    synth = wait_for_job(synth)
    assert synth.status == "succeeded", synth.error
    assert synth.result["kept"] == 8 and synth.result["path"].endswith("dataset.jsonl")
    lines = logged(alice_client, synth)
    assert lines[0].startswith("synth: random on tictactoe, up to 40 examples")
    assert lines[-1].startswith("synth: kept 8 of")
    sft, listener = create_job_with_listener(
        owner=alice, kind="sft", env_config=None, model=tiny,
        options={"dataset": synth.result["path"], "max_steps": 2, "batch_size": 4,
                 "micro_batch_size": 2, "max_seq_len": 256, "device": "cpu"},
    )  # fmt: skip
    listener.collect()
    sft = wait_for_job(sft)
    assert sft.status == "succeeded", sft.error
    assert Metric.objects.filter(job=sft, name__startswith="loss/").exists()
    lines = logged(alice_client, sft)
    assert re.fullmatch(
        r"sft: \d+ conversations from .*dataset.jsonl .*, training on cpu", lines[0]
    )
    assert lines[-1] == f"sft: final checkpoint {sft.result['checkpoint']}"
    final = ModelEntry.objects.get(checkpoint__job=sft, checkpoint__path=sft.result["checkpoint"])
    assert final.kind == "checkpoint" and final.owner == alice
