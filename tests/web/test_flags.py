"""False-negative flags: a person flags a rollout as wrongly scored in the inspector (one
flag per person and rollout, with an optional reason, removable); flags are counted per
env config and in the inspector, filtered on, and exported as CSV and JSON. Nobody flags,
counts or exports rollouts of jobs that are not theirs."""

import csv
import io
import json

import pytest

from webapp.jobs.models import RolloutFlag

pytestmark = pytest.mark.django_db


def flag_url(job, rollout_id) -> str:
    return f"/jobs/{job.pk}/rollouts/{rollout_id}/flag/"


def first_rollout(job):
    return job.rollouts.order_by("id").first()


def test_a_flag_is_added_counted_filtered_and_removed(alice_client, alice_eval, ttt_config):
    rollout = first_rollout(alice_eval)
    page = alice_client.post(flag_url(alice_eval, rollout.pk), {"reason": "a win scored 0"})
    assert page.status_code == 302 and page["Location"] == rollout.get_absolute_url()
    detail = alice_client.get(rollout.get_absolute_url()).content.decode()
    assert "You flagged this rollout" in detail and "a win scored 0" in detail
    assert 'id="unflag"' in detail and 'id="flag-rollout"' not in detail

    inspector = alice_client.get(f"/jobs/{alice_eval.pk}/rollouts/").content.decode()
    assert 'id="job-flag-count">1<' in inspector
    assert inspector.count('class="flag-mark"') == 1
    flagged = alice_client.get(f"/jobs/{alice_eval.pk}/rollouts/?flagged=on").context["page"]
    assert [r.pk for r in flagged.object_list] == [rollout.pk]
    everything = alice_client.get(f"/jobs/{alice_eval.pk}/rollouts/").context["page"]
    assert len(everything.object_list) == 8
    config_page = alice_client.get(f"/envs/configs/{ttt_config.pk}/").content.decode()
    assert 'id="flag-count">1<' in config_page

    removed = alice_client.post(flag_url(alice_eval, rollout.pk), {"remove": "1"})
    assert removed.status_code == 302
    assert not RolloutFlag.objects.exists()
    config_page = alice_client.get(f"/envs/configs/{ttt_config.pk}/").content.decode()
    assert 'id="flag-count">0<' in config_page
    assert 'id="flag-rollout"' in alice_client.get(rollout.get_absolute_url()).content.decode()


def test_one_flag_per_person_and_rollout(alice_client, carol, alice_eval, ttt_config):
    from tests.lab_fixtures import client_for

    rollout = first_rollout(alice_eval)
    alice_client.post(flag_url(alice_eval, rollout.pk), {"reason": "first"})
    alice_client.post(flag_url(alice_eval, rollout.pk), {"reason": "second thoughts"})
    assert list(RolloutFlag.objects.values_list("reason", flat=True)) == ["second thoughts"]
    # Staff may flag too: a second person's flag on the same rollout.
    client_for(carol).post(flag_url(alice_eval, rollout.pk), {"reason": "agreed"})
    assert RolloutFlag.objects.filter(rollout=rollout).count() == 2
    # One rollout flagged, by two people: counted once.
    inspector = alice_client.get(f"/jobs/{alice_eval.pk}/rollouts/").content.decode()
    assert 'id="job-flag-count">1<' in inspector
    config_page = alice_client.get(f"/envs/configs/{ttt_config.pk}/").content.decode()
    assert 'id="flag-count">1<' in config_page
    listed = alice_client.get("/envs/").context["configs"]
    assert [(c.pk, c.flagged) for c in listed] == [(ttt_config.pk, 1)]


def test_flags_are_exported_with_prompt_reply_reward_and_reason(
    alice_client, alice_eval, ttt_config
):
    rollouts = list(alice_eval.rollouts.order_by("id")[:2])
    alice_client.post(flag_url(alice_eval, rollouts[0].pk), {"reason": "=HYPERLINK(1)"})
    alice_client.post(flag_url(alice_eval, rollouts[1].pk))

    exported = alice_client.get(f"/envs/configs/{ttt_config.pk}/flags.json")
    assert exported.status_code == 200 and "attachment" in exported["Content-Disposition"]
    rows = sorted(json.loads(exported.content), key=lambda row: row["rollout"])
    assert [row["rollout"] for row in rows] == [r.pk for r in rollouts]
    first = rows[0]
    assert first["reward"] == rollouts[0].reward and first["env"] == "tictactoe"
    assert "<move>" in first["reply"] and "user:" in first["prompt"]
    assert first["reason"] == "=HYPERLINK(1)" and first["flagged_by"] == "alice"

    table = alice_client.get(f"/envs/configs/{ttt_config.pk}/flags.csv")
    assert table["Content-Type"].startswith("text/csv")
    parsed = list(csv.DictReader(io.StringIO(table.content.decode())))
    assert len(parsed) == 2 and {"prompt", "reply", "reward", "reason"} <= set(parsed[0])
    # A cell a spreadsheet would run as a formula is exported as text.
    assert {row["reason"] for row in parsed} == {"'=HYPERLINK(1)", ""}
    assert alice_client.get(f"/envs/configs/{ttt_config.pk}/flags.xml").status_code == 404
    api = alice_client.get(f"/api/env-configs/{ttt_config.pk}/flags/").json()
    assert len(api["flags"]) == 2


def test_the_api_flags_and_unflags(alice_client, alice_eval):
    rollout = first_rollout(alice_eval)
    url = f"/api/jobs/{alice_eval.pk}/rollouts/{rollout.pk}/flag/"
    made = alice_client.post(url, {"reason": "judge misread"}, content_type="application/json")
    assert made.status_code == 201 and made.json() == {
        "rollout": rollout.pk,
        "reason": "judge misread",
        "flags": 1,
    }
    assert alice_client.delete(url).status_code == 204
    assert alice_client.delete(url).status_code == 404
    assert not RolloutFlag.objects.exists()


def test_bob_can_neither_flag_nor_count_nor_export_alices(
    bob_client, alice_client, alice_eval, ttt_config
):
    rollout = first_rollout(alice_eval)
    alice_client.post(flag_url(alice_eval, rollout.pk), {"reason": "mine"})
    assert bob_client.post(flag_url(alice_eval, rollout.pk), {"reason": "x"}).status_code == 404
    api = f"/api/jobs/{alice_eval.pk}/rollouts/{rollout.pk}/flag/"
    assert bob_client.post(api, {}, content_type="application/json").status_code == 404
    assert bob_client.delete(api).status_code == 404
    assert bob_client.get(f"/envs/configs/{ttt_config.pk}/flags.csv").status_code == 404
    assert bob_client.get(f"/api/env-configs/{ttt_config.pk}/flags/").status_code == 404
    assert RolloutFlag.objects.get().reason == "mine"


@pytest.mark.parametrize(
    "body, field",
    [
        ({"reason": "x" * 201}, "reason"),
        ({"reason": ["a list"]}, "reason"),
        ({"reason": {"nested": 1}}, "reason"),
        ({"reason": "sk-abcdefghijklmnopqrstuvwxyz"}, "reason"),
    ],
)
def test_hostile_flags_are_refused_naming_the_field(alice_client, alice_eval, body, field):
    rollout = first_rollout(alice_eval)
    url = f"/api/jobs/{alice_eval.pk}/rollouts/{rollout.pk}/flag/"
    answer = alice_client.post(url, body, content_type="application/json")
    assert answer.status_code == 400 and field in answer.json()["errors"]
    assert not RolloutFlag.objects.exists()


def test_a_flag_body_that_is_not_json_is_refused(alice_client, alice_eval):
    rollout = first_rollout(alice_eval)
    url = f"/api/jobs/{alice_eval.pk}/rollouts/{rollout.pk}/flag/"
    answer = alice_client.post(url, "[" * 50 + "]" * 50, content_type="application/json")
    assert answer.status_code == 400 and "body" in answer.json()["errors"]
    page = alice_client.post(flag_url(alice_eval, rollout.pk), {"reason": "y" * 300})
    assert page.status_code == 400 and "reason" in page.json()["errors"]
