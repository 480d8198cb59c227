"""The rollout inspector filters, sorts and draws by what each env declares (its facts and
state views), so the pages know no env by name and a new env needs no migration."""

import asyncio
import re

import pytest
from django.core.management import call_command
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

from rlcore.envs import Fact, SingleTurnEnv, load_environment
from rlcore.envs.registry import ENVIRONMENTS
from rlcore.policy.base import ConstantPolicy
from rlcore.rollout import run_rollouts
from rlcore.rubric import Rubric
from rlcore.types import Example, SamplingParams
from webapp.jobs.models import Job, Rollout
from workers.sink import rollout_row

pytestmark = pytest.mark.django_db

ROW = re.compile(r'<tr data-rollout-id="(\d+)"')
COLORS = ("red", "green", "blue")


def listed(client, url: str) -> list[int]:
    response = client.get(url)
    assert response.status_code == 200, url
    return [int(pk) for pk in ROW.findall(response.content.decode())]


def test_the_inspector_sorts_and_filters_on_a_declared_fact(alice_client, alice_eval):
    rows = list(Rollout.objects.filter(job=alice_eval))
    by_prob = sorted(rows, key=lambda r: (r.facts["random_move_prob"], r.pk))
    base = f"/jobs/{alice_eval.pk}/rollouts/"
    assert listed(alice_client, f"{base}?sort=fact_random_move_prob") == [r.pk for r in by_prob]
    descending = listed(alice_client, f"{base}?sort=-fact_random_move_prob")
    probs = [next(r.facts["random_move_prob"] for r in rows if r.pk == pk) for pk in descending]
    assert probs == sorted(probs, reverse=True) and len(set(probs)) > 1
    middle = by_prob[len(by_prob) // 2].facts["random_move_prob"]
    strong = {r.pk for r in rows if r.facts["random_move_prob"] >= middle}
    assert set(listed(alice_client, f"{base}?fact_random_move_prob_min={middle}")) == strong
    assert 0 < len(strong) < len(rows)
    # The oracle never plays an invalid move.
    assert len(listed(alice_client, f"{base}?fact_invalid_moves_min=1")) == 0
    html = alice_client.get(base).content.decode()
    assert (
        "opponent random p ≥" in html and '<th data-fact="invalid_moves">invalid moves</th>' in html
    )
    # A sort the env does not declare is an error on the form, not silently ignored.
    html = alice_client.get(f"{base}?sort=fact_board").content.decode()
    assert 'data-testid="error-sort"' in html and not ROW.search(html)


def test_the_api_filters_and_sorts_on_a_fact(alice_client, alice_eval):
    url = f"/api/jobs/{alice_eval.pk}/rollouts/"
    results = alice_client.get(url, {"sort": "-fact_random_move_prob"}).json()["results"]
    probs = [r["facts"]["random_move_prob"] for r in results]
    assert probs == sorted(probs, reverse=True) and len(probs) == 8
    weak = alice_client.get(url, {"fact_random_move_prob_max": probs[5]}).json()
    assert weak["count"] == sum(p <= probs[5] for p in probs) < 8
    assert {r["facts"]["invalid_moves"] for r in results} == {0}
    assert alice_client.get(url, {"fact_invalid_moves_max": 0}).json()["count"] == 8


class ColorEnv(SingleTurnEnv):
    """A one-line env for this test: say the colour asked for."""

    name = "colors"
    facts = [
        Fact("color", "colour", "str", "The colour asked for."),
        Fact("size", "size", "int", "How many times to say it."),
    ]

    def build_rubric(self) -> Rubric:
        rubric = Rubric()
        rubric.add(self.said_it, name="said_it", bounds=(0.0, 1.0))
        return rubric

    @staticmethod
    def said_it(*, completion, example, **_) -> float:
        return float(example.info["color"] in (completion[-1].get("content") or ""))

    def make_example(self, index: int, seed: int) -> Example:
        color = COLORS[index % len(COLORS)]
        return Example(
            id=index,
            seed=seed,
            prompt=[{"role": "user", "content": f"Say {color}."}],
            info={"color": color, "size": index},
        )

    def setup_state(self, example: Example) -> dict:
        return {"asked": example.info["color"]}

    def rollout_values(self, rollout) -> dict:
        return {"color": rollout.info.get("color"), "size": rollout.info.get("size")}

    @classmethod
    def state_views(cls, state: dict) -> list[dict]:
        return [{"kind": "text", "title": "asked for", "text": f"colour: {state.get('asked')}"}]


def test_a_new_env_with_a_fact_needs_no_migration(alice, alice_client, monkeypatch):
    monkeypatch.setitem(ENVIRONMENTS, "colors", f"{__name__}:ColorEnv")
    env = load_environment("colors")
    rollouts = asyncio.run(
        run_rollouts(env, ConstantPolicy("red"), env.examples(6, seed=0), sampling=SamplingParams())
    )
    job = Job.objects.create(owner=alice, kind="eval", status="succeeded", config={"env": "colors"})
    Rollout.objects.bulk_create(rollout_row(job.pk, 1, r) for r in rollouts)
    url = f"/api/jobs/{job.pk}/rollouts/"
    red = alice_client.get(url, {"fact_color": "red", "sort": "-fact_size"}).json()["results"]
    assert [r["facts"] for r in red] == [{"color": "red", "size": 3}, {"color": "red", "size": 0}]
    assert all(r["reward"] == 1.0 for r in red)
    big = alice_client.get(url, {"fact_size_min": 4}).json()["results"]
    assert sorted(r["facts"]["size"] for r in big) == [4, 5]
    html = alice_client.get(f"/jobs/{job.pk}/rollouts/").content.decode()
    assert '<th data-fact="color">colour</th>' in html and 'name="fact_size_min"' in html
    assert "opponent" not in html  # nothing of tic-tac-toe's on another env's page
    detail = alice_client.get(f"/jobs/{job.pk}/rollouts/{red[0]['id']}/").content.decode()
    assert "<pre>colour: red</pre>" in detail and "asked for" in detail
    # The models and the migrations agree: storing a new env's facts needed no new one.
    call_command("makemigrations", "jobs", "--check", "--dry-run", verbosity=0)


@pytest.mark.django_db(transaction=True)
def test_the_migration_moves_the_old_columns_into_facts_and_back(alice):
    before, after = [("jobs", "0002_api_keys_attempts_lost")], [("jobs", "0003_rollout_facts")]
    executor = MigrationExecutor(connection)
    try:
        executor.migrate(before)
        old = MigrationExecutor(connection).loader.project_state(before).apps
        job = old.get_model("jobs", "Job").objects.create(owner_id=alice.pk, kind="eval", config={})
        OldRollout = old.get_model("jobs", "Rollout")
        tictactoe = OldRollout.objects.create(
            job=job, step=1, example_id=0, invalid_moves=2, random_move_prob=0.25
        )
        other = OldRollout.objects.create(job=job, step=1, example_id=1)
        executor = MigrationExecutor(connection)
        executor.migrate(after)
        new = executor.loader.project_state(after).apps.get_model("jobs", "Rollout")
        assert new.objects.get(pk=tictactoe.pk).facts == {
            "invalid_moves": 2,
            "random_move_prob": 0.25,
        }
        assert new.objects.get(pk=other.pk).facts == {}
        if connection.vendor == "postgresql":
            with connection.cursor() as cursor:
                cursor.execute("SELECT indexdef FROM pg_indexes WHERE tablename = 'jobs_rollout'")
                assert any("gin (facts jsonb_path_ops)" in row[0] for row in cursor.fetchall())
        executor = MigrationExecutor(connection)
        executor.migrate(before)
        back = OldRollout.objects.get(pk=tictactoe.pk)
        assert (back.invalid_moves, back.random_move_prob) == (2, 0.25)
        assert OldRollout.objects.get(pk=other.pk).invalid_moves is None
    finally:
        executor = MigrationExecutor(connection)
        executor.migrate(executor.loader.graph.leaf_nodes())
