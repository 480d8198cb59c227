"""Worker nodes and what a job needs: a GPU job goes to a gpu queue whose every live node
has the cards, what no live node can serve is refused naming the field (form, API), a
silent node is gone, the Nodes page and the admin list nodes with the jobs they run (bob
never sees alice's), and checkpoints go under CHECKPOINT_ROOT.

The nodes here are announcements as a worker writes them (tests/reliability has real
workers announcing themselves); this machine has no GPU, so cards are written in."""

import json
from datetime import timedelta
from pathlib import Path

import pytest
from django.core.exceptions import ValidationError
from django.test import override_settings
from django.utils import timezone

from tests.lab_fixtures import announce_node, job_form_data
from webapp.jobs import services
from webapp.jobs.models import Job, WorkerNode

pytestmark = pytest.mark.django_db

SMALL_RL = {"batch_size": 4, "rollouts_per_example": 2, "max_steps": 1}


def create(alice, ttt_config, tiny, **options):
    return services.job_create(
        owner=alice, kind="rl", env_config=ttt_config, model=tiny, options=SMALL_RL | options
    )


def refusal(alice, ttt_config, tiny, **options) -> dict:
    with pytest.raises(ValidationError) as caught:
        create(alice, ttt_config, tiny, **options)
    assert not Job.objects.exists()
    return caught.value.message_dict


def test_a_cpu_job_goes_to_the_cpu_queue_even_with_no_node_up(alice, ttt_config, tiny):
    job = create(alice, ttt_config, tiny)
    assert job.queue == "cpu" and job.needs_dict() == {
        "gpus": 0,
        "gpu_memory_gib": 0.0,
        "engine": "local",
    }


def test_a_gpu_job_no_live_node_can_serve_is_refused_naming_gpus(alice, ttt_config, tiny):
    errors = refusal(alice, ttt_config, tiny, gpus=1)
    assert "no live worker node can run a job on 1 GPU(s)" in errors["gpus"][0]
    announce_node("gpu@small", queues=("gpu",), gpus=(24,))
    errors = refusal(alice, ttt_config, tiny, gpus=2, gpu_memory_gib=40)
    assert "on 2 GPU(s) of at least 40 GiB" in errors["gpus"][0]
    assert "gpu@small has 0 such GPU(s) (GPU 24 GiB 24 GiB)" in errors["gpus"][0]
    # A cuda device asks for one GPU: the error is under the field that asked.
    announce_node("gpu@small", queues=("cpu",))
    assert (
        "no live worker node can run a job on 1 GPU(s)"
        in refusal(alice, ttt_config, tiny, device="cuda")["device"][0]
    )


def test_a_split_rl_job_on_one_gpu_is_refused_naming_placement(alice, ttt_config, tiny):
    announce_node("gpu@two", queues=("gpu",), gpus=(80, 80))
    errors = refusal(alice, ttt_config, tiny, gpus=1, placement="split")
    assert "set gpus to 2, or placement to colocated" in errors["placement"][0]
    errors = refusal(alice, ttt_config, tiny, device="cuda", placement="split")
    assert "placement" in errors
    assert create(alice, ttt_config, tiny, gpus=2, placement="split").config["placement"] == "split"
    # On the CPU both sides share it: nothing to refuse.
    assert create(alice, ttt_config, tiny, device="cpu", placement="split").queue == "cpu"


def test_a_gpu_job_goes_to_a_queue_whose_every_live_node_can_serve_it(alice, ttt_config, tiny):
    announce_node("gpu@small", queues=("gpu",), gpus=(24,))
    announce_node("gpu@big", queues=("gpu", "gpu-large"), gpus=(80, 80))
    assert create(alice, ttt_config, tiny, gpus=1).queue == "gpu"
    big = create(alice, ttt_config, tiny, gpus=2, gpu_memory_gib=40)
    assert big.queue == "gpu-large" and (big.gpus, big.gpu_memory_gib) == (2, 40.0)
    assert big.needs_text == "2 GPUs of at least 40 GiB"


def test_capable_nodes_sharing_every_queue_with_others_are_refused_with_the_way_out(
    alice, ttt_config, tiny
):
    announce_node("gpu@small", queues=("gpu",), gpus=(24,))
    announce_node("gpu@big", queues=("gpu",), gpus=(80,))
    message = refusal(alice, ttt_config, tiny, gpus=1, gpu_memory_gib=40)["gpus"][0]
    assert "(gpu@big) share every gpu queue with nodes that cannot (gpu@small)" in message
    assert "-Q gpu,gpu-large" in message


def test_a_silent_node_is_gone_and_serves_nothing(alice, alice_client, ttt_config, tiny):
    announce_node("gpu@box", queues=("gpu",), gpus=(80,))
    assert create(alice, ttt_config, tiny, gpus=1).queue == "gpu"
    WorkerNode.objects.filter(name="gpu@box").update(
        last_seen=timezone.now() - timedelta(seconds=3600)
    )
    Job.objects.all().delete()
    message = refusal(alice, ttt_config, tiny, gpus=1)["gpus"][0]
    assert "no live worker node can run a job on 1 GPU(s)" in message and "gpu@box" not in message
    html = alice_client.get("/nodes/").content.decode()
    assert 'data-node="gpu@box" data-status="gone"' in html and "silent 3600 s" in html
    assert WorkerNode.objects.get(name="gpu@box").status == "gone"


@pytest.mark.parametrize(
    ("options", "field", "words"),
    [
        ({"gpus": -1}, "gpus", "between 0 and 64"),
        ({"gpus": 65}, "gpus", "between 0 and 64"),
        ({"gpus": 1.5}, "gpus", "expected an integer"),
        ({"gpu_memory_gib": 5000, "gpus": 1}, "gpu_memory_gib", "between 0 and 4096"),
        ({"gpu_memory_gib": 40}, "gpu_memory_gib", "set gpus to 1 or more"),
        ({"engine": "sglang"}, "engine", "must be one of ['local', 'vllm']"),
        ({"gpus": 1, "device": "cpu"}, "gpus", "device is cpu"),
    ],
)
def test_needs_are_bounded_like_every_setting(alice, ttt_config, tiny, options, field, words):
    announce_node("gpu@box", queues=("gpu",), gpus=(80,))
    assert words in refusal(alice, ttt_config, tiny, **options)[field][0]


def test_sft_has_no_engine_to_pick(alice, tiny):
    with pytest.raises(ValidationError) as caught:
        services.job_create(owner=alice, kind="sft", env_config=None, model=tiny,
                            options={"engine": "vllm"})  # fmt: skip
    assert "sft samples nothing" in caught.value.message_dict["engine"][0]


def test_needs_also_come_from_the_overrides(alice, ttt_config, tiny):
    announce_node("gpu@box", queues=("gpu",), gpus=(80,))
    job = services.job_create(
        owner=alice, kind="rl", env_config=ttt_config, model=tiny, options=SMALL_RL,
        overrides="gpus=1\nengine=vllm\noptimizer.lr=3e-4",
    )  # fmt: skip
    assert (job.queue, job.gpus, job.engine) == ("gpu", 1, "vllm")
    assert job.config["optimizer"]["lr"] == 3e-4 and "gpus" not in job.config


def test_the_api_refuses_what_no_node_can_serve_with_a_400_naming_the_field(
    alice_client, ttt_config, tiny
):
    body = {"kind": "rl", "model": tiny.pk, "env_config": ttt_config.pk,
            "options": SMALL_RL | {"gpus": 4, "gpu_memory_gib": 80}}  # fmt: skip
    response = alice_client.post("/api/jobs/", json.dumps(body), content_type="application/json")
    assert response.status_code == 400
    assert (
        "no live worker node can run a job on 4 GPU(s) of at least 80 GiB"
        in (response.json()["errors"]["gpus"][0])
    )
    announce_node("gpu@box", queues=("gpu",), gpus=(80, 80, 80, 80))
    response = alice_client.post("/api/jobs/", json.dumps(body), content_type="application/json")
    assert response.status_code == 201, response.content
    assert response.json()["needs"] == {"gpus": 4, "gpu_memory_gib": 80.0, "engine": "local"}


def test_the_job_form_shows_the_refusal_under_the_field(alice, alice_client, ttt_config, tiny):
    data = job_form_data(alice, "eval", env_config=ttt_config.pk, model=tiny.pk, gpus="2")
    html = alice_client.post("/jobs/new/", data).content.decode()
    assert 'data-testid="error-gpus"' in html and "no live worker node can run a job on 2" in html
    assert not Job.objects.exists()
    form = alice_client.get("/jobs/new/?kind=eval").content.decode()
    assert 'id="needs-settings"' in form and 'name="gpu_memory_gib"' in form
    assert (
        'name="engine"' in form
        and 'name="engine"' not in alice_client.get("/jobs/new/?kind=sft").content.decode()
    )


def test_the_nodes_page_lists_each_node_with_its_jobs_never_bob_s_view_of_alice_s(
    alice, alice_client, bob_client, carol, ttt_config, tiny
):
    announce_node("jobs@box", queues=("cpu", "gpu"), gpus=(80,))
    job = create(alice, ttt_config, tiny)
    now = timezone.now()
    Job.objects.filter(pk=job.pk).update(
        status="running", worker="jobs@box", started=now, heartbeat=now
    )
    html = alice_client.get("/nodes/").content.decode()
    assert 'data-node="jobs@box" data-status="live"' in html
    assert f'href="/jobs/{job.pk}/">#{job.pk}</a> rl' in html and "GPU 80 GiB" in html
    assert 'data-testid="nav-nodes"' in html
    # announce_node reports no checkpoint root: a node that does not share this lab's.
    assert "not this lab's" in html and "node-root-differs" in html
    bobs = bob_client.get("/nodes/").content.decode()
    assert f"/jobs/{job.pk}/" not in bobs and "1 of other users" in bobs
    page = alice_client.get(f"/jobs/{job.pk}/").content.decode()
    assert 'id="job-needs">CPU<' in page and 'id="job-node"' in page
    from tests.lab_fixtures import client_for

    admin = client_for(carol)
    carol.is_superuser = True
    carol.save()
    listing = admin.get("/admin/jobs/workernode/").content.decode()
    rows = listing[listing.find("<tbody>") :]
    assert "jobs@box" in rows and f"#{job.pk}" in rows and "GPU 80 GiB (80 GiB)" in rows


def test_checkpoints_go_under_checkpoint_root_and_their_owner_may_use_them(
    alice, bob, ttt_config, tiny, tmp_path
):
    shared = tmp_path / "nfs-checkpoints"
    with override_settings(CHECKPOINT_ROOT=shared):
        rl = create(alice, ttt_config, tiny)
        evaluation = services.job_create(
            owner=alice, kind="eval", env_config=ttt_config, model=tiny, options={}
        )
        assert Path(rl.config["output_dir"]) == shared / f"job-{rl.pk}"
        assert not Path(evaluation.config["out_dir"]).is_relative_to(shared)
        final = shared / f"job-{rl.pk}" / "final"
        final.mkdir(parents=True)
        assert services.path_confine(location=str(final), owner=alice) == str(final.resolve())
        with pytest.raises(ValidationError, match="is not one you may use"):
            services.path_confine(location=str(final), owner=bob)
