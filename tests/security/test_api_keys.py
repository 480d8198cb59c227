"""No secret leaves the server: a user can neither name the environment variable a worker
reads a key from nor choose where a key is sent. Attacks go through the real API and a
real worker, and a listener on loopback tells what actually arrived."""

import pytest

from tests.lab_fixtures import wait_for_job
from tests.security.conftest import DECLARED_KEY, SERVER_SECRET, SERVER_SECRET_VAR
from webapp.jobs import services
from webapp.jobs.models import ApiKey, Job, ModelEntry
from webapp.play.models import Game
from workers.play_tasks import policy_for

pytestmark = [pytest.mark.django_db(transaction=True)]


def _endpoint_model(owner, base_url, **kwargs):
    return services.model_create(
        owner=owner, name="endpoint", kind="openai", location="m", base_url=base_url, **kwargs
    )


def test_job_overrides_cannot_set_the_endpoint_or_the_key_variable(
    alice, alice_client, ttt_config, listener
):
    model = _endpoint_model(alice, listener.base_url)
    for overrides in (
        f"base_url={listener.base_url}\napi_key_env={SERVER_SECRET_VAR}",
        f"api_key_env={SERVER_SECRET_VAR}",
        "base_url=http://127.0.0.1:9/v1",
    ):
        response = alice_client.post(
            "/api/jobs/",
            {"kind": "eval", "model": model.pk, "env_config": ttt_config.pk,
             "overrides": overrides},
            content_type="application/json",
        )  # fmt: skip
        assert response.status_code == 400
        assert "set by the lab" in response.json()["errors"]["overrides"][0]
    response = alice_client.post(
        "/api/jobs/",
        {"kind": "eval", "model": model.pk, "env_config": ttt_config.pk,
         "options": {"api_key_env": SERVER_SECRET_VAR}},
        content_type="application/json",
    )  # fmt: skip
    assert response.status_code == 400 and "api_key_env" in response.json()["errors"]
    assert not Job.objects.exists()


def test_a_declared_key_cannot_be_pointed_at_another_endpoint(alice, listener):
    ApiKey.objects.create(name="openai", env_var=SERVER_SECRET_VAR,
                          base_url="https://api.openai.com/v1")  # fmt: skip
    with pytest.raises(services.ValidationError) as caught:
        _endpoint_model(alice, listener.base_url, api_key="openai")
    assert (
        "may only be sent to https://api.openai.com/v1" in caught.value.message_dict["api_key"][0]
    )
    with pytest.raises(services.ValidationError) as caught:
        _endpoint_model(alice, listener.base_url, api_key=SERVER_SECRET_VAR)
    assert "no API key of that name" in caught.value.message_dict["api_key"][0]
    assert not ModelEntry.objects.exists()


def test_a_tampered_job_row_sends_nothing(alice, ttt_config, listener, celery_worker):
    """Even a config written straight into the database (an old row, a bug elsewhere) does
    not make the worker send a server secret: the worker checks before it connects."""
    model = _endpoint_model(alice, listener.base_url)
    job = services.job_create(
        owner=alice, kind="eval", env_config=ttt_config, model=model,
        options={"num_examples": 1, "max_tokens": 8},
    )  # fmt: skip
    # The worker may already hold the honest job; a second, tampered row is the attack.
    tampered = Job.objects.create(
        owner=alice, kind="eval", env_config=ttt_config, model=model, queue="cpu",
        config={**job.config, "api_key_env": SERVER_SECRET_VAR,
                "out_dir": job.config["out_dir"] + "-tampered"},
        celery_task_id="tampered-" + str(job.pk),
    )  # fmt: skip
    from workers.tasks import run_job

    run_job.apply_async(args=[tampered.pk], queue="cpu", task_id=tampered.celery_task_id)
    tampered = wait_for_job(tampered)
    job = wait_for_job(job)
    assert tampered.status == "failed"
    assert f"refusing to send the key in ${SERVER_SECRET_VAR}" in tampered.error
    assert job.status == "succeeded", job.error
    # The honest job reached the listener without any key; the secret never arrived.
    assert listener.authorizations and all(a == "Bearer EMPTY" for a in listener.authorizations)
    assert not any(SERVER_SECRET in a for a in listener.authorizations)


def test_a_declared_key_reaches_its_own_endpoint(alice, ttt_config, listener, celery_worker):
    ApiKey.objects.create(name="local", env_var="RLLAB_TEST_ENDPOINT_KEY",
                          base_url=listener.base_url)  # fmt: skip
    model = _endpoint_model(alice, listener.base_url, api_key="local")
    job = services.job_create(
        owner=alice, kind="eval", env_config=ttt_config, model=model,
        options={"num_examples": 1, "max_tokens": 8},
    )  # fmt: skip
    job = wait_for_job(job)
    assert job.status == "succeeded", job.error
    assert listener.authorizations and set(listener.authorizations) == {f"Bearer {DECLARED_KEY}"}


def test_a_tampered_game_sends_nothing(alice, listener):
    game = Game(owner=alice, policy={"kind": "openai", "model": "m", "base_url": listener.base_url,
                                     "api_key_env": SERVER_SECRET_VAR})  # fmt: skip
    with pytest.raises(PermissionError, match="refusing to send"):
        policy_for(game.policy)
    assert listener.authorizations == []


def test_staff_declare_a_variable_name_and_an_http_url(carol):
    from django.core.exceptions import ValidationError

    for env_var, base_url in (("sk-proj-0123456789abcdef", "https://api.openai.com/v1"),
                              ("MY KEY", "https://api.openai.com/v1"),
                              ("OPENAI_API_KEY", "file:///etc/passwd")):  # fmt: skip
        with pytest.raises(ValidationError):
            ApiKey(name="k", env_var=env_var, base_url=base_url).full_clean()
    ApiKey(name="k", env_var="OPENAI_API_KEY", base_url="https://api.openai.com/v1").full_clean()
