"""Forms built from schemas, and the services' checks: env params, model paths, API key
names, job configs and queues."""

import pytest
from django.core.exceptions import ValidationError

from rlcore.train.config import BOUNDS, RLConfig, config_schema
from tests.lab_fixtures import job_form_data
from webapp.jobs import services
from webapp.jobs.forms import NOT_IN_FORM, EnvConfigForm, JobForm
from webapp.jobs.models import ApiKey, EnvironmentConfig, Job, ModelEntry

pytestmark = pytest.mark.django_db


def test_env_form_is_built_from_the_schema():
    form = EnvConfigForm(env_name="tictactoe")
    html = form.as_p()
    max_turns = form.fields["param_max_turns"]
    assert (max_turns.min_value, max_turns.max_value, max_turns.initial) == (1, 30, 10)
    assert 'type="number"' in html and 'min="1"' in html and 'max="30"' in html
    assert '<select name="param_model_mark"' in html and '<option value="random"' in html
    assert "Most model replies per game" in html  # the param's help text


def test_env_form_reports_range_errors_under_the_field():
    data = {"name": "bad", "param_max_turns": "99", "param_min_random_move_prob": "0",
            "param_max_random_move_prob": "1", "param_num_groups": "4", "param_model_mark": "X",
            "param_invalid_move_penalty": "0.1", "param_invalid_penalty_cap": "0.5"}  # fmt: skip
    form = EnvConfigForm(data, env_name="tictactoe")
    assert not form.is_valid()
    assert "param_max_turns" in form.errors


def test_env_form_puts_the_envs_cross_field_error_on_the_field():
    data = {"name": "inverted", "param_max_turns": "10", "param_min_random_move_prob": "0.9",
            "param_max_random_move_prob": "0.1", "param_num_groups": "4", "param_model_mark": "X",
            "param_invalid_move_penalty": "0.1", "param_invalid_penalty_cap": "0.5"}  # fmt: skip
    form = EnvConfigForm(data, env_name="tictactoe")
    assert not form.is_valid()
    assert "must be at most max_random_move_prob" in form.errors["param_min_random_move_prob"][0]


def test_env_config_save_fills_defaults_and_rejects_unknown_params(alice):
    config = services.env_config_save(
        owner=alice, name="c", env_name="tictactoe", params={"max_turns": 5}
    )
    assert config.params["max_turns"] == 5 and config.params["num_groups"] == 4
    with pytest.raises(services.ParamError) as caught:
        services.env_config_save(owner=alice, name="d", env_name="tictactoe", params={"nope": 1})
    assert "nope" in caught.value.errors
    assert not EnvironmentConfig.objects.filter(name="d").exists()


def test_a_model_path_outside_model_roots_is_rejected(alice, tmp_path):
    with pytest.raises(ValidationError) as caught:
        services.model_create(owner=alice, name="etc", kind="checkpoint", location="/etc")
    assert "is not one you may use" in caught.value.message_dict["location"][0]
    assert not ModelEntry.objects.filter(name="etc").exists()


def test_a_built_in_tiny_model_is_one_of_the_shipped_names(alice):
    assert services.model_create(owner=alice, name="t", kind="tiny").location == "tiny"
    master = services.model_create(owner=alice, name="m", kind="tiny", location="tiny-master")
    assert master.policy_args() == {"model": "tiny-master"}
    with pytest.raises(ValidationError) as caught:
        services.model_create(owner=alice, name="x", kind="tiny", location="/etc/passwd")
    message = caught.value.message_dict["location"][0]
    assert "tiny, tiny-bpe, tiny-bpe-3l, tiny-master" in message and "/etc/passwd" in message
    assert not ModelEntry.objects.filter(name="x").exists()


def test_a_symlink_out_of_model_roots_is_rejected(alice, settings, real_services):
    link = real_services / "escape"
    link.symlink_to("/etc")
    with pytest.raises(ValidationError) as caught:
        services.model_create(owner=alice, name="escape", kind="checkpoint", location=str(link))
    assert "location" in caught.value.message_dict


def test_a_checkpoint_dir_of_ones_own_job_is_accepted(alice, real_services):
    job = Job.objects.create(owner=alice, kind="sft", status="succeeded")
    directory = real_services / f"job-{job.pk}" / "final"
    directory.mkdir(parents=True)
    entry = services.model_create(
        owner=alice, name="ok", kind="checkpoint", location=str(directory)
    )
    assert entry.location == str(directory.resolve())


def test_hub_ids_and_endpoint_fields_are_checked(alice):
    with pytest.raises(ValidationError) as caught:
        services.model_create(owner=alice, name="hub", kind="hf", location="not a hub id!")
    assert "hub id" in caught.value.message_dict["location"][0]
    with pytest.raises(ValidationError) as caught:
        services.model_create(
            owner=alice, name="api", kind="openai", location="m", base_url="ftp://x"
        )
    assert "base_url" in caught.value.message_dict
    hub = services.model_create(owner=alice, name="qwen", kind="hf", location="Qwen/Qwen2.5-0.5B")
    assert hub.policy_args() == {"model": "Qwen/Qwen2.5-0.5B"}


def test_a_pasted_api_key_is_refused_and_never_stored_or_shown(alice_client):
    secret = "sk-live-0123456789abcdef"
    for field in ("api_key", "location", "base_url"):
        data = {"name": "gpt", "kind": "openai", "location": "gpt-4o-mini",
                "base_url": "https://api.example.com/v1"}  # fmt: skip
        data[field] = secret
        response = alice_client.post("/models/", data)
        assert response.status_code == 200
        assert secret not in response.content.decode()
        assert "looks like an API key" in response.content.decode()
        assert not ModelEntry.objects.filter(name="gpt").exists()


def test_an_endpoint_picks_a_declared_key_by_name_and_only_for_its_url(alice_client):
    ApiKey.objects.create(name="example", env_var="MY_ENDPOINT_KEY",
                          base_url="https://api.example.com/v1")  # fmt: skip
    other_url = alice_client.post(
        "/models/",
        {"name": "gpt", "kind": "openai", "location": "gpt-4o-mini",
         "base_url": "http://127.0.0.1:8099/v1", "api_key": "example"},
    )  # fmt: skip
    assert other_url.status_code == 200
    assert "may only be sent to https://api.example.com/v1" in other_url.content.decode()
    response = alice_client.post(
        "/models/",
        {"name": "gpt", "kind": "openai", "location": "gpt-4o-mini",
         "base_url": "https://api.example.com/v1/", "api_key": "example"},
    )  # fmt: skip
    assert response.status_code == 302
    entry = ModelEntry.objects.get(name="gpt")
    assert entry.policy_args() == {
        "model": "gpt-4o-mini",
        "base_url": "https://api.example.com/v1/",
        "api_key_env": "MY_ENDPOINT_KEY",
    }
    keyless = services.model_create(
        owner=entry.owner, name="local", kind="openai", location="m",
        base_url="http://127.0.0.1:8000/v1",
    )  # fmt: skip
    assert keyless.policy_args()["api_key_env"] == ""


def test_job_form_defaults_come_from_the_kind(alice):
    form = JobForm(kind="rl", user=alice)
    assert form.fields["loss__type"].initial in ("grpo", "cispo", "dr_grpo")
    assert "loss__beta" in form.fields and "save_every" in form.fields
    assert "num_examples" not in form.fields
    # The recipe's credit assignment is the form's default; both estimators are offered.
    assert form.fields["advantage"].initial == "tree"
    assert [value for value, _ in form.fields["advantage"].choices] == ["group", "tree", "none"]
    assert form.fields["loss__aggregation"].initial == "turn"
    # Bounds and help come from rlcore's config: one place, no copy in the web code.
    assert form.fields["optimizer__lr"].max_value == BOUNDS["lr"][1]
    assert "peak learning rate" in form.fields["optimizer__lr"].help_text
    # Every setting of the config class is in the form, featured or under "All settings".
    names = {row["name"] for row in config_schema(RLConfig)} - NOT_IN_FORM
    assert {f.name.replace("__", ".") for f in [*form.kind_fields, *form.more_fields,
            *form.common_fields[2:]]} == names  # fmt: skip


def test_env_form_leaves_a_blank_number_or_a_missing_choice_at_its_default():
    data = {"name": "defaults", "param_max_turns": "", "param_min_random_move_prob": "0.1",
            "param_max_random_move_prob": "0.9", "param_num_groups": "4", "param_model_mark": "X",
            "param_invalid_move_penalty": "0.1", "param_invalid_penalty_cap": "0.5"}  # fmt: skip
    form = EnvConfigForm(data, env_name="tictactoe")
    assert form.is_valid(), form.errors
    assert form.params()["max_turns"] == 10 and form.params()["opening_moves"] == 0
    # `reasoning` (a choice) is not in the post: a form from before it existed.
    assert form.params()["reasoning"] == "empty"
    threats = EnvConfigForm({**data, "param_reasoning": "threats"}, env_name="tictactoe")
    assert threats.is_valid() and threats.params()["reasoning"] == "threats"
    bad = EnvConfigForm({**data, "param_opening_moves": "9"}, env_name="tictactoe")
    assert not bad.is_valid() and "param_opening_moves" in bad.errors
    bad = EnvConfigForm({**data, "param_reasoning": "vibes"}, env_name="tictactoe")
    assert not bad.is_valid() and "param_reasoning" in bad.errors


def test_job_form_reports_missing_and_out_of_range_fields(alice, ttt_config, tiny):
    form = JobForm(
        {"env_config": ttt_config.pk, "device": "cpu", "seed": "0", "num_examples": "0",
         "rollouts_per_example": "1", "max_tokens": "24", "temperature": "0.5", "concurrency": "4"},
        kind="eval", user=alice,
    )  # fmt: skip
    assert not form.is_valid()
    assert "model" in form.errors and "num_examples" in form.errors


def test_job_form_only_offers_the_users_own_configs_and_models(alice, bob, ttt_config, tiny):
    form = JobForm(kind="eval", user=bob)
    assert list(form.fields["env_config"].queryset) == []
    assert list(form.fields["model"].queryset) == []


def test_job_create_stores_the_resolved_config_and_picks_the_queue(
    alice, ttt_config, tiny, gpu_node, django_capture_on_commit_callbacks
):
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        job = services.job_create(
            owner=alice, kind="rl", env_config=ttt_config, model=tiny,
            options={"batch_size": 4, "rollouts_per_example": 2, "max_steps": 2, "device": "cuda"},
        )  # fmt: skip
    assert len(callbacks) == 1  # enqueued only once the transaction commits
    assert job.queue == "gpu" and job.status == Job.Status.QUEUED
    assert job.config["env"] == "tictactoe" and job.config["env_args"]["max_turns"] == 6
    assert job.config["batch_size"] == 4 and job.config["model"] == "tiny"
    assert job.config["output_dir"].endswith(f"job-{job.pk}")
    # Every setting resolved, sections as nested tables.
    assert job.config["optimizer"]["lr"] > 0 and "clip_eps_high" in job.config["loss"]


def test_rlcores_own_validation_becomes_a_form_error(alice, ttt_config, tiny):
    with pytest.raises(ValidationError) as caught:
        services.job_create(
            owner=alice, kind="rl", env_config=ttt_config, model=tiny,
            options={"batch_size": 5, "rollouts_per_example": 2},
        )  # fmt: skip
    assert "must be a multiple of rollouts_per_example" in caught.value.messages[0]
    assert not Job.objects.exists()


def test_training_a_builtin_player_is_refused(alice, ttt_config, oracle):
    with pytest.raises(ValidationError) as caught:
        services.job_create(owner=alice, kind="rl", env_config=ttt_config, model=oracle)
    assert "trains local weights" in caught.value.message_dict["model"][0]


def test_an_unknown_builtin_player_names_what_the_env_offers(alice, ttt_config):
    ghost = services.model_create(owner=alice, name="ghost", kind="builtin", location="ghost")
    with pytest.raises(ValidationError) as caught:
        services.job_create(owner=alice, kind="eval", env_config=ttt_config, model=ghost)
    assert "oracle" in caught.value.message_dict["model"][0]


def test_bad_overrides_name_the_line(alice, ttt_config, oracle):
    with pytest.raises(ValidationError) as caught:
        services.job_create(
            owner=alice, kind="eval", env_config=ttt_config, model=oracle, overrides="just words"
        )
    assert "line 1" in caught.value.message_dict["overrides"][0]
    with pytest.raises(ValidationError) as caught:
        services.job_create(
            owner=alice, kind="eval", env_config=ttt_config, model=oracle, overrides="colour=blue"
        )
    assert "colour" in caught.value.messages[0]


def test_a_blank_required_number_is_an_error_not_the_default(alice, ttt_config, tiny):
    data = job_form_data(alice, "rl", env_config=ttt_config.pk, model=tiny.pk)
    assert JobForm(data, kind="rl", user=alice).is_valid()  # the control
    # What a browser sends for letters typed into a number field: nothing.
    form = JobForm(data | {"max_steps": ""}, kind="rl", user=alice)
    assert not form.is_valid() and "max_steps" in form.errors
    # An optional number says so and may stay blank.
    synth = job_form_data(alice, "synth", env_config=ttt_config.pk, model=tiny.pk, max_kept="")
    form = JobForm(synth, kind="synth", user=alice)
    assert form.is_valid(), form.errors
    assert "(blank: none)" in form.fields["max_kept"].help_text


def test_the_job_form_starts_from_what_the_user_ran_last(alice, bob, ttt_config, tiny, oracle):
    other = services.env_config_save(owner=alice, name="other", env_name="tictactoe", params={})
    form = JobForm(kind="eval", user=alice)
    # Nothing run yet: the newest config and model.
    assert (form.fields["env_config"].initial, form.fields["model"].initial) == (
        other.pk,
        oracle.pk,
    )
    Job.objects.create(owner=alice, kind="eval", env_config=ttt_config, model=tiny)
    form = JobForm(kind="eval", user=alice)
    assert (form.fields["env_config"].initial, form.fields["model"].initial) == (
        ttt_config.pk,
        tiny.pk,
    )
    # Options are named once, and labels are capitalised alike.
    assert [label for _, label in form.fields["env_config"].choices][1:] == ["other", "ttt"]
    assert all(str(f.label)[0].isupper() for f in form.fields.values())
    assert JobForm(kind="eval", user=bob).fields["model"].initial is None


def test_sft_offers_the_users_own_synth_datasets_newest_first(alice, bob, real_services):
    paths = []
    for owner in (alice, alice, bob):
        job = Job.objects.create(owner=owner, kind="synth", status="succeeded")
        path = real_services / f"job-{job.pk}" / "dataset.jsonl"
        job.result = {"path": str(path), "kept": 5}
        job.save()
        paths.append(str(path))
    choices = [value for value, _ in JobForm(kind="sft", user=alice).fields["dataset"].choices]
    assert choices == ["", paths[1], paths[0]]
    assert JobForm(kind="sft", user=bob).fields["dataset"].choices[1][0] == paths[2]


def test_sft_starts_from_the_model_its_recipe_names_when_the_user_has_it(alice, tiny):
    # Without a `tiny-bpe-3l` entry the form keeps its usual choice (the newest model).
    assert JobForm(kind="sft", user=alice).fields["model"].initial == tiny.pk
    small = services.model_create(owner=alice, name="3l", kind="tiny", location="tiny-bpe-3l")
    bpe = services.model_create(owner=alice, name="bpe", kind="tiny", location="tiny-bpe")
    services.model_create(owner=alice, name="newer", kind="tiny", location="tiny")
    # The default SFT recipe is the CPU variant's (3 layers); sft.toml (the GPU profile's)
    # is offered beside it and starts from `tiny-bpe`.
    assert services.recipe_names("sft") == ["sft_cpu", "sft"]
    assert services.recipe_values("sft")["model"] == "tiny-bpe-3l"
    assert JobForm(kind="sft", user=alice).fields["model"].initial == small.pk
    assert JobForm(kind="sft", user=alice, recipe="sft").fields["model"].initial == bpe.pk
    assert JobForm(kind="rl", user=alice).fields["model"].initial not in (small.pk, bpe.pk)


def test_retries_and_requeues_say_where_they_came_from(alice, ttt_config, oracle, alice_client):
    job = Job.objects.create(owner=alice, kind="eval", status="failed", env_config=ttt_config,
                             model=oracle, config={"env": "tictactoe", "out_dir": "/x"})  # fmt: skip
    assert job.title == "tictactoe · oracle"
    retried = services.job_retry(job=job)
    assert retried.title == f"tictactoe · oracle · retry of #{job.pk}"
    services.job_requeue(job=job)
    job.refresh_from_db()
    assert job.title == "tictactoe · oracle · attempt 2"
    listed = alice_client.get("/jobs/").content.decode()
    assert f"retry of #{job.pk}" in listed and "attempt 2" in listed
    detail = alice_client.get(f"/jobs/{retried.pk}/").content.decode()
    assert f'href="/jobs/{job.pk}/">job #{job.pk}</a>' in detail


def test_an_rl_job_starts_from_the_best_cpu_recipe_and_offers_the_gpu_one(alice, ttt_config, tiny):
    assert services.recipe_names("rl")[0] == "rl_sound"
    assert set(services.recipe_names("rl")) == {"rl", "rl_gpu", "rl_sound"}
    assert services.recipe_names("eval") == ["eval"]
    form = JobForm(kind="rl", user=alice)
    assert form.recipe == "rl_sound" and form.fields["recipe"].initial == "rl_sound"
    assert form.fields["sound_mass_weight"].initial == 1.0
    gpu = JobForm(kind="rl", user=alice, recipe="rl_gpu")
    assert gpu.fields["batch_size"].initial == 256
    assert gpu.fields["optimizer__lr"].initial == 3e-4
    # The recipe's settings reach the job's config, its env_args too where the environment
    # config leaves a parameter at the env's default; what the config sets wins.
    config = services.job_config_resolve(
        owner=alice, kind="rl", env_config=ttt_config, model=tiny, options={}, recipe="rl_gpu"
    )
    assert config["batch_size"] == 256 and config["sound_mass_weight"] == 1.0
    assert config["env_args"]["self_play"] == 0.5 and config["env_args"]["opening_moves"] == 2
    assert config["env_args"]["max_turns"] == 6
    own = services.env_config_save(
        owner=alice, name="one opening move", env_name="tictactoe",
        params={"max_turns": 5, "opening_moves": 1, "self_play": 0.25},
    )  # fmt: skip
    mine = services.job_config_resolve(
        owner=alice, kind="rl", env_config=own, model=tiny, options={}, recipe="rl_gpu"
    )
    assert (mine["env_args"]["opening_moves"], mine["env_args"]["self_play"]) == (1, 0.25)
    assert mine["env_args"]["max_turns"] == 5 and mine["env_args"]["num_groups"] == 4
    plain = services.job_config_resolve(
        owner=alice, kind="rl", env_config=ttt_config, model=tiny, options={}, recipe="rl"
    )
    assert plain["batch_size"] == 64 and plain["sound_mass_weight"] == 0.0


@pytest.mark.parametrize("name", ["../rl", "rl_gpu.toml", "/etc/passwd", "sft", "rl_nope"])
def test_a_recipe_that_is_not_one_of_the_kinds_is_refused_on_its_field(
    alice, ttt_config, tiny, name
):
    with pytest.raises(ValidationError) as raised:
        services.job_config_resolve(
            owner=alice, kind="rl", env_config=ttt_config, model=tiny, options={}, recipe=name
        )
    assert "accepted: rl_sound, rl, rl_gpu" in raised.value.message_dict["recipe"][0]
    with pytest.raises(ValidationError):
        JobForm(kind="rl", user=alice, recipe=name)
