"""Evaluation: summary statistics checked by hand, live reporting to a sink, cancellation,
the files an eval writes, baselines, and the tic-tac-toe numbers a sound env must give."""

from __future__ import annotations

import asyncio
import json
import math
import random

import pytest

from rlcore.envs import Param, SingleTurnEnv, registry
from rlcore.evaluate import (
    EvalConfig,
    EvalConfigError,
    EvalResult,
    format_summary,
    reward_histogram,
    run_eval,
    summarize,
    summary_metrics,
    wilson_interval,
)
from rlcore.events import RecordingSink
from rlcore.parsers import XMLParser
from rlcore.policy import ConstantPolicy, Policy, load_policy
from rlcore.rubric import Rubric
from rlcore.types import Example, Generation, Rollout, jsonl_line

# ---------------------------------------------------------------------------------------
# A small single-turn environment: say whether a number is even or odd.


def _answer(completion, parser) -> str | None:
    text = completion[-1]["content"] if completion else ""
    return parser.parse_answer(text, "answer")


def correct_reward(*, completion, example, parser, **_) -> float:
    return 1.0 if _answer(completion, parser) == example.answer else 0.0


def format_reward(*, completion, parser, **_) -> float:
    return 1.0 if _answer(completion, parser) is not None else 0.0


class ParityOracle(Policy):
    name = "oracle"
    closed: list[ParityOracle] = []

    def __init__(self):
        self.was_closed = False

    async def generate(self, messages, sampling, *, tools=None, state=None) -> Generation:
        number = int(messages[-1]["content"].split()[-1])
        answer = "even" if number % 2 == 0 else "odd"
        return Generation(text=f"<answer>{answer}</answer>", prompt_tokens=7, completion_tokens=3)

    async def aclose(self) -> None:
        self.was_closed = True
        ParityOracle.closed.append(self)


class ParityRandom(Policy):
    name = "random"

    def __init__(self):
        self.rng = random.Random(0)

    async def generate(self, messages, sampling, *, tools=None, state=None) -> Generation:
        answer = self.rng.choice(["even", "odd"])
        return Generation(text=f"<answer>{answer}</answer>", prompt_tokens=7, completion_tokens=3)


class ParityEnv(SingleTurnEnv):
    name = "parity"
    description = "Say whether a number is even or odd."
    params = [Param("max_number", int, 100, "Largest number asked about.", min=1, max=10_000)]
    outcome_labels = ("correct", "wrong", "unparsed")

    def build_parser(self):
        return XMLParser(["answer"])

    def build_rubric(self) -> Rubric:
        rubric = Rubric()
        rubric.add(correct_reward, 1.0, name="correct")
        rubric.add(format_reward, 0.5, name="format")
        return rubric

    def make_example(self, index: int, seed: int) -> Example:
        number = random.Random(seed * 100_003 + index).randint(0, self.config["max_number"])
        return Example(
            id=index,
            seed=seed * 100_003 + index,
            prompt=[{"role": "user", "content": f"Is this even or odd: {number}"}],
            answer="even" if number % 2 == 0 else "odd",
            info={"number": number},
        )

    def outcome(self, state, rewards) -> str:
        if rewards.get("format") == 0.0:
            return "unparsed"
        return "correct" if rewards.get("correct") == 1.0 else "wrong"

    def rollout_metrics(self, rollout: Rollout) -> dict[str, float]:
        return {"number": float(rollout.info.get("number", 0))}

    def breakdowns(self, rollout: Rollout) -> dict[str, str]:
        return {"parity": "even" if rollout.info.get("number", 0) % 2 == 0 else "odd"}

    def builtin_policies(self):
        return {"oracle": ParityOracle, "random": ParityRandom, "constant": ConstantPolicy}


@pytest.fixture
def parity(monkeypatch):
    monkeypatch.setitem(registry.ENVIRONMENTS, "parity", f"{__name__}:ParityEnv")
    return ParityEnv()


def _rollout(reward, rewards, outcome, *, number, truncated=False, error=None, turns=1):
    return Rollout(
        example_id=0,
        seed=0,
        group=0,
        messages=[{"role": "user", "content": "?"}, {"role": "assistant", "content": "!"}],
        prompt_len=1,
        rewards=rewards,
        reward=reward,
        outcome=outcome,
        prompt_tokens=10,
        completion_tokens=4,
        num_turns=turns,
        truncated=truncated,
        error=error,
        info={"number": number},
        seconds=0.5,
    )


# ---------------------------------------------------------------------------------------
# Statistics


def test_wilson_interval_matches_the_hand_computed_values():
    # 8 of 10: p = .8, z^2/n = .38415 -> center .71674, half width .22658
    low, high = wilson_interval(8, 10)
    assert low == pytest.approx(0.49016, abs=1e-4)
    assert high == pytest.approx(0.94332, abs=1e-4)
    # 0 of 200: the interval is [0, z^2 / (n + z^2)], not a zero-width [0, 0]
    low, high = wilson_interval(0, 200)
    assert low == 0.0
    assert high == pytest.approx(3.8415 / 203.8415, abs=1e-5)
    # n of n mirrors 0 of n
    assert wilson_interval(200, 200) == pytest.approx((1 - high, 1.0))
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_reward_histogram_counts_every_reward_once_with_the_max_in_the_last_bin():
    histogram = reward_histogram([0.0, 0.05, 0.1, 0.55, 1.0, 1.0], bins=10)
    assert histogram["edges"][0] == 0.0 and histogram["edges"][-1] == 1.0
    assert len(histogram["edges"]) == 11
    assert histogram["counts"] == [2, 1, 0, 0, 0, 1, 0, 0, 0, 2]
    assert reward_histogram([0.5, 0.5]) == {"edges": [0.5, 0.5], "counts": [2]}
    assert reward_histogram([]) == {"edges": [], "counts": []}


def test_summarize_hand_built_rollouts(parity):
    rollouts = [
        _rollout(1.5, {"correct": 1.0, "format": 1.0}, "correct", number=2),
        _rollout(1.5, {"correct": 1.0, "format": 1.0}, "correct", number=4),
        _rollout(0.5, {"correct": 0.0, "format": 1.0}, "wrong", number=3, truncated=True),
        _rollout(1.5, {"correct": 1.0, "format": 1.0}, "correct", number=5, turns=3),
        _rollout(0.0, {"correct": 0.0, "format": 0.0}, "timeout", number=7, error="boom"),
    ]
    summary = summarize(parity, rollouts, seconds=2.0)
    json.dumps(summary)  # JSON-able as a whole

    assert summary["num_rollouts"] == 5
    assert summary["errors"] == 1
    assert summary["reward"]["mean"] == pytest.approx(1.0)
    assert summary["reward"]["std"] == pytest.approx(math.sqrt((3 * 0.25 + 0.25 + 1.0) / 5))
    assert (summary["reward"]["min"], summary["reward"]["max"]) == (0.0, 1.5)
    assert list(summary["functions"]) == ["correct", "format"]
    assert summary["functions"]["correct"]["mean"] == pytest.approx(0.6)
    assert summary["functions"]["correct"]["std"] == pytest.approx(math.sqrt(0.24))
    assert summary["functions"]["format"]["weight"] == 0.5

    outcomes = summary["outcomes"]
    # declared labels first (even at zero), then labels only seen in the data
    assert list(outcomes) == ["correct", "wrong", "unparsed", "timeout"]
    assert outcomes["correct"]["count"] == 3
    assert outcomes["correct"]["rate"] == pytest.approx(0.6)
    assert outcomes["correct"]["ci95"] == pytest.approx(list(wilson_interval(3, 5)))
    assert outcomes["unparsed"] == {
        "count": 0,
        "rate": 0.0,
        "ci95": [0.0, pytest.approx(0.4345, abs=1e-4)],
    }

    by_parity = summary["breakdowns"]["parity"]
    assert by_parity["even"]["count"] == 2
    assert by_parity["even"]["outcomes"]["correct"]["rate"] == 1.0
    assert by_parity["odd"]["count"] == 3
    assert by_parity["odd"]["outcomes"]["correct"]["rate"] == pytest.approx(1 / 3)
    assert by_parity["odd"]["outcomes"]["wrong"]["count"] == 1
    assert by_parity["odd"]["reward_mean"] == pytest.approx(2.0 / 3)

    assert summary["env_metrics"] == {"parity/number": pytest.approx(21 / 5)}
    assert summary["truncated_rate"] == pytest.approx(0.2)
    assert summary["turns_per_rollout"] == pytest.approx(7 / 5)
    assert summary["tokens"] == {
        "prompt_total": 50,
        "completion_total": 20,
        "prompt_per_rollout": 10.0,
        "completion_per_rollout": 4.0,
    }
    assert summary["timing"]["seconds"] == 2.0
    assert summary["timing"]["rollouts_per_s"] == pytest.approx(2.5)
    assert summary["timing"]["mean_rollout_seconds"] == pytest.approx(0.5)
    assert sum(summary["histogram"]["counts"]) == 5
    assert summary["histogram"]["counts"][0] == 1 and summary["histogram"]["counts"][-1] == 3

    metrics = summary_metrics(summary)
    assert metrics["reward/mean"] == pytest.approx(1.0)
    assert metrics["reward/correct"] == pytest.approx(0.6)
    assert metrics["outcome/timeout"] == pytest.approx(0.2)
    assert metrics["parity/number"] == pytest.approx(4.2)
    assert metrics["length/truncated_rate"] == pytest.approx(0.2)


def test_summarize_with_no_rollouts_is_all_zeros(parity):
    summary = summarize(parity, [], seconds=0.0)
    assert summary["num_rollouts"] == 0
    assert summary["reward"] == {"mean": 0.0, "std": 0.0, "min": 0.0, "max": 0.0}
    assert summary["outcomes"]["correct"]["ci95"] == [0.0, 1.0]
    assert summary["timing"]["rollouts_per_s"] == 0.0


def test_format_summary_shows_tables_intervals_and_a_histogram(parity):
    rollouts = [
        _rollout(1.5, {"correct": 1.0, "format": 1.0}, "correct", number=2),
        _rollout(0.5, {"correct": 0.0, "format": 1.0}, "wrong", number=3),
    ]
    summary = summarize(parity, rollouts, seconds=1.0) | {"model": "m1"}
    text = format_summary(summary)
    assert "eval parity | model m1 | 2 rollouts | 0 errors" in text
    assert "correct" in text and "format" in text
    assert "[9.5%, 90.5%]" in text  # Wilson interval of 1 of 2
    assert "parity=even" in text and "parity=odd" in text
    assert "parity/number" in text
    bar_lines = [line for line in text.splitlines() if line.strip().startswith("[") and "#" in line]
    assert len(bar_lines) == 2
    assert "baselines" not in text


def test_format_summary_warns_loudly_when_the_constant_string_scores_like_the_oracle(parity):
    good = [_rollout(1.5, {"correct": 1.0, "format": 1.0}, "correct", number=2)]
    bad = [_rollout(0.0, {"correct": 0.0, "format": 0.0}, "unparsed", number=2)]
    model = summarize(parity, good, 1.0) | {"model": "m1"}
    honest = {
        "random": summarize(parity, good + bad, 1.0),
        "oracle": summarize(parity, good, 1.0),
        "constant": summarize(parity, bad, 1.0),
    }
    text = format_summary(model, honest)
    assert "model (m1)" in text and "random" in text and "oracle" in text
    assert "outcome/correct" in text and "reward/format" in text
    assert "verifier may be exploitable" not in text

    exploited = honest | {"constant": summarize(parity, good, 1.0)}
    text = format_summary(model, exploited)
    assert "WARNING" in text and "verifier may be exploitable" in text


# ---------------------------------------------------------------------------------------
# run_eval


def test_run_eval_reports_live_and_writes_results_and_metadata(parity, tmp_path):
    sink = RecordingSink()
    out = tmp_path / "out"
    cfg = EvalConfig(
        env="parity",
        model="oracle",
        env_args={"max_number": 50},
        num_examples=30,
        rollouts_per_example=2,
        out_dir=str(out),
        concurrency=4,
    )
    ParityOracle.closed.clear()
    result = run_eval(cfg, sink)

    assert isinstance(result, EvalResult)
    assert len(result.rollouts) == 60
    assert [r.example_id for r in result.rollouts[:4]] == [0, 0, 1, 1]
    assert result.summary["outcomes"]["correct"]["rate"] == 1.0
    assert result.summary["cancelled"] is False
    assert result.summary["model"] == "oracle"
    assert len(ParityOracle.closed) == 1  # the policy run_eval built is closed

    assert sink.progress_events[-1] == (60, 60, "eval")
    assert [done for done, _, _ in sink.progress_events] == list(range(61))
    steps = [step for step, _ in sink.metrics]
    assert steps == sorted(steps) and steps[-1] == 60 and len(steps) == 20
    last = sink.metrics[-1][1]
    assert last["reward/mean"] == pytest.approx(1.5)
    assert last["reward/correct"] == 1.0 and last["reward/format"] == 1.0
    assert last["outcome/correct"] == 1.0 and last["outcome/wrong"] == 0.0
    assert "parity/number" in last
    assert sum(len(batch) for _, batch in sink.rollout_batches) == 60
    assert [step for step, _ in sink.rollout_batches] == steps

    lines = (out / "results.jsonl").read_text().splitlines()
    assert len(lines) == 60
    row = json.loads(lines[0])
    for key in ("example_id", "seed", "messages", "rewards", "reward", "state", "outcome"):
        assert key in row
    for key in ("tokens", "truncated", "error", "num_turns", "info", "seconds"):
        assert key in row
    assert row["rewards"] == {"correct": 1.0, "format": 1.0}
    assert row["tokens"] == {"prompt": 7, "completion": 3}
    assert row["messages"][-1] == {"role": "assistant", "content": row["messages"][-1]["content"]}

    metadata = json.loads((out / "metadata.json").read_text())
    assert metadata["env"] == "parity"
    assert metadata["env_args"] == {"max_number": 50}
    assert metadata["model"] == "oracle"
    assert metadata["sampling"] == {
        "temperature": 0.7,
        "top_p": 1.0,
        "max_tokens": 256,
        "seed": None,
    }
    assert metadata["config"]["rollouts_per_example"] == 2
    assert metadata["config"]["api_key_env"] == "OPENAI_API_KEY"
    assert metadata["summary"]["num_rollouts"] == 60
    assert metadata["started_at"] <= metadata["finished_at"]
    assert metadata["rlcore_version"]


class _ProgressWitness(RecordingSink):
    """At each progress call, how many rollouts the sink had been handed and how many
    batches the engine had generated."""

    def __init__(self, engine):
        super().__init__()
        self.engine = engine
        self.seen: list[tuple[int, int, int]] = []

    def progress(self, done: int, total: int, desc: str = "") -> None:
        super().progress(done, total, desc)
        handed = sum(len(batch) for _, batch in self.rollout_batches)
        self.seen.append((done, handed, self.engine.batches_run))


def test_progress_counts_each_rollout_as_it_finishes_while_the_engine_batches(tiny_model):
    engine = load_policy(tiny_model, device="cpu")
    cfg = EvalConfig(env="tictactoe", model="tiny", num_examples=24, concurrency=8,
                     max_tokens=16, env_args={"max_turns": 3})  # fmt: skip
    sink = _ProgressWitness(engine)
    try:
        run_eval(cfg, sink, policy=engine)
    finally:
        asyncio.run(engine.aclose())
    # The engine answered several games' turns in each generation...
    assert engine.requests_served >= 2 * engine.batches_run
    # ...yet the bar moved one finished rollout at a time, not a batch at a time,
    assert [done for done, _, _ in sink.seen] == list(range(25))
    # each count sent with the rollout that finished (the sink already had it),
    assert all(handed == done for done, handed, _ in sink.seen)
    # and while the engine was still generating, not all at the end.
    first_finished_at = sink.seen[1][2]
    assert first_finished_at < engine.batches_run
    assert len({batches for done, _, batches in sink.seen if done}) >= 3


class _InOrder(RecordingSink):
    """Progress counts and log lines in the one order they came."""

    def __init__(self):
        super().__init__()
        self.events: list[tuple[str, object]] = []

    def progress(self, done: int, total: int, desc: str = "") -> None:
        super().progress(done, total, desc)
        self.events.append(("progress", done))

    def log(self, message: str, level: str = "info") -> None:
        super().log(message, level)
        self.events.append((level, message))


def test_a_game_that_outgrows_a_local_models_context_ends_truncated_and_warns_at_once(
    tiny_model,
):
    engine = load_policy(tiny_model, device="cpu")
    engine.context_length = 260  # a few turns of tic-tac-toe, then no room
    cfg = EvalConfig(env="tictactoe", model="tiny", num_examples=6, concurrency=2,
                     max_tokens=8, env_args={"max_turns": 9})  # fmt: skip
    sink = _InOrder()
    try:
        result = run_eval(cfg, sink, policy=engine)
    finally:
        asyncio.run(engine.aclose())
    # Every game is played and scored; the ones that outgrew the context end truncated.
    assert len(result.rollouts) == 6 and all(r.error is None for r in result.rollouts)
    outgrown = [r for r in result.rollouts if r.state.get("context_exceeded")]
    assert outgrown and all(r.truncated and r.outcome for r in outgrown)
    assert "context of 260" in outgrown[0].state["context_exceeded"]
    # Refused before generation: the engine generated only the replies the games hold.
    replies = sum(m["role"] == "assistant" for r in result.rollouts for m in r.messages)
    assert engine.requests_served == replies
    # Said once, as soon as it happened: before the count of the game that outgrew it.
    warnings = [i for i, (kind, _) in enumerate(sink.events) if kind == "warning"]
    assert len(warnings) == 1 and "outgrew the model's context" in sink.events[warnings[0]][1]
    counts = [(i, done) for i, (kind, done) in enumerate(sink.events) if kind == "progress"]
    finished_before = max(done for i, done in counts if i < warnings[0])
    assert min(done for i, done in counts if i > warnings[0]) == finished_before + 1


def test_run_eval_fills_env_defaults_into_metadata_and_leaves_a_given_policy_open(parity, tmp_path):
    policy = ParityOracle()
    cfg = EvalConfig(env="parity", model="mine", num_examples=5, out_dir=str(tmp_path))
    result = run_eval(cfg, policy=policy)
    assert result.summary["reward"]["mean"] == pytest.approx(1.5)
    assert policy.was_closed is False  # it belongs to the caller
    metadata = json.loads((tmp_path / "metadata.json").read_text())
    assert metadata["env_args"] == {"max_number": 100}


def test_run_eval_without_out_dir_writes_nothing(parity, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = run_eval(EvalConfig(env="parity", model="random", num_examples=8))
    assert result.out_dir is None
    assert list(tmp_path.iterdir()) == []
    assert result.summary["num_rollouts"] == 8


class _StopAfterFirstReport(RecordingSink):
    def metric(self, step, values):
        super().metric(step, values)
        self.stop_requested = True


def test_cancelling_through_the_sink_stops_scheduling_and_keeps_finished_rollouts(parity, tmp_path):
    sink = _StopAfterFirstReport()
    cfg = EvalConfig(
        env="parity", model="oracle", num_examples=100, concurrency=2, out_dir=str(tmp_path)
    )
    result = run_eval(cfg, sink)
    assert 5 <= len(result.rollouts) < 100
    assert result.summary["cancelled"] is True
    assert result.summary["num_rollouts"] == len(result.rollouts)
    reported = sum(len(batch) for _, batch in sink.rollout_batches)
    assert reported == len(result.rollouts)
    assert any(level == "warning" and "stop requested" in msg for level, msg in sink.logs)
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    assert len(lines) == len(result.rollouts)
    assert json.loads((tmp_path / "metadata.json").read_text())["summary"]["cancelled"] is True
    assert "CANCELLED" in format_summary(result.summary)


def test_a_stop_requested_before_the_start_runs_nothing_and_skips_baselines(parity):
    sink = RecordingSink()
    sink.stop_requested = True
    cfg = EvalConfig(env="parity", model="oracle", num_examples=10, baselines=True)
    result = run_eval(cfg, sink)
    assert result.rollouts == []
    assert result.summary["cancelled"] is True
    assert result.baselines == {}


def test_baselines_run_on_the_same_examples_through_the_same_verifier(parity, tmp_path):
    cfg = EvalConfig(
        env="parity", model="random", num_examples=40, baselines=True, out_dir=str(tmp_path)
    )
    sink = RecordingSink()
    result = run_eval(cfg, sink)
    assert list(result.baselines) == ["random", "oracle", "constant"]
    assert result.baselines["oracle"]["reward"]["mean"] == pytest.approx(1.5)
    # the constant string is a tic-tac-toe move, so the parity verifier gives it nothing
    assert result.baselines["constant"]["outcomes"]["unparsed"]["rate"] == 1.0
    assert result.baselines["random"]["num_rollouts"] == 40
    # baselines are not the model's live curve: metrics only ever come from the model's run
    assert all(step <= 40 for step, _ in sink.metrics)
    assert {desc for _, _, desc in sink.progress_events} == {
        "eval",
        "baseline random",
        "baseline oracle",
        "baseline constant",
    }
    metadata = json.loads((tmp_path / "metadata.json").read_text())
    assert set(metadata["baselines"]) == {"random", "oracle", "constant"}
    oracle_rows = (tmp_path / "baselines" / "oracle.jsonl").read_text().splitlines()
    assert len(oracle_rows) == 40
    text = format_summary(result.summary, result.baselines)
    assert "verifier may be exploitable" not in text


def test_run_eval_names_an_unknown_env_and_a_bad_parameter(parity):
    with pytest.raises(EvalConfigError, match="unknown environment 'nope'.*parity"):
        run_eval(EvalConfig(env="nope", model="oracle"))
    with pytest.raises(EvalConfigError, match="max_number: must be at most 10000, got 99999"):
        run_eval(EvalConfig(env="parity", model="oracle", env_args={"max_number": 99999}))
    with pytest.raises(EvalConfigError, match="colour: unknown parameter; accepted: max_number"):
        run_eval(EvalConfig(env="parity", model="oracle", env_args={"colour": "red"}))


def test_run_eval_names_out_of_range_settings():
    cfg = EvalConfig(env="parity", model="oracle", num_examples=0, top_p=1.5, concurrency=True)
    with pytest.raises(EvalConfigError) as error:
        run_eval(cfg)
    message = str(error.value)
    assert "num_examples must be an integer >= 1, got 0" in message
    assert "concurrency must be an integer >= 1, got True" in message
    assert "top_p must be a number in (0, 1], got 1.5" in message


def test_eval_config_to_dict_holds_every_field():
    cfg = EvalConfig(env="tictactoe", model="tiny", env_args={"max_turns": 6})
    data = cfg.to_dict()
    assert data["env"] == "tictactoe" and data["env_args"] == {"max_turns": 6}
    assert (data["num_examples"], data["rollouts_per_example"], data["max_tokens"]) == (10, 1, 256)
    assert (data["temperature"], data["concurrency"], data["seed"]) == (0.7, 32, 0)
    assert data["device"] == "auto" and data["baselines"] is False
    assert EvalConfig(**data) == cfg


# ---------------------------------------------------------------------------------------
# Tic-tac-toe: the numbers that show the env and its verifier are sound

ALWAYS_RANDOM_OPPONENT = {"min_random_move_prob": 1, "max_random_move_prob": 1}
PERFECT_OPPONENT = {"min_random_move_prob": 0, "max_random_move_prob": 0}


def test_the_oracle_never_loses_to_a_random_opponent_and_wins_most_games():
    cfg = EvalConfig(
        env="tictactoe", model="oracle", num_examples=200, env_args=ALWAYS_RANDOM_OPPONENT
    )
    summary = run_eval(cfg).summary
    outcomes = summary["outcomes"]
    assert list(outcomes)[:4] == ["win", "draw", "loss", "unfinished"]
    assert outcomes["loss"]["count"] == 0
    assert outcomes["unfinished"]["count"] == 0
    assert 0.87 <= outcomes["win"]["rate"] <= 0.99
    assert set(summary["breakdowns"]["starter"]) == {"model", "opponent"}
    assert summary["env_metrics"]["tictactoe/invalid_move_rate"] == 0.0
    assert summary["functions"]["format"]["mean"] == 1.0


def test_against_a_perfect_opponent_the_oracle_draws_and_random_loses_often():
    oracle = run_eval(
        EvalConfig(env="tictactoe", model="oracle", num_examples=60, env_args=PERFECT_OPPONENT)
    )
    assert oracle.summary["outcomes"]["draw"]["rate"] == 1.0
    random_player = run_eval(
        EvalConfig(env="tictactoe", model="random", num_examples=60, env_args=PERFECT_OPPONENT)
    )
    assert random_player.summary["outcomes"]["loss"]["rate"] > 0.5
    assert random_player.summary["outcomes"]["win"]["count"] == 0


def test_tictactoe_baselines_do_not_flag_the_verifier_as_exploitable():
    cfg = EvalConfig(env="tictactoe", model="oracle", num_examples=40, baselines=True)
    result = run_eval(cfg)
    constant = result.baselines["constant"]["reward"]["mean"]
    assert constant < result.baselines["random"]["reward"]["mean"]
    assert constant < result.baselines["oracle"]["reward"]["mean"]
    assert "verifier may be exploitable" not in format_summary(result.summary, result.baselines)


def test_jsonl_lines_keep_every_record_on_one_line_for_any_line_splitter():
    # Characters an untrained model writes that str.splitlines() breaks lines on.
    text = "a\x85b\u2028c\u2029d\x1ce\nf é ✓"
    line = jsonl_line({"content": text})
    assert line.endswith("\n") and len(line.splitlines()) == 1
    assert json.loads(line) == {"content": text}
    assert "é ✓" in line  # other text stays readable


def test_an_eval_logs_its_settings_milestones_and_summary():
    sink = RecordingSink()
    config = EvalConfig(env="tictactoe", model="oracle", num_examples=8, concurrency=2,
                        env_args={"max_turns": 6}, baselines=True)  # fmt: skip
    run_eval(config, sink)
    lines = [message for _, message in sink.logs]
    assert lines[0].startswith("eval: oracle on tictactoe: 8 examples x 1 rollouts")
    assert any(line.startswith("eval: 4/8 rollouts (50%)") for line in lines)
    assert any(
        line.startswith("eval: done: 8 rollouts in") and "loss 0.0%" in line for line in lines
    )
    assert any(line.startswith("baseline random: 8 rollouts") for line in lines)
