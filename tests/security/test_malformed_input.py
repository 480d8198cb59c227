"""Bad input never gets a 500: hostile JSON bodies, numbers of thousands of digits, NaN and
Infinity, ids past 64 bits and names past the file system's limits each get a 4xx (or the
form again) naming what was wrong; and the JSON API refuses exactly what the form refuses.

Django's test client raises a view's exception instead of returning a 500, so a crash
fails the test where it happens."""

import pytest

from tests.lab_fixtures import job_form_data
from webapp.jobs.models import Job

pytestmark = pytest.mark.django_db

DEEP = "[" * 100_000
HUGE = "9" * 5000


@pytest.fixture
def lab(alice, ttt_config, tiny, alice_eval):
    return {"ttt": ttt_config.pk, "tiny": tiny.pk, "eval": alice_eval.pk}


def _post(client, url, raw: str):
    return client.post(url, raw, content_type="application/json")


def _field_errors(response) -> dict:
    assert 400 <= response.status_code < 500, (response.status_code, response.content[:300])
    errors = response.json()["errors"]
    assert errors and all(isinstance(v, list) and v for v in errors.values())
    return errors


def test_hostile_job_bodies_are_400s_naming_the_field(alice_client, lab):
    bodies = {
        DEEP: "body",
        '{"kind": "eval", "options": ' + DEEP + "}": "body",
        '{"kind": "eval", "model": ' + HUGE + "}": "body",
        f'{{"kind": "rl", "model": {lab["tiny"]}, "options": {{"lr": NaN}}}}': "body",
        f'{{"kind": "rl", "model": {lab["tiny"]}, "options": {{"lr": Infinity}}}}': "body",
        b"\xff\xfe".decode("latin-1"): "body",
    }
    for raw, field in bodies.items():
        assert field in _field_errors(_post(alice_client, "/api/jobs/", raw)), raw[:60]
    assert not Job.objects.exclude(pk=lab["eval"]).exists()


@pytest.mark.parametrize(
    ("settings_", "field"),
    [
        ({"options": {"max_steps": 1e308}}, "max_steps"),
        ({"options": {"max_tokens": 1e308}}, "max_tokens"),
        ({"options": {"seed": -1}}, "seed"),
        ({"options": {"lr": 1e308}}, "lr"),
        ({"options": {"max_steps": 2**40}}, "max_steps"),
        ({"options": {"max_steps": int(HUGE[:30])}}, "body"),
        ({"options": {"colour": "blue"}}, "colour"),
        ({"overrides": "env_args.max_turns=1e308"}, "env_args.max_turns"),
        ({"overrides": "env_args.think_reward=1e308"}, "env_args.think_reward"),
        ({"overrides": "env_args.nope=1"}, "env_args.nope"),
        ({"overrides": "lr=NaN"}, "overrides"),
        ({"overrides": "lr=Infinity"}, "overrides"),
        ({"overrides": "lr=1e999"}, "overrides"),
        ({"overrides": "max_steps=" + HUGE}, "overrides"),
        ({"overrides": "curriculum_order=" + DEEP}, "overrides"),
        ({"overrides": "colour=blue"}, "overrides"),
    ],
)
def test_the_api_refuses_what_the_form_refuses(alice, alice_client, lab, settings_, field):
    body = {"kind": "rl", "model": lab["tiny"], "env_config": lab["ttt"], **settings_}
    response = alice_client.post("/api/jobs/", body, content_type="application/json")
    assert field in _field_errors(response)
    option = next(iter(settings_.get("options", {})), None)
    if option in ("max_steps", "max_tokens", "seed", "lr"):
        # The form says no to the same value, under the same field.
        data = job_form_data(alice, "rl", env_config=lab["ttt"], model=lab["tiny"])
        name = {"lr": "optimizer__lr", "max_tokens": "sampling__max_tokens"}.get(option, option)
        form = alice_client.post("/jobs/new/?kind=rl", data | {name: settings_["options"][option]})
        assert alice_client.post("/jobs/new/?kind=rl", data).status_code == 302  # the control
        assert form.status_code == 200
        assert name in form.context["form"].errors


def test_hostile_env_config_forms_are_form_errors(alice_client):
    for name, value in (("think_reward", "1e308"), ("invalid_move_penalty", "1e308"),
                        ("invalid_penalty_cap", "Infinity"), ("max_turns", HUGE)):  # fmt: skip
        response = alice_client.post(
            "/envs/tictactoe/new/", {"name": "bad", f"param_{name}": value}
        )
        assert response.status_code == 200
        assert f"param_{name}" in response.context["form"].errors


def test_hostile_query_strings_and_ids_are_not_500s(alice_client, lab):
    job = lab["eval"]
    for url in (
        "/compare/?jobs=99999999999999999999999",
        f"/compare/?jobs={HUGE}",
        f"/jobs/{job}/rollouts/?step=99999999999999999999999",
        f"/jobs/{job}/rollouts/?example=99999999999999999999999",
        f"/jobs/{job}/rollouts/compare/?id=99999999999999999999999&id=1",
        "/jobs/99999999999999999999999/",
        f"/api/jobs/{job}/metrics/?since={HUGE}",
        f"/api/jobs/{job}/metrics/?since=99999999999999999999999",
        f"/api/jobs/{job}/rollouts/?step=99999999999999999999999",
        f"/api/jobs/{job}/logs/?after=99999999999999999999999",
        f"/api/jobs/{job}/updates/?since=99999999999999999999999",
        f"/envs/tictactoe/new/?seed={HUGE}",
    ):
        response = alice_client.get(url)
        assert response.status_code in (200, 302, 400, 404), (url, response.status_code)


def test_hostile_play_bodies_are_400s(alice_client):
    game = alice_client.post(
        "/play/api/games/", {"player": "builtin-random"}, content_type="application/json"
    ).json()
    url = f"/play/api/games/{game['id']}/move/"
    for raw in (DEEP, '{"cell": ' + HUGE + "}", '{"cell": NaN}', '{"cell": 1e308}',
                '{"cell": [[[[1]]]]}', '{"cell": "four"}'):  # fmt: skip
        errors = _field_errors(_post(alice_client, url, raw))
        assert set(errors) & {"body", "cell"}, raw[:40]
    assert _field_errors(_post(alice_client, "/play/api/games/", DEEP)) == {
        "body": [f"JSON nested deeper than {20} levels"]
    }
