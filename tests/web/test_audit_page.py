"""The audit page of an env config: a button queues the verifier audit (rlcore/audit.py)
as a job, the real worker runs it, and the page shows its report (trivial exploits, format
flips, throughput, warnings highlighted) with the JSON to download; the env config's page
keeps showing the last audit."""

import json

import pytest

from rlcore.events import RecordingSink
from tests.lab_fixtures import wait_for_job
from webapp.jobs.models import Job
from workers.checklist import run_audit_job

pytestmark = [pytest.mark.django_db(transaction=True)]


def audit_url(config) -> str:
    return f"/envs/configs/{config.pk}/audit/"


@pytest.mark.worker
def test_an_audit_runs_on_the_worker_and_its_report_renders(
    alice_client, ttt_config, celery_worker
):
    # A throughput that cannot keep up: 65536 rollouts a step against a 1 ms step.
    form = {"num_examples": 3, "seed": 0, "rollouts_per_step": 65536, "step_seconds": 0.001}
    queued = alice_client.post(audit_url(ttt_config), form)
    assert queued.status_code == 302
    job = wait_for_job(Job.objects.get(kind="audit", env_config=ttt_config))
    assert job.status == "succeeded", job.error
    assert job.progress_total > 0 and job.progress_done == job.progress_total
    audit = job.result["audit"]
    assert audit["env"] == "tictactoe" and audit["num_examples"] == 3
    assert job.summary == {"passed": False, "warnings": len(audit["warnings"])}

    page = alice_client.get(audit_url(ttt_config)).content.decode()
    assert 'id="audit-exploits"' in page and 'data-player="random text"' in page
    assert 'data-player="empty reply"' in page
    assert 'data-variant="trailing newline"' in page
    assert 'id="audit-warnings"' in page and "verification would bound the step" in page
    assert 'id="job-wait"' not in page  # finished: no progress bar left
    # Exactly the rows the report marks are highlighted.
    failing = sum(not p["ok"] for p in audit["exploits"])
    flipping = sum(bool(v["flipped"]) for v in audit["variants"])
    assert page.count('class="warn-row"') == failing + flipping + 1  # + throughput

    download = alice_client.get(f"/jobs/{job.pk}/report.json")
    assert "attachment" in download["Content-Disposition"]
    assert json.loads(download.content) == audit

    config_page = alice_client.get(f"/envs/configs/{ttt_config.pk}/").content.decode()
    assert f"job #{job.pk}" in config_page and "warning" in config_page


def test_a_running_audit_shows_its_progress(alice, alice_client, ttt_config):
    job = Job.objects.create(
        owner=alice, kind="audit", status="running", env_config=ttt_config, config={},
        progress_done=3, progress_total=9, progress_desc="empty reply",
    )  # fmt: skip
    page = alice_client.get(audit_url(ttt_config)).content.decode()
    assert 'id="job-wait"' in page and f'data-url="/api/jobs/{job.pk}/"' in page
    assert "empty reply 3/9" in page
    assert 'id="audit-exploits"' not in page


def test_bob_can_neither_see_nor_run_alices_audit(bob_client, alice, ttt_config):
    job = Job.objects.create(
        owner=alice, kind="audit", status="succeeded", env_config=ttt_config, config={},
        result={"audit": {"exploits": []}},
    )  # fmt: skip
    assert bob_client.get(audit_url(ttt_config)).status_code == 404
    assert bob_client.post(audit_url(ttt_config), {"num_examples": 2}).status_code == 404
    api = bob_client.post(f"/api/env-configs/{ttt_config.pk}/audit/", {}, "application/json")
    assert api.status_code == 404
    assert bob_client.get(f"/jobs/{job.pk}/report.json").status_code == 404
    assert Job.objects.count() == 1


def test_a_report_download_needs_an_audit_or_delta(alice_client, alice_eval):
    assert alice_client.get(f"/jobs/{alice_eval.pk}/report.json").status_code == 404


@pytest.mark.parametrize(
    "field, value",
    [
        ("num_examples", "0"),
        ("num_examples", "abc"),
        ("num_examples", "9" * 5000),
        ("seed", "-1"),
        ("rollouts_per_step", "1e400"),
        ("step_seconds", "nan"),
        ("step_seconds", "inf"),
    ],
)
def test_hostile_audit_settings_are_refused_naming_the_field(
    alice_client, ttt_config, field, value
):
    form = {"num_examples": 4, "seed": 0, "rollouts_per_step": 64, field: value}
    page = alice_client.post(audit_url(ttt_config), form)
    assert page.status_code == 400 and field in page.context["form"].errors
    api = alice_client.post(
        f"/api/env-configs/{ttt_config.pk}/audit/", {field: value}, "application/json"
    )
    assert api.status_code == 400 and field in api.json()["errors"]
    assert not Job.objects.filter(kind="audit").exists()


def test_an_audit_body_that_is_not_a_json_object_is_refused(alice_client, ttt_config):
    url = f"/api/env-configs/{ttt_config.pk}/audit/"
    for body in ("[1, 2]", "{" * 40, '{"num_examples": 1e999}'):
        answer = alice_client.post(url, body, "application/json")
        assert answer.status_code == 400 and "body" in answer.json()["errors"], body
    assert not Job.objects.filter(kind="audit").exists()


class StopAfter(RecordingSink):
    """A sink whose job is cancelled once `players` players have been heard of."""

    def __init__(self, players: int):
        super().__init__()
        self.players = players

    def should_stop(self) -> bool:
        return len(self.progress_events) > self.players


def test_a_cancelled_audit_stops_between_players_with_a_partial_report(alice, ttt_config, tmp_path):
    config = {"env": "tictactoe", "env_args": ttt_config.params, "num_examples": 2, "seed": 0,
              "rollouts_per_step": 64, "step_seconds": None, "out_dir": str(tmp_path)}  # fmt: skip
    job = Job.objects.create(owner=alice, kind="audit", env_config=ttt_config, config=config)
    _, whole = run_audit_job(job, RecordingSink())
    summary, partial = run_audit_job(job, StopAfter(players=2))
    assert len(partial["audit"]["exploits"]) == 1 < len(whole["audit"]["exploits"])
    assert partial["audit"]["variants"] == [] and not summary["passed"]
    assert partial["audit"]["warnings"][-1].endswith("a partial report")
    assert not any("partial" in warning for warning in whole["audit"]["warnings"])
