"""Alice uses the lab in a real browser, start to finish: she saves an environment config
(after a bad value is refused), registers models, launches an eval job and watches its
curves grow until it succeeds, opens a rollout in the inspector, compares runs, and plays
a whole game of tic-tac-toe against the oracle. The tests run in order and hand each
other what they made through `lab`."""

from __future__ import annotations

import re
import time

import pytest
from playwright.sync_api import Page, expect

from tests.browser.conftest import log_in, screenshot

pytestmark = pytest.mark.browser

CONFIG_NAME = "ttt browser"
EVAL_EXAMPLES = 5000
# Points plotted on the reward/mean panel; Plotly keeps a chart's traces on its div.
REWARD_POINTS_JS = """() => {
  const div = document.querySelector('#metric-charts .chart[data-panel="reward/mean"]');
  return div && div.data && div.data.length ? div.data[0].x.length : 0;
}"""


@pytest.fixture(scope="module")
def lab() -> dict:
    return {}


def need(lab: dict, key: str):
    if key not in lab:
        pytest.fail(f"an earlier test did not leave {key!r}; run the module from the start")
    return lab[key]


def test_an_environment_config_is_saved_after_a_bad_value_is_refused(page: Page, lab):
    page.goto("/envs/")
    expect(page.locator("#env-tictactoe")).to_be_visible()
    screenshot(page, "environments.png")
    page.click("[data-testid=new-config-tictactoe]")
    # The form's script listens once the page has loaded: an edit before that goes unheard
    # (a race the clean-clone run lost once).
    page.wait_for_load_state("load")
    # The preview follows the form before anything is saved.
    preview = page.locator("#preview-body")
    expect(page.locator("#preview-of")).to_have_text("(defaults)")
    page.select_option("#id_param_model_mark", "O")
    expect(page.locator("#preview-of")).to_have_text("(this form)", timeout=15_000)
    expect(preview).to_contain_text("as O.")
    expect(preview).not_to_contain_text("as X.")
    page.select_option("#id_param_model_mark", "random")
    page.fill("#id_name", CONFIG_NAME)
    page.fill("#id_param_max_turns", "99")  # the schema allows 1-30
    expect(preview.locator("#preview-error")).to_contain_text("max_turns")
    page.fill("#id_param_min_random_move_prob", "0.2")
    page.fill("#id_param_max_random_move_prob", "0.8")
    page.click("#save-config")
    error = page.locator("[data-testid=error-param_max_turns]")
    expect(error).to_contain_text("30")
    expect(page.locator("[data-testid=field-param_max_turns]")).to_have_class(
        re.compile("has-error")
    )

    page.fill("#id_param_max_turns", "6")
    page.click("#save-config")
    expect(page.locator("#messages")).to_contain_text(f"Saved environment config '{CONFIG_NAME}'")
    expect(page.locator("#env-preview .example").first).to_be_visible()
    config_id = int(re.search(r"/envs/configs/(\d+)/", page.url).group(1))
    screenshot(page, "env_config.png")
    page.goto("/envs/")
    row = page.locator(f"#env-configs tr[data-config-id='{config_id}']")
    expect(row).to_contain_text("max_turns=6")
    lab["config_id"] = config_id


def test_models_are_registered_through_the_form(page: Page, lab):
    page.goto("/models/")
    # Other modules' tests may have registered models of alice's in this database first.
    before = page.locator("#models tbody tr[data-model-id]").count()
    for name, kind, location in (
        ("oracle", "builtin", "oracle"),
        ("random", "builtin", "random"),
        ("tiny", "tiny", ""),
    ):
        page.fill("#model-form [name=name]", name)
        page.select_option("#model-form [name=kind]", kind)
        page.fill("#model-form [name=location]", location)
        page.click("#register-model")
        expect(page.locator("#models")).to_contain_text(name)
    rows = page.locator("#models tbody tr")
    expect(rows).to_have_count(before + 3)
    oracle_row = rows.filter(has_text="oracle").first
    lab["oracle_id"] = int(oracle_row.get_attribute("data-model-id"))
    lab["random_id"] = int(rows.filter(has_text="random").first.get_attribute("data-model-id"))
    lab["tiny_id"] = int(rows.filter(has_text="tiny").first.get_attribute("data-model-id"))
    screenshot(page, "models.png")


def test_an_eval_job_streams_its_curves_until_it_succeeds(page: Page, lab, stack):
    config_id, random_id = need(lab, "config_id"), need(lab, "random_id")
    page.goto("/jobs/new/?kind=eval")
    page.select_option("#id_env_config", str(config_id))
    page.select_option("#id_model", str(random_id))
    page.fill("#id_num_examples", str(EVAL_EXAMPLES))
    page.fill("#id_rollouts_per_example", "1")
    page.fill("#id_concurrency", "32")
    baselines = page.locator("#id_baselines")
    if baselines.is_checked():
        baselines.uncheck()
    screenshot(page, "new_job.png")
    # What the page heard, to say why if it never shows the end of the job.
    heard = []
    page.on("console", lambda message: heard.append(f"console {message.type}: {message.text}"))
    page.on("pageerror", lambda error: heard.append(f"page error: {error}"))
    page.on(
        "websocket",
        lambda ws: ws.on("framereceived", lambda frame: heard.append(f"ws: {str(frame)[:90]}")),
    )
    page.click("#submit-job")
    page.wait_for_url(re.compile(r"/jobs/\d+/$"))
    job_id = int(re.search(r"/jobs/(\d+)/", page.url).group(1))
    lab["job_id"] = job_id

    # Sample the page while the job runs: the plotted points must grow while the status
    # still says running (the page reloads itself once the job is over).
    samples, shot_taken, durations = [], False, set()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            status = page.locator("#job-status").get_attribute("data-status", timeout=2000)
            points = page.evaluate(REWARD_POINTS_JS)
        except Exception:  # the page is reloading
            continue
        samples.append((status, points))
        if status == "running":
            durations.add(page.locator("#job-duration").inner_text())
        running = sorted({p for s, p in samples if s == "running" and p > 0})
        if len(running) >= 2 and not shot_taken and status == "running":
            screenshot(page, "job_live.png")
            shot_taken = True
        if status in ("succeeded", "failed", "cancelled"):
            break
        time.sleep(0.1)
    running = [p for s, p in samples if s == "running" and p > 0]
    assert len(set(running)) >= 2 and running == sorted(running), (samples, stack.logs())
    assert len(durations) >= 2, durations  # the duration ticks while the job runs
    assert samples[-1][0] == "succeeded", (samples[-5:], heard[-30:], stack.logs())
    expect(page.locator("#summary-rewards")).to_be_visible(timeout=20_000)
    expect(page.locator("#summary-outcomes tr[data-outcome]").first).to_be_visible()
    page.wait_for_function(f"({REWARD_POINTS_JS})() >= {max(running)}")
    final_points = page.evaluate(REWARD_POINTS_JS)
    [(stored,)] = stack.sql(
        "select count(distinct step) from jobs_metric where job_id = %s and name = 'reward/mean'",
        job_id,
    )
    assert final_points == stored >= 3
    [(rollouts,)] = stack.sql("select count(*) from jobs_rollout where job_id = %s", job_id)
    assert rollouts == EVAL_EXAMPLES
    if not shot_taken:
        screenshot(page, "job_live.png")


RL_STEPS = 3
# Steps plotted on a panel of the RL job.
PANEL_STEPS_JS = """(panel) => {
  const div = document.querySelector(`#metric-charts .chart[data-panel="${panel}"]`);
  return div && div.data && div.data.length ? div.data[0].x.length : 0;
}"""


def test_an_rl_job_of_the_tiny_model_draws_each_step_and_keeps_its_checkpoint(
    page: Page, lab, stack
):
    config_id, tiny_id = need(lab, "config_id"), need(lab, "tiny_id")
    # The form starts from the best CPU recipe; the GPU profile's is one click away.
    page.goto("/jobs/new/?kind=rl")
    expect(page.locator("#recipe-tabs a.active")).to_have_text("rl_sound")
    page.click("#recipe-tabs a[data-recipe=rl_gpu]")
    page.wait_for_url(re.compile(r"recipe=rl_gpu"))
    expect(page.locator("#id_batch_size")).to_have_value("256")
    expect(page.locator("#recipe-summary")).to_contain_text("large-batch regime of a GPU worker")
    screenshot(page, "new_job_rl.png")
    page.click("#recipe-tabs a[data-recipe=rl_sound]")
    expect(page.locator("#id_batch_size")).to_have_value("64")
    page.select_option("#id_env_config", str(config_id))
    page.select_option("#id_model", str(tiny_id))
    page.locator("#all-settings > summary").click()
    for field, value in (("max_steps", RL_STEPS), ("batch_size", 8), ("rollouts_per_example", 4),
                         ("micro_batch_size", 8), ("sampling__max_tokens", 24)):  # fmt: skip
        page.fill(f"#id_{field}", str(value))
    page.select_option("#id_device", "cpu")
    # Letters typed into a number field reach the server blank: an error, not the default.
    page.fill("#id_max_steps", "")
    page.locator("#id_max_steps").press_sequentially("ten")
    page.click("#submit-job")
    expect(page.locator("[data-testid=error-max_steps]")).to_be_visible()
    assert "/jobs/new/" in page.url, page.url  # no job was queued
    page.fill("#id_max_steps", str(RL_STEPS))
    page.click("#submit-job")
    page.wait_for_url(re.compile(r"/jobs/\d+/$"))
    job_id = int(re.search(r"/jobs/(\d+)/", page.url).group(1))
    # The page reloads itself once the job is over.
    expect(page.locator("#job-status")).to_have_attribute(
        "data-status", re.compile("succeeded|failed|cancelled|lost"), timeout=240_000
    )
    status = page.locator("#job-status").get_attribute("data-status")
    assert status == "succeeded", (page.locator("#job-error").inner_text(), stack.logs())
    expect(page.locator("#job-result")).to_be_attached()  # the page as reloaded, finished
    for panel in ("reward/mean", "loss", "perf/step_seconds"):  # loss/* share a panel
        page.wait_for_function(f"({PANEL_STEPS_JS})('{panel}') === {RL_STEPS}")
    # Random weights lose every game alike: a reward of -0.5 each step, drawn flat.
    flat = {panel["panel"]: panel for panel in page.evaluate(FLAT_PANELS_JS)}
    low, high = flat["reward/mean"]["range"]
    assert low < -0.5 < high and high - low >= 0.1, flat["reward/mean"]
    assert set(flat["reward/mean"]["smoothed"]) == {-0.5}, flat["reward/mean"]
    expect(page.locator("#progress-text")).to_have_text(f"rl {RL_STEPS}/{RL_STEPS}")
    expect(page.locator("#log-tail")).to_contain_text("rl: grpo on tictactoe, 2 examples x 4")
    expect(page.locator("#log-tail")).to_contain_text("rl: final checkpoint")
    # rl_sound chooses its result among its last saves ([select]); 3 steps made one save,
    # taken as it is and listed after it as best/.
    expect(page.locator("#log-tail")).to_contain_text(
        "select: one save (final), taken without games"
    )
    expect(page.locator("#checkpoints li", has_text="/final")).to_have_count(1)
    expect(page.locator("#checkpoints li").last).to_contain_text(f"step {RL_STEPS}:")
    expect(page.locator("#checkpoints li").last).to_contain_text("/best")
    expect(page.locator("#rollout-feed li").first).to_be_visible()
    [(stored,)] = stack.sql("select count(*) from jobs_rollout where job_id = %s", job_id)
    assert stored == RL_STEPS * 8  # every rollout of every step (log_rollouts)
    screenshot(page, "job_rl.png")


FLAT_PANELS_JS = """() => [...document.querySelectorAll('#metric-charts .chart')]
  .filter((div) => div.data && div.data.length && div.data[0].y.length > 2)
  .filter((div) => new Set(div.data[0].y).size === 1)
  .map((div) => ({panel: div.dataset.panel, range: div.layout.yaxis.range,
                  smoothed: div.data[1].y}))"""


def test_the_charts_group_by_namespace_draw_flat_series_flat_and_filter(page: Page, lab):
    page.goto(f"/jobs/{need(lab, 'job_id')}/")
    expect(page.locator("#metric-charts .chart").first).to_be_visible()
    page.wait_for_function("document.querySelectorAll('#metric-charts .chart-section').length > 2")
    sections = page.locator("#metric-charts > details.chart-section").evaluate_all(
        "(nodes) => nodes.map((node) => node.dataset.section)"
    )
    assert sections[:2] == ["outcome", "reward"], sections
    # A metric that never changes is drawn flat, inside a readable range.
    flat = page.evaluate(FLAT_PANELS_JS)
    assert flat, "the random player's run has a constant metric (its format rate)"
    for panel in flat:
        low, high = panel["range"]
        assert high - low >= 0.1, panel
        assert len(set(panel["smoothed"])) == 1, panel
    # The search box keeps only the panels whose metric names match.
    page.fill("#metric-search", "reward/mean")
    visible = page.locator("#metric-charts .chart:visible").evaluate_all(
        "(nodes) => nodes.map((node) => node.dataset.panel)"
    )
    assert visible == ["reward/mean"], visible
    # A closed section stays closed on the next visit to a job of this kind.
    page.fill("#metric-search", "")
    closed = f'details.chart-section[data-section="{sections[-1]}"]'
    page.locator(f"{closed} > summary").click()
    page.reload()
    expect(page.locator(closed)).to_be_attached()
    assert page.locator(closed).get_attribute("open") is None
    assert page.locator('details.chart-section[data-section="reward"]').get_attribute("open") == ""


def test_a_rollout_opens_in_the_inspector_with_its_conversation_and_board(page: Page, lab):
    job_id = need(lab, "job_id")
    page.goto(f"/jobs/{job_id}/")
    page.click("#open-inspector")
    rows = page.locator("table#rollouts tbody tr[data-rollout-id]")
    expect(rows.first).to_be_visible()
    screenshot(page, "inspector.png")
    rollout_id = rows.first.get_attribute("data-rollout-id")
    rows.first.locator(f"a[href$='/rollouts/{rollout_id}/']").click()
    page.wait_for_url(re.compile(rf"/rollouts/{rollout_id}/$"))
    conversation = page.locator("#conversation .conversation")
    expect(conversation.locator("li[data-role=system]")).to_have_count(1)
    expect(conversation.locator("li[data-role=assistant]").first).to_contain_text("<move>")
    boards = page.locator("[data-testid=state-views] .state-view")
    expect(boards.first).to_be_visible()
    assert boards.count() >= 3  # the model and the opponent take turns
    # Each of the model's moves carries the solver's verdict.
    expect(page.locator("[data-testid=verdict]").first).to_contain_text("sound")
    expect(page.locator("[data-testid=think-verdict]").first).to_contain_text("think: ")
    expect(page.locator("#reward-functions tbody tr").first).to_be_visible()
    screenshot(page, "rollout.png")


def test_runs_are_compared_on_one_chart(page: Page, lab):
    job_id = need(lab, "job_id")
    page.goto(f"/compare/?jobs={job_id}&metric=reward/mean")
    page.wait_for_function(
        "() => { const d = document.querySelector('#compare-chart .chart');"
        " return d && d.data && d.data.length > 0 && d.data[0].x.length > 0; }"
    )
    expect(page.locator("#compare-title")).to_have_text("reward/mean")
    screenshot(page, "compare.png")


def _board(page: Page) -> list[str]:
    return page.eval_on_selector_all("#board .cell", "cells => cells.map(c => c.dataset.mark)")


def test_a_whole_game_against_the_oracle_by_clicking_cells(page: Page, lab, stack):
    oracle_id = need(lab, "oracle_id")
    page.goto("/play/")
    page.select_option("#id_player", f"model-{oracle_id}")
    page.check("input[name=human_mark][value=X]")
    page.check("input[name=starts][value=human]")
    page.click("#start-game")
    page.wait_for_url(re.compile(r"/play/games/\d+/$"))
    game_id = int(re.search(r"/games/(\d+)/", page.url).group(1))
    status = page.locator("#game-status")
    expect(status).to_have_attribute("data-status", "human_turn")
    expect(page.locator("#live-state")).to_have_text("live")  # the game's websocket is open

    for turn in range(5):
        board = _board(page)
        if turn == 1:
            # A taken cell is refused by the server, with the reason on the page.
            taken = next(i for i, mark in enumerate(board) if mark == "O")
            page.click(f"[data-testid=cell-{taken}]")
            expect(page.locator("#move-error")).to_contain_text(f"cell {taken} is taken by O")
        cell = board.index(".")
        page.click(f"[data-testid=cell-{cell}]")
        expect(page.locator(f"[data-testid=cell-{cell}]")).to_have_attribute("data-mark", "X")
        expect(page.locator("#move-error")).to_be_hidden()
        # Wait for the model's reply (made by the worker, announced over the websocket).
        page.wait_for_function(
            "() => ['human_turn', 'finished'].includes("
            "document.getElementById('game-status').dataset.status)",
            timeout=30_000,
        )
        if status.get_attribute("data-status") == "finished":
            break
    expect(status).to_have_attribute("data-status", "finished")
    outcome = status.get_attribute("data-outcome")
    assert outcome in ("win", "draw"), f"the oracle lost: {_board(page)}"  # model's view

    game = page.request.get(f"/play/api/games/{game_id}/").json()
    moves = game["moves"]
    replayed = ["."] * 9
    for m in moves:
        replayed[m["cell"]] = m["mark"]
    assert _board(page) == game["board"] == replayed
    [(db_moves, db_outcome, db_status)] = stack.sql(
        "select session->'moves', outcome, status from play_game where id = %s", game_id
    )
    assert db_moves == moves and db_outcome == outcome and db_status == "finished"
    model_moves = [m for m in moves if m["player"] == "model"]
    expect(page.locator("#model-replies .reply.valid .think")).to_have_count(len(model_moves))
    expect(page.locator("#move-list li")).to_have_count(len(moves))
    expect(status).to_contain_text("oracle won." if outcome == "win" else "Draw.")
    # The finished game replays move by move.
    page.click("[data-replay=first]")
    assert _board(page) == ["."] * 9
    page.click("[data-replay=next]")
    assert _board(page).count(".") == 8
    page.click("[data-replay=last]")
    assert _board(page) == replayed
    screenshot(page, "play.png")

    page.goto(f"/play/history/model-{oracle_id}/")
    row = page.locator(f"#finished-games tr[data-game-id='{game_id}']")
    expect(row).to_contain_text(outcome)
    expect(page.locator(f"#record [data-count={outcome}]")).to_have_text("1")
    screenshot(page, "play_history.png")
    row.locator("a").click()
    page.wait_for_url(re.compile(rf"/play/games/{game_id}/$"))


def test_the_admin_lists_jobs_with_their_worker(browser, stack, lab):
    job_id = need(lab, "job_id")
    context = log_in(browser, stack, "admin", login_path="/admin/login/")
    page = context.new_page()
    page.goto("/admin/jobs/job/")
    row = page.locator("#result_list tbody tr").filter(has_text=f"{job_id}")
    expect(row.first).to_contain_text("succeeded")
    expect(row.first).to_contain_text("browser-")
    page.click("#toggle-nav-sidebar")  # room for the columns
    expect(page.locator("#nav-sidebar")).to_be_hidden()
    screenshot(page, "admin_jobs.png")
    context.close()
