"""Paths escape no root: every path a user can name (model location, dataset,
resume_from) lies in the folder of one of their own jobs or under a shared model
directory, through one check; a path outside answers the same whether or not it exists."""

import pytest

from webapp.jobs import services
from webapp.jobs.models import Job, ModelEntry

pytestmark = pytest.mark.django_db


@pytest.fixture
def alice_run(alice, real_services):
    """A finished SFT job of alice's with a checkpoint folder and a dataset on disk."""
    job = Job.objects.create(owner=alice, kind="sft", status="succeeded")
    run = real_services / f"job-{job.pk}"
    (run / "final").mkdir(parents=True)
    (run / "step_000010").mkdir()
    (run / "step_000010" / "trainer_state.pt").write_bytes(b"not a checkpoint")
    (run / "dataset.jsonl").write_text('{"messages": []}\n')
    return run


def _post_job(client, **body):
    return client.post("/api/jobs/", body, content_type="application/json")


def test_bob_cannot_name_alices_runs_anywhere(bob, bob_client, alice_run, settings):
    ttt = services.env_config_save(owner=bob, name="t", env_name="tictactoe", params={})
    tiny = services.model_create(owner=bob, name="tiny", kind="tiny")
    with pytest.raises(services.ValidationError) as caught:
        services.model_create(
            owner=bob, name="stolen", kind="checkpoint", location=str(alice_run / "final")
        )
    assert "is not one you may use" in caught.value.message_dict["location"][0]
    response = bob_client.post(
        "/models/", {"name": "stolen", "kind": "hf", "location": str(alice_run / "final")}
    )
    assert "is not one you may use" in response.content.decode()
    for body in (
        {"kind": "rl", "env_config": ttt.pk, "overrides": f"resume_from={alice_run}/step_000010"},
        {"kind": "sft", "options": {"dataset": str(alice_run / "dataset.jsonl")}},
        {"kind": "sft", "overrides": f"dataset={alice_run}/dataset.jsonl"},
        {"kind": "rl", "env_config": ttt.pk, "overrides": f"model={alice_run}/final"},
    ):
        response = _post_job(bob_client, model=tiny.pk, **body)
        assert response.status_code == 400, body
        errors = response.json()["errors"]
        assert any("not one you may use" in m or "set by the lab" in m
                   for messages in errors.values() for m in messages), errors  # fmt: skip
    assert not Job.objects.filter(owner=bob).exists()
    assert not ModelEntry.objects.filter(owner=bob, kind="checkpoint").exists()


def test_alice_can_use_her_own_runs(alice, alice_client, alice_run):
    ttt = services.env_config_save(owner=alice, name="t", env_name="tictactoe", params={})
    tiny = services.model_create(owner=alice, name="tiny", kind="tiny")
    entry = services.model_create(
        owner=alice, name="mine", kind="checkpoint", location=str(alice_run / "final")
    )
    assert entry.location == str((alice_run / "final").resolve())
    response = _post_job(alice_client, kind="sft", model=tiny.pk,
                         options={"dataset": str(alice_run / "dataset.jsonl"), "max_steps": 1})  # fmt: skip
    assert response.status_code == 201, response.json()
    response = _post_job(alice_client, kind="rl", model=tiny.pk, env_config=ttt.pk,
                         overrides=f"resume_from={alice_run}/step_000010")  # fmt: skip
    assert response.status_code == 201, response.json()
    assert response.json()["config"]["resume_from"] == str((alice_run / "step_000010").resolve())


def test_a_path_outside_answers_alike_whether_or_not_it_exists(alice, alice_client):
    tiny = services.model_create(owner=alice, name="tiny", kind="tiny")
    answers = []
    for path in ("/etc/passwd", "/etc/no-such-file", "/root", "/no/such/dir"):
        response = _post_job(alice_client, kind="sft", model=tiny.pk, options={"dataset": path})
        assert response.status_code == 400
        message = response.json()["errors"]["dataset"][0]
        assert "is not one you may use" in message and "not valid JSON" not in message
        answers.append(message.replace(repr(path), "PATH"))
    assert len(set(answers)) == 1


def test_a_symlink_out_of_ones_run_is_refused(alice, alice_run):
    (alice_run / "escape").symlink_to("/etc")
    with pytest.raises(services.ValidationError) as caught:
        services.model_create(
            owner=alice, name="escape", kind="checkpoint", location=str(alice_run / "escape")
        )
    assert "is not one you may use" in caught.value.message_dict["location"][0]


def test_names_too_long_or_with_nul_are_a_400(alice, alice_client):
    tiny = services.model_create(owner=alice, name="tiny", kind="tiny")
    for location in ("/tmp/" + "a" * 300 + "/model", "/tmp/" + "b/" * 600, "/tmp/x\x00y"):
        response = alice_client.post(
            "/models/", {"name": "long", "kind": "checkpoint", "location": location}
        )
        page = response.content.decode()
        assert response.status_code == 200 and not ModelEntry.objects.filter(name="long").exists()
        assert any(
            m in page
            for m in ("is not one you may use", "at most 500 characters", "Null characters")
        )
        response = _post_job(alice_client, kind="sft", model=tiny.pk, options={"dataset": location})
        assert response.status_code == 400 and "dataset" in response.json()["errors"]
