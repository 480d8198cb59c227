"""An env that scores with an LLM judge says in its config form that a judge of another
model family than the policy's is recommended, and the lab warns when the judge and the
policy are of one family (by the weights' `model_type`, else the model's name). Its
judge's API key goes only to the endpoint staff declared it for."""

import json

import pytest

from rlcore.envs import ParamError
from rlcore.events import RecordingSink
from webapp.jobs import services
from webapp.jobs.models import ApiKey, Job
from workers.tasks import execute

pytestmark = pytest.mark.django_db


def writing_config(owner, judge_model: str):
    return services.env_config_save(
        owner=owner,
        name=f"writing {judge_model}",
        env_name="writing",
        params={
            "judge_base_url": "http://127.0.0.1:9/v1",
            "judge_model": judge_model,
            "judge_api_key_env": "",
        },
    )


def test_the_form_of_a_judged_env_recommends_another_family(alice_client, ttt_config):
    new = alice_client.get("/envs/writing/new/").content.decode()
    assert 'id="judge-advice"' in new and "different model family" in new
    assert 'id="judge-advice"' not in alice_client.get("/envs/tictactoe/new/").content.decode()
    assert (
        'id="judge-advice"' not in alice_client.get(ttt_config.get_absolute_url()).content.decode()
    )


def test_a_judge_of_the_policys_family_is_warned_about(alice, alice_client, tiny):
    # The tiny model is a Qwen2 by its weights, whatever its name.
    same = alice_client.get(writing_config(alice, "Qwen/Qwen2.5-7B-Instruct").get_absolute_url())
    assert 'id="judge-same-family"' in same.content.decode()
    assert "the qwen family" in same.content.decode()
    other = alice_client.get(writing_config(alice, "gpt-4o-mini").get_absolute_url())
    assert 'id="judge-advice"' in other.content.decode()
    assert 'id="judge-same-family"' not in other.content.decode()


def test_a_job_on_a_same_family_judge_carries_a_warning(alice, alice_client, tiny):
    config = writing_config(alice, "qwen2.5-72b")
    body = {"kind": "eval", "env_config": config.pk, "model": tiny.pk,
            "options": {"num_examples": 1}}  # fmt: skip
    answer = alice_client.post("/api/jobs/", json.dumps(body), "application/json")
    assert answer.status_code == 201, answer.json()
    assert "qwen family" in answer.json()["warnings"][0]
    services.job_cancel(job=Job.objects.get(pk=answer.json()["id"]))  # no worker here
    other = writing_config(alice, "llama-3.1-70b")
    body["env_config"] = other.pk
    answer = alice_client.post("/api/jobs/", json.dumps(body), "application/json")
    assert answer.json()["warnings"] == []
    services.job_cancel(job=Job.objects.get(pk=answer.json()["id"]))


def test_families_come_from_model_type_then_name(alice, tmp_path, settings):
    assert services.model_family("Qwen/Qwen2.5-0.5B-Instruct") == "qwen"
    assert services.model_family("meta-llama/Llama-3.1-8B") == "llama"
    assert services.model_family("mixtral-8x7b") == "mistral"
    assert services.model_family("gpt-4o-mini") == services.model_family("o3-mini") == "gpt"
    # A checkpoint directory named for nothing in particular: its config says Llama.
    weights = tmp_path / "my-run"
    weights.mkdir()
    (weights / "config.json").write_text(json.dumps({"model_type": "llama"}))
    settings.MODEL_ROOTS = [str(tmp_path)]
    entry = services.model_create(
        owner=alice, name="mine", kind="checkpoint", location=str(weights)
    )
    assert services.model_entry_family(entry) == "llama"


def test_a_judge_key_goes_only_where_staff_declared_it(alice, alice_client):
    post = {"name": "leak", "param_judge_base_url": "https://attacker.example/v1",
            "param_judge_model": "m", "param_judge_api_key_env": "SECRET_KEY",
            "param_mode": "pointwise", "param_judge_max_tokens": 64, "param_max_words": 80,
            "param_length_penalty": 0}  # fmt: skip
    page = alice_client.post("/envs/writing/new/", post)
    errors = page.context["form"].errors
    assert (
        "param_judge_api_key_env" in errors and "SECRET_KEY" in errors["param_judge_api_key_env"][0]
    )
    assert not alice.environmentconfig_set.exists()
    # The key staff declared for that judge's endpoint may go there.
    ApiKey.objects.create(name="judge", env_var="JUDGE_KEY", base_url="https://judge.example/v1")
    post |= {
        "param_judge_base_url": "https://judge.example/v1",
        "param_judge_api_key_env": "JUDGE_KEY",
    }
    assert alice_client.post("/envs/writing/new/", post).status_code == 302

    # Nor through a job's overrides...
    config = writing_config(alice, "gpt-4o-mini")
    tiny = services.model_create(owner=alice, name="tiny", kind="tiny")
    body = {"kind": "eval", "env_config": config.pk, "model": tiny.pk,
            "overrides": "env_args.judge_api_key_env=DATABASE_URL"}  # fmt: skip
    answer = alice_client.post("/api/jobs/", json.dumps(body), "application/json")
    assert answer.status_code == 400
    assert "DATABASE_URL" in answer.json()["errors"]["env_args.judge_api_key_env"][0]
    # ...nor from a config stored before the check: the worker refuses to run it.
    job = Job.objects.create(owner=alice, kind="eval", env_config=config, model=tiny, config={
        "env": "writing", "model": "tiny", "env_args": config.params | {
            "judge_base_url": "https://attacker.example/v1", "judge_api_key_env": "SECRET_KEY"}})  # fmt: skip
    with pytest.raises(ParamError, match="SECRET_KEY"):
        execute(job, RecordingSink())
