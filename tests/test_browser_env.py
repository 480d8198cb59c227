"""The browser environment, for real: the project's shop served on 127.0.0.1, Debian's
Chromium through Playwright, the goal read from each episode's own site database, and the
screenshots kept in the run's folder and shown by the rollout inspector."""

from __future__ import annotations

import asyncio
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlcore.envs.browser import (
    FAMILIES,
    BrowserOraclePolicy,
    parse_action,
    parse_price,
    read_page,
)
from rlcore.envs.browser_session import Session, browser_thread
from rlcore.envs.browser_site import site_server
from rlcore.envs.registry import load_environment
from rlcore.policy.base import Policy
from rlcore.rollout import run_rollouts
from rlcore.types import Generation, SamplingParams

SAMPLING = SamplingParams(max_tokens=64)


@pytest.fixture(scope="module")
def env():
    return load_environment("browser", parallel_browsers=1)


@pytest.fixture(scope="module")
def examples(env):
    """One example of each family: order, contact, price."""
    found = env.examples(3, seed=5)
    assert [ex.info["task"]["family"] for ex in found] == list(FAMILIES)
    return found


class Scripted(Policy):
    """Replies with `script` in order; then `done`."""

    name = "scripted"

    def __init__(self, script: list[str]):
        self.script = list(script)

    async def generate(self, messages, sampling, *, tools=None, state=None) -> Generation:
        return Generation(text=self.script.pop(0) if self.script else "<action>done</action>")


class WrongQuantity(BrowserOraclePolicy):
    """The oracle, told to order one fewer than asked: a whole order, of the wrong size."""

    async def generate(self, messages, sampling, *, tools=None, state=None) -> Generation:
        task = dict(state["task"], quantity=state["task"]["quantity"] - 1)
        return await super().generate(messages, sampling, state={**state, "task": task})


def play(env, policy, examples, output_dir=None):
    env.output_dir = str(output_dir) if output_dir else None
    return asyncio.run(run_rollouts(env, policy, examples, sampling=SAMPLING, concurrency=2))


def test_tasks_and_first_pages_are_deterministic_per_seed(env):
    again = load_environment("browser", parallel_browsers=1)
    first, second = env.examples(3, seed=9), again.examples(3, seed=9)
    assert [e.prompt for e in first] == [e.prompt for e in second]
    assert [e.info for e in first] == [e.info for e in second]
    other = env.examples(3, seed=10)
    assert [e.info["task"] for e in other] != [e.info["task"] for e in first]
    # The page in the prompt is what the browser shows there, numbered links and all.
    title, elements, _ = read_page(first[0].info["first_page"])
    assert title.startswith("Welcome to Mugshop")
    assert [(e.role, e.name) for e in elements[:4]] == [
        ("link", "Home"),
        ("link", "All products"),
        ("link", "Cart (0)"),
        ("link", "Contact"),
    ]
    assert load_environment("browser", task_family="price").examples(2, seed=1)[1].group == 0


def test_the_oracle_reaches_every_familys_goal_and_scores_1(env, examples, tmp_path):
    rollouts = play(env, BrowserOraclePolicy(), examples, tmp_path)
    for rollout in rollouts:
        assert rollout.error is None
        assert rollout.reward == 1.0 and rollout.outcome == "success", rollout.state["goal"]
        assert rollout.state["invalid_actions"] == 0
        assert rollout.facts["goal_reached"] == 1
    order, contact, price = (r.state for r in rollouts)
    assert order["goal"]["reason"] == "the order matches the task"
    assert contact["goal"]["reason"] == "the contact matches the task"
    assert price["finished"] == "answer" and parse_price(price["answer"]) is not None


def test_a_wrong_path_scores_0(env, examples):
    order, _, price = examples
    wrong, guessed = play(env, WrongQuantity(), [order]) + play(
        env, Scripted(['<action>answer "$0.01"</action>']), [price]
    )
    assert wrong.reward == 0.0 and wrong.outcome == "failure"
    assert wrong.state["goal"]["reason"] == "the order is there but its items is wrong"
    assert guessed.reward == 0.0 and "the price is" in guessed.state["goal"]["reason"]


def test_each_rollout_gets_a_fresh_site(env, examples):
    """Two oracle orders of one example both succeed: the second sees no order or cart
    of the first (the goal asks for exactly one order, and the cart's count is on every
    page)."""
    first, second = play(env, BrowserOraclePolicy(), [examples[0], examples[0]])
    assert first.reward == second.reward == 1.0
    # Same seed, same replies: the same pages, word for word.
    assert first.messages == second.messages and len(first.messages) > 10


def test_invalid_actions_are_counted_and_answered_never_raised(env, examples):
    title, elements, _ = read_page(examples[1].info["first_page"])
    button = next(e for e in elements if e.role == "button")
    script = [
        "I will click the first link.",  # no tag
        "<action>click 999999</action>",  # not on the page
        f'<action>type {button.id} "x"</action>',  # a button is not a field
        "<action>back</action>",  # nowhere to go back to
        "<action>click 12345678901234567890</action>",  # too many digits
        "<action>jump 3</action>",
    ]
    (rollout,) = play(env, Scripted(script), [examples[1]])
    assert rollout.error is None
    assert rollout.state["steps"] == 7 and rollout.state["invalid_actions"] == 6
    replies = [m["content"] for m in rollout.completion if m["role"] == "user"]
    assert all(reply.startswith("Invalid action:") for reply in replies)
    assert "no <action>" in replies[0] and "no element [999999]" in replies[1]
    assert "it is a button" in replies[2] and "no earlier page" in replies[3]
    assert rollout.rewards["format"] == pytest.approx(4 / 7)
    # The page after each invalid action is the page before it.
    assert all(reply.endswith(examples[1].info["first_page"]) for reply in replies)


def test_screenshots_are_kept_in_the_output_folder_and_named_in_the_state(env, examples, tmp_path):
    (rollout,) = play(env, BrowserOraclePolicy(), [examples[1]], tmp_path)
    shots = rollout.state["screenshots"]
    carried_out = [a for a in rollout.state["actions"] if a["error"] is None]
    # One of the first page, then one per action the page carried out (not the final done).
    assert len(shots) == len(carried_out) == rollout.state["steps"]
    assert shots[0]["caption"] == "start" and shots[1]["caption"].startswith("1. click")
    for shot in shots:
        path = tmp_path / shot["path"]
        assert not Path(shot["path"]).is_absolute() and path.resolve().is_relative_to(tmp_path)
        assert path.read_bytes()[:3] == b"\xff\xd8\xff"  # a JPEG
    views = type(env).state_views(rollout.state)
    assert [v["kind"] for v in views] == ["text", "images"]
    assert views[1]["images"] == shots


def test_an_eval_keeps_the_screenshots_in_its_own_output_folder(tmp_path):
    from rlcore.evaluate import EvalConfig, run_eval

    out = tmp_path / "eval"
    cfg = EvalConfig(model="oracle", env="browser", num_examples=1, out_dir=str(out))
    (rollout,) = run_eval(cfg).rollouts
    shots = rollout.state["screenshots"]
    assert rollout.reward == 1.0 and shots
    assert all((out / shot["path"]).is_file() for shot in shots)


def test_no_screenshots_when_turned_off(examples, tmp_path):
    quiet = load_environment("browser", parallel_browsers=1, screenshots=False)
    (rollout,) = play(quiet, BrowserOraclePolicy(), [examples[2]], tmp_path)
    assert rollout.reward == 1.0 and rollout.state["screenshots"] == []
    assert not any(tmp_path.iterdir())


class Counting(BaseHTTPRequestHandler):
    hits = 0

    def do_GET(self):
        type(self).hits += 1
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"reached")

    def log_message(self, *args):
        return None


def test_the_page_reaches_only_its_own_site(env, examples):
    other = ThreadingHTTPServer(("127.0.0.1", 0), Counting)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    elsewhere = f"http://127.0.0.1:{other.server_address[1]}/secret"
    server = site_server()
    url = server.open(env_site(examples[0]))

    def probe(browser):
        session = Session(browser, url, None)
        try:
            fetched = session.page.evaluate(
                "(u) => fetch(u).then(r => r.text()).catch(() => 'blocked')", elsewhere
            )
            try:
                session.page.goto(elsewhere)
                went = "went"
            except Exception:
                went = "refused"
            return fetched, went, list(session.blocked)
        finally:
            session.close()

    try:
        fetched, went, blocked = browser_thread(1).submit(probe).result(timeout=60)
    finally:
        server.close(url)
        other.shutdown()
    assert (fetched, went) == ("blocked", "refused") and Counting.hits == 0
    assert blocked == [elsewhere, elsewhere]
    # The footer's link to the shop's blog (another host) is an invalid action.
    _, elements, _ = read_page(examples[0].info["first_page"])
    blog = next(e for e in elements if e.name == "Our blog")
    (rollout,) = play(env, Scripted([f"<action>click {blog.id}</action>"]), [examples[0]])
    assert "actions" in rollout.state, rollout.error  # seen once under a full make test's load
    assert rollout.state["actions"][0]["error"].startswith("that leads off the site")
    assert any("blog.example.com" in url for url in rollout.state["blocked_requests"])


def env_site(example):
    from rlcore.envs.browser import site_for

    return site_for(example.info["task"])


# Hostile replies: the other envs' tags and digits, and this env's own tag around garbage.
fragment = st.one_of(
    st.sampled_from(
        [
            "<action>",
            "</action>",
            "<think>",
            "</think>",
            "click",
            "type",
            '"',
            "back",
            "answer",
            "done",
            "[",
            "]",
            "\x00",
            "\n",
            " ",
        ]
    ),  # fmt: skip
    st.text(max_size=12),
    st.integers(0, 5000).map(lambda n: "9" * n),
    st.integers(1, 3000).map(lambda n: "[" * n + "{" * n),
)
hostile = st.one_of(
    st.lists(fragment, max_size=8).map("".join),
    st.tuples(
        st.sampled_from(["click ", "type ", "answer ", ""]), st.lists(fragment, max_size=6)
    ).map(lambda t: f"<action>{t[0]}{''.join(t[1])}</action>"),
    st.integers(1, 60_000).map(lambda n: "<action>" * n),
    st.integers(0, 3).map(lambda n: f'<action>type 5 "{"x" * 10_000}"</action>' * n),
)


@settings(max_examples=3_000, deadline=None, database=None)
@given(text=hostile)
def test_any_reply_parses_to_an_action_or_a_reason(text):
    action, error = parse_action(text)
    assert (action is None) != (error is None)
    if action is not None:
        assert action.element is None or 0 <= action.element < 10**6
        assert len(action.text) <= 300


# Whole rollouts cost a browser step for each reply that reads as a valid action, so fewer
# examples than the 10,000 of tests/security (which plays this env too, with replies that
# never hold an <action> tag).
@settings(max_examples=300, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(script=st.lists(hostile, min_size=1, max_size=3), which=st.integers(0, 2))
def test_hostile_replies_are_invalid_steps_never_errors(env, examples, script, which):
    (rollout,) = play(env, Scripted(script), [examples[which]])
    assert rollout.error is None
    assert rollout.reward in (0.0, 1.0) and rollout.rewards["goal"] in (0.0, 1.0)
    assert 0.0 <= rollout.rewards["format"] <= 1.0
    assert rollout.state["steps"] == rollout.num_turns >= 1
    assert rollout.state["invalid_actions"] <= rollout.state["steps"]


@pytest.mark.django_db
def test_the_inspector_shows_the_screenshots_to_the_jobs_owner_alone(
    alice, alice_client, bob_client, examples, settings, tmp_path
):
    """A browser eval's rollout as a worker stores it, with the screenshots in the job's
    folder: its page draws them, each is served from that folder, and nothing else is."""
    import re

    from webapp.jobs.models import Job
    from webapp.jobs.services import job_output_dir
    from workers.sink import rollout_row

    settings.RUNS_DIR = settings.CHECKPOINT_ROOT = tmp_path / "runs"
    job = Job.objects.create(owner=alice, kind="eval", status="succeeded",
                             config={"env": "browser", "model": "oracle"})  # fmt: skip
    folder = job_output_dir("eval", job.pk)
    job.config["out_dir"] = str(folder)
    job.save()
    (rollout,) = play(load_environment("browser", parallel_browsers=1), BrowserOraclePolicy(),
                      [examples[2]], folder)  # fmt: skip
    row = rollout_row(job.pk, 1, rollout)
    row.save()
    page = f"/jobs/{job.pk}/rollouts/{row.pk}/"
    html = alice_client.get(page).content.decode()
    sources = re.findall(r'<img src="([^"]+)"', html)
    assert 'data-testid="images"' in html and len(sources) == len(rollout.state["screenshots"])
    for source, shot in zip(sources, rollout.state["screenshots"], strict=True):
        response = alice_client.get(source)
        assert response.status_code == 200 and response["Content-Type"] == "image/jpeg"
        assert b"".join(response.streaming_content) == (folder / shot["path"]).read_bytes()
        assert bob_client.get(source).status_code == 404
    # The compare page lists the screenshots' captions beside each other's.
    compare = alice_client.get(f"/jobs/{job.pk}/rollouts/compare/?id={row.pk}&id={row.pk}")
    assert compare.status_code == 200 and compare.content.decode().count(">start<") == 2
    # Only paths the env listed, and only inside the job's own folder.
    (tmp_path / "runs" / "secret.jpg").write_bytes(b"\xff\xd8\xff secret")
    image = f"{page}image?path="
    for path in ("../secret.jpg", "/etc/passwd", "screenshots/nothing.jpg", "results.jsonl"):
        assert alice_client.get(image + path).status_code == 404, path
    # Even a listed path may not leave the folder, not even for another of alice's jobs.
    other = Job.objects.create(owner=alice, kind="eval", status="succeeded", config={})
    (job_output_dir("eval", other.pk)).mkdir(parents=True)
    (job_output_dir("eval", other.pk) / "shot.jpg").write_bytes(b"\xff\xd8\xff other")
    for path in ("../secret.jpg", f"../job-{other.pk}/shot.jpg"):
        row.state["screenshots"][0]["path"] = path
        row.save()
        assert alice_client.get(image + path).status_code == 404, path
