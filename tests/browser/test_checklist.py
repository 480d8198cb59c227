"""The verifier checklist in a real browser: alice flags a rollout as wrongly scored in
the inspector and sees it counted, and runs an env config's audit, whose page follows the
worker's progress and then shows the report."""

from __future__ import annotations

import re

import pytest
from playwright.sync_api import Page, expect

from tests.browser.conftest import screenshot

pytestmark = pytest.mark.browser

# An eval job of alice's with 4 oracle games, played in-process as the worker would.
EVAL_WITH_ROLLOUTS = """
from django.contrib.auth.models import User
from rlcore.evaluate import EvalConfig, run_eval
from rlcore.events import RecordingSink
from webapp.jobs import services
from webapp.jobs.models import Job, Rollout
from workers.sink import rollout_row
alice = User.objects.get(username="alice")
config = services.env_config_save(owner=alice, name="ttt flags", env_name="tictactoe",
                                  params={"max_turns": 6})
run = EvalConfig(env="tictactoe", model="oracle", env_args=dict(config.params), num_examples=4,
                 max_tokens=24)
result = run_eval(run, RecordingSink())
job = Job.objects.create(owner=alice, kind="eval", status="succeeded", config=run.to_dict(),
                         env_config=config, summary=result.summary)
Rollout.objects.bulk_create(rollout_row(job.pk, 1, r) for r in result.rollouts)
print(job.pk, config.pk)
"""


def test_a_rollout_flagged_in_the_inspector_is_counted(page: Page, stack):
    job_id, config_id = stack.django(EVAL_WITH_ROLLOUTS).split()[-2:]
    page.goto(f"/jobs/{job_id}/rollouts/")
    expect(page.locator("#job-flag-count")).to_have_text("0")
    page.locator("table#rollouts tbody tr[data-rollout-id] a").first.click()
    page.fill("#id_reason", "the oracle's win scored too low")
    page.click("#flag-rollout")
    expect(page.locator("#my-flag")).to_contain_text("the oracle's win scored too low")
    page.goto(f"/jobs/{job_id}/rollouts/")
    expect(page.locator("#job-flag-count")).to_have_text("1")
    expect(page.locator(".flag-mark")).to_have_count(1)
    page.goto(f"/envs/configs/{config_id}/")
    expect(page.locator("#env-flags #flag-count")).to_have_text("1")


def test_an_audit_shows_its_progress_then_its_report(page: Page, stack):
    config_id = stack.django(
        "from django.contrib.auth.models import User\n"
        "from webapp.jobs import services\n"
        "config = services.env_config_save(owner=User.objects.get(username='alice'), "
        "name='rev audit', env_name='reverse_text', params={'max_chars': 40})\n"
        "print(config.pk)"
    ).split()[-1]
    page.goto(f"/envs/configs/{config_id}/")
    page.click("#open-audit")
    page.fill("#id_num_examples", "6")
    page.fill("#id_rollouts_per_step", "65536")
    page.fill("#id_step_seconds", "0.001")
    page.click("#run-audit")
    expect(page.locator("#job-wait")).to_be_visible()
    # The page follows the job and reloads with the report when it ends.
    expect(page.locator("#audit-exploits")).to_be_visible(timeout=120_000)
    expect(page.locator("#audit-warnings")).to_contain_text("verification would bound the step")
    expect(page.locator("#audit-throughput .warn-row")).to_have_count(1)
    expect(page.locator("#audit-json")).to_have_attribute("href", re.compile(r"/report\.json$"))
    screenshot(page, "audit.png")


def test_a_held_out_delta_answers_whether_training_helped(page: Page, stack):
    # The env's own players stand in for a starting and a trained model: no weights to load.
    config_id, base_id, trained_id = stack.django(
        "from django.contrib.auth.models import User\n"
        "from webapp.jobs import services\n"
        "alice = User.objects.get(username='alice')\n"
        "config = services.env_config_save(owner=alice, name='rev delta', "
        "env_name='reverse_text', params={'max_chars': 40})\n"
        "base = services.model_create(owner=alice, name='echo', kind='builtin', location='echo')\n"
        "trained = services.model_create(owner=alice, name='reverser', kind='builtin', "
        "location='oracle')\n"
        "print(config.pk, base.pk, trained.pk)"
    ).split()[-3:]
    page.goto("/delta/")
    page.select_option("#id_env_config", config_id)
    page.select_option("#id_trained", trained_id)
    page.select_option("#id_base", base_id)
    page.fill("#id_num_examples", "12")
    page.click("#run-delta")
    expect(page.locator("#delta-verdict")).to_contain_text("Did training help? yes", timeout=60_000)
    expect(page.locator("#delta-metrics tr[data-metric=reward] td").last).to_have_text("higher")
    screenshot(page, "delta.png")
