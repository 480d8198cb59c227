"""The pages: environments with schema-built forms and previews, models, the job form,
the job page, the inspector, rollout detail and compare, runs compare, static files."""

import json
import re
from pathlib import Path

import pytest
from django.contrib.staticfiles import finders

from tests.lab_fixtures import job_form_data
from webapp.jobs.models import EnvironmentConfig, Job, ModelEntry, Rollout

pytestmark = pytest.mark.django_db


def page(client, url, status=200) -> str:
    response = client.get(url)
    assert response.status_code == status, (url, response.status_code)
    return response.content.decode()


def test_the_nav_links_every_section(alice_client):
    html = page(alice_client, "/envs/")
    for label in ("Environments", "Models", "New job", "Jobs", "Compare", "Play"):
        assert f">{label}<" in html, label


def test_environments_list_registered_envs_with_their_params(alice_client):
    html = page(alice_client, "/envs/")
    assert 'id="env-tictactoe"' in html and "min_random_move_prob" in html
    assert "Opponent-strength bins" in html


def test_creating_an_env_config_from_the_form(alice_client, alice):
    html = page(alice_client, "/envs/tictactoe/new/")
    assert 'name="param_max_turns"' in html and "Your move." in html  # form and board preview
    data = {"name": "weak opponent", "param_max_turns": "8", "param_min_random_move_prob": "0.5",
            "param_max_random_move_prob": "1", "param_num_groups": "2", "param_model_mark": "O",
            "param_invalid_move_penalty": "0.1", "param_invalid_penalty_cap": "0.5"}  # fmt: skip
    response = alice_client.post("/envs/tictactoe/new/", data)
    config = EnvironmentConfig.objects.get(owner=alice, name="weak opponent")
    assert response.status_code == 302 and response["Location"] == f"/envs/configs/{config.pk}/"
    assert config.params["model_mark"] == "O" and config.params["num_groups"] == 2
    # The edit page previews the config's own examples: the model plays O.
    assert "You play tic-tac-toe as O" in page(alice_client, response["Location"])


def test_bad_env_params_come_back_as_field_errors(alice_client):
    data = {"name": "x", "param_max_turns": "8", "param_min_random_move_prob": "0.9",
            "param_max_random_move_prob": "0.2", "param_num_groups": "2", "param_model_mark": "O",
            "param_invalid_move_penalty": "0.1", "param_invalid_penalty_cap": "0.5"}  # fmt: skip
    html = alice_client.post("/envs/tictactoe/new/", data).content.decode()
    assert 'data-testid="error-param_min_random_move_prob"' in html
    assert not EnvironmentConfig.objects.exists()


def test_an_unknown_environment_is_a_404(alice_client):
    page(alice_client, "/envs/chess/new/", status=404)


def test_registering_the_tiny_model(alice_client, alice):
    response = alice_client.post("/models/", {"name": "tiny", "kind": "tiny", "temperature": "0.7"})
    assert response.status_code == 302
    entry = ModelEntry.objects.get(owner=alice)
    assert (entry.location, entry.generation) == ("tiny", {"temperature": 0.7})
    assert f'data-model-id="{entry.pk}"' in page(alice_client, "/models/")


def test_the_model_form_shows_the_model_roots_error(alice_client):
    html = alice_client.post(
        "/models/", {"name": "x", "kind": "checkpoint", "location": "/etc"}
    ).content.decode()
    assert 'data-testid="error-location"' in html and "MODEL_ROOTS" in html


def test_the_job_form_has_a_tab_per_kind_with_recipe_defaults(alice_client, ttt_config, tiny):
    html = page(alice_client, "/jobs/new/?kind=rl")
    assert re.search(r'data-kind="rl"\s+class="active"', html)
    for field in (
        "max_steps",
        "batch_size",
        "rollouts_per_example",
        "loss__type",
        "advantage",
        "loss__aggregation",
        "optimizer__lr",
        "loss__beta",
        "save_every",
    ):
        assert f'name="{field}"' in html, field
    assert 'name="num_examples"' not in page(alice_client, "/jobs/new/?kind=rl")
    assert 'name="dataset"' in page(alice_client, "/jobs/new/?kind=sft")


def test_submitting_the_job_form_queues_a_job(
    alice, alice_client, ttt_config, oracle, django_capture_on_commit_callbacks
):
    data = job_form_data(alice, "eval", env_config=ttt_config.pk, model=oracle.pk, seed="3",
                         num_examples="5", rollouts_per_example="2", max_tokens="24")  # fmt: skip
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        response = alice_client.post("/jobs/new/", data)
    job = Job.objects.get()
    assert response.status_code == 302 and response["Location"] == f"/jobs/{job.pk}/"
    assert (
        job.config["rollouts_per_example"] == 2 and job.config["seed"] == 3 and len(callbacks) == 1
    )


def test_job_form_errors_are_shown(alice, alice_client, ttt_config, oracle):
    data = job_form_data(alice, "rl", env_config=ttt_config.pk, model=oracle.pk)
    html = alice_client.post("/jobs/new/", data).content.decode()
    assert 'data-testid="error-model"' in html and "trains local weights" in html
    assert not Job.objects.exists()


def test_the_job_page_has_the_live_parts_and_the_summary(alice_client, alice_eval):
    html = page(alice_client, f"/jobs/{alice_eval.pk}/")
    for element in ('id="job-status"', 'id="progress"', 'id="metric-charts"', 'id="rollout-feed"',
                    'id="log-tail"', 'id="ema"', 'id="x-axis"', 'id="summary-outcomes"'):  # fmt: skip
        assert element in html, element
    assert 'data-outcome="win"' in html and "/static/vendor/plotly/plotly.min.js" in html
    live = json.loads(
        re.search(r'<script id="job-live" type="application/json">(.*?)</script>', html).group(1)
    )
    assert live["ws"] == f"/ws/jobs/{alice_eval.pk}/" and live["status"] == "succeeded"
    assert 'id="cancel-form" class="inline-form" hidden' in html  # nothing to cancel


def test_cancelling_from_the_job_page(alice_client, alice_eval):
    Job.objects.filter(pk=alice_eval.pk).update(status="queued")
    response = alice_client.post(f"/jobs/{alice_eval.pk}/cancel/", follow=True)
    alice_eval.refresh_from_db()
    assert alice_eval.status == "cancelled"
    assert "cancelled" in response.content.decode()


def test_the_inspector_filters_and_sorts(alice_client, alice_eval):
    html = page(alice_client, f"/jobs/{alice_eval.pk}/rollouts/")
    assert html.count("data-rollout-id=") == 8
    assert html.count("data-rollout-id=") == len(re.findall(r'<tr data-rollout-id="\d+"', html))
    assert (
        page(alice_client, f"/jobs/{alice_eval.pk}/rollouts/?step=4").count("<tr data-rollout-id=")
        == 4
    )
    assert (
        page(alice_client, f"/jobs/{alice_eval.pk}/rollouts/?outcome=loss").count(
            "<tr data-rollout-id="
        )
        == 0
    )
    one = Rollout.objects.filter(job=alice_eval).first()
    html = page(alice_client, f"/jobs/{alice_eval.pk}/rollouts/?example={one.example_id}")
    assert (
        html.count("<tr data-rollout-id=")
        == Rollout.objects.filter(job=alice_eval, example_id=one.example_id).count()
    )
    # Text search reaches into the messages; the oracle always thinks "Empty: ...".
    assert (
        page(alice_client, f"/jobs/{alice_eval.pk}/rollouts/?q=Empty:").count(
            "<tr data-rollout-id="
        )
        == 8
    )
    assert (
        page(alice_client, f"/jobs/{alice_eval.pk}/rollouts/?q=zebra").count("<tr data-rollout-id=")
        == 0
    )
    probs = sorted(r.facts["random_move_prob"] for r in Rollout.objects.filter(job=alice_eval))
    low = probs[0]
    html = page(alice_client, f"/jobs/{alice_eval.pk}/rollouts/?fact_random_move_prob_max={low}")
    assert html.count("<tr data-rollout-id=") == probs.count(low) < len(probs)
    html = page(alice_client, f"/jobs/{alice_eval.pk}/rollouts/?reward_min=abc")
    assert 'data-testid="error-reward_min"' in html


def test_the_rollout_page_shows_conversation_board_and_rewards(alice_client, alice_eval):
    rollout = Rollout.objects.filter(job=alice_eval).first()
    html = page(alice_client, f"/jobs/{alice_eval.pk}/rollouts/{rollout.pk}/")
    assert 'class="msg msg-system in-prompt"' in html and 'class="msg msg-assistant"' in html
    assert 'class="think"' in html  # the oracle's <think> is set apart
    assert "<code>move=" in html  # the parsed move
    # The env draws the board after each move; the page draws what it declares.
    assert html.count('class="state-view"') == len(rollout.state["moves"])
    assert "Board, move by move" in html and 'data-fact="invalid_moves"' in html
    for name in rollout.rewards:
        assert f"<td>{name}</td>" in html


def test_two_rollouts_side_by_side(alice_client, alice_eval):
    a, b = Rollout.objects.filter(job=alice_eval)[:2]
    html = page(alice_client, f"/jobs/{alice_eval.pk}/rollouts/compare/?id={a.pk}&id={b.pk}")
    assert f'data-rollout-id="{a.pk}"' in html and f'data-rollout-id="{b.pk}"' in html
    response = alice_client.get(f"/jobs/{alice_eval.pk}/rollouts/compare/?id={a.pk}")
    assert response.status_code == 302


def test_download_filtered_rollouts_as_jsonl(alice_client, alice_eval):
    response = alice_client.get(f"/jobs/{alice_eval.pk}/rollouts.jsonl?step=8")
    lines = b"".join(response.streaming_content).decode().splitlines()
    rows = [json.loads(line) for line in lines]
    assert len(rows) == 4 and {r["step"] for r in rows} == {8}
    assert {"messages", "rewards", "state", "outcome", "tokens"} <= set(rows[0])


def test_compare_runs_offers_the_union_of_metric_names(alice_client, alice_eval):
    html = page(alice_client, f"/compare/?jobs={alice_eval.pk}&metric=loss/kl")
    assert '<option value="loss/kl" selected>' in html and '<option value="reward/mean"' in html
    assert 'id="compare-chart"' in html and "/static/js/compare.js" in html


def test_plotly_is_served_from_our_static_files():
    path = finders.find("vendor/plotly/plotly.min.js")
    assert path and Path(path).read_text()[:200].startswith("/**")
    assert finders.find("js/job.js") and finders.find("css/lab.css")


def test_a_finished_synth_job_shows_its_dataset_and_offers_sft_on_it(
    alice, alice_client, real_services
):
    job = Job.objects.create(owner=alice, kind="synth", status="succeeded")
    path = real_services / f"job-{job.pk}" / "dataset.jsonl"
    job.result = job.summary = {"path": str(path), "kept": 12, "played": 40, "seconds": 3.5,
                                "dropped": {"outcome": 20, "max_invalid_moves": 8},
                                "outcomes": {"win": 12, "loss": 20, "unfinished": 8}}  # fmt: skip
    job.save()
    html = page(alice_client, f"/jobs/{job.pk}/")
    assert "<strong>12</strong> conversations kept of 40 played" in html
    assert "<td>max_invalid_moves</td><td>8</td>" in html and "<td>loss</td><td>20</td>" in html
    assert "No metrics yet." not in html
    link = re.search(r'id="start-sft" href="([^"]+)"', html).group(1).replace("&amp;", "&")
    form = alice_client.get(link).context["form"]
    assert form["dataset"].value() == str(path)


def test_the_env_preview_follows_the_forms_parameters(alice_client):
    default = page(alice_client, "/envs/tictactoe/preview/?seed=0")
    x_only = page(alice_client, "/envs/tictactoe/preview/?seed=0&param_model_mark=X")
    o_only = page(alice_client, "/envs/tictactoe/preview/?seed=0&param_model_mark=O")
    assert "as X." in x_only and "as O." not in x_only
    assert "as O." in o_only and "as X." not in o_only
    assert x_only != default or o_only != default
    refused = page(alice_client, "/envs/tictactoe/preview/?param_max_turns=99")
    assert 'id="preview-error"' in refused and "max_turns" in refused
    assert alice_client.get("/envs/nope/preview/").status_code == 404
    assert 'data-preview-url="/envs/tictactoe/preview/"' in page(
        alice_client, "/envs/tictactoe/new/"
    )


def test_the_inspector_names_the_outcome_and_its_reward_apart_and_says_what_is_stored(
    alice, alice_client, alice_eval, ttt_config, tiny
):
    html = page(alice_client, f"/jobs/{alice_eval.pk}/rollouts/")
    headers = re.findall(r"<th[^>]*>([^<]*)</th>", html)
    assert "outcome" in headers and "outcome reward" in headers
    assert headers.count("outcome") == 1
    assert "Stored: every rollout." in html
    rl = Job.objects.create(owner=alice, kind="rl", env_config=ttt_config, model=tiny,
                            config={"batch_size": 512, "log_rollouts": 256})  # fmt: skip
    assert "Stored: 256 of the 512 rollouts of each step" in page(
        alice_client, f"/jobs/{rl.pk}/rollouts/"
    )
    rl.config = {"batch_size": 64, "log_rollouts": 256}
    rl.save()
    assert "Stored: every rollout (64 a step)." in page(alice_client, f"/jobs/{rl.pk}/rollouts/")


def test_the_rl_form_links_its_recipes_and_posts_the_one_picked(
    alice, alice_client, ttt_config, tiny, django_capture_on_commit_callbacks
):
    html = page(alice_client, "/jobs/new/?kind=rl")
    assert re.search(r'data-recipe="rl_sound"\s+class="active"', html)
    assert 'href="?kind=rl&amp;recipe=rl_gpu"' in html and 'id="recipe-summary"' in html
    gpu = page(alice_client, "/jobs/new/?kind=rl&recipe=rl_gpu")
    assert re.search(r'data-recipe="rl_gpu"\s+class="active"', gpu)
    assert re.search(r'name="recipe" value="rl_gpu"', gpu)
    assert re.search(r'name="batch_size" value="256"', gpu)
    assert re.search(r'name="gpus" value="1"', gpu)  # the recipe asks for a GPU
    assert "large-batch regime of a GPU worker" in gpu  # the recipe's own comment
    assert "more about rl_gpu" in gpu and "The best GPU recipe measured" in gpu
    bad = alice_client.get("/jobs/new/?kind=rl&recipe=../../etc/passwd")
    assert bad.status_code == 400 and b"recipe: no rl recipe" in bad.content
    data = job_form_data(alice, "rl", env_config=ttt_config.pk, model=tiny.pk, recipe="rl_gpu")
    with django_capture_on_commit_callbacks(execute=False):
        response = alice_client.post("/jobs/new/", data)
    assert response.status_code == 302, response.content.decode()[:2000]
    assert Job.objects.get().config["sound_mass_weight"] == 1.0
