"""The reverse-text, double-check, calculator and math environments: datasets, parameter
errors, rewards on hand-written replies, and whole rollouts with their built-in players."""

from __future__ import annotations

import json
import re
from fractions import Fraction

import pytest

from rlcore.envs import ParamError, load_environment
from rlcore.envs.calculator import (
    CalculatorEnv,
    CalculatorOraclePolicy,
    calculate,
    evaluate_arithmetic,
    format_number,
    parse_number,
)
from rlcore.envs.code_env import CodeEnv
from rlcore.envs.double_check import DoubleCheckEnv
from rlcore.envs.math_env import MathEnv, answer_matches, last_boxed, latex_to_arithmetic
from rlcore.envs.reverse_text import (
    ReverseTextEnv,
    lcs_length,
    lcs_ratio,
    paragraphs,
    parse_reversal,
)
from rlcore.policy.base import Policy
from rlcore.rollout import run_rollouts
from rlcore.types import Example, Generation, Rollout, SamplingParams

SAMPLING = SamplingParams(max_tokens=64)


class ScriptedPolicy(Policy):
    """Replies with the given texts in turn (the last one repeats), and records calls."""

    name = "scripted"

    def __init__(self, *texts: str):
        self.texts = list(texts)
        self.seen_tools: list[list[dict] | None] = []

    async def generate(self, messages, sampling, *, tools=None, state=None) -> Generation:
        self.seen_tools.append(tools)
        turn = sum(m.get("role") == "assistant" for m in messages)
        return Generation(text=self.texts[min(turn, len(self.texts) - 1)])


def score_reply(env, example: Example, *replies: str) -> dict[str, float]:
    """Rewards of a conversation made of the example's prompt and these assistant replies,
    with the environment's own replies in between."""
    messages = list(example.prompt)
    state = env.setup_state(example)
    for i, reply in enumerate(replies):
        messages.append({"role": "assistant", "content": reply})
        if i < len(replies) - 1:
            messages.extend(env.env_response(messages, state))
    values, _ = env.rubric.score(
        messages=messages,
        completion=messages[len(example.prompt) :],
        state=state,
        example=example,
        parser=env.parser,
    )
    return values


async def mean_reward(env, policy_name: str, n: int = 12) -> tuple[float, list]:
    policy = env.builtin_policies()[policy_name]()
    rollouts = await run_rollouts(env, policy, env.examples(n, seed=3), sampling=SAMPLING)
    assert all(r.error is None for r in rollouts), [r.error for r in rollouts]
    return sum(r.reward for r in rollouts) / len(rollouts), rollouts


def dicts(examples: list[Example]) -> list[dict]:
    return [ex.to_dict() for ex in examples]


ALL_ENVS = {
    "reverse_text": ReverseTextEnv,
    "double_check": DoubleCheckEnv,
    "calculator": CalculatorEnv,
    "math": MathEnv,
    "code": CodeEnv,
}


@pytest.mark.parametrize("name", sorted(ALL_ENVS))
def test_the_registry_loads_each_env_by_name(name):
    env = load_environment(name)
    assert isinstance(env, ALL_ENVS[name])
    assert env.name == name
    assert {"constant", "oracle"} <= set(env.builtin_policies())


@pytest.mark.parametrize("name", sorted(ALL_ENVS))
def test_datasets_depend_only_on_the_seed(name):
    env = load_environment(name)
    first = dicts(env.examples(6, seed=11))
    assert first == dicts(load_environment(name).examples(6, seed=11))
    assert first != dicts(env.examples(6, seed=12))
    # An offset continues the same dataset rather than starting a new one.
    assert dicts(env.examples(2, seed=11, offset=4)) == first[4:]
    json.dumps(first)  # rows go to results.jsonl and the database


@pytest.mark.parametrize("name", sorted(ALL_ENVS))
def test_unknown_parameters_are_named_in_the_error(name):
    with pytest.raises(ParamError) as caught:
        load_environment(name, colour="blue")
    assert "colour" in caught.value.errors
    assert "accepted" in caught.value.errors["colour"]


# ---------------------------------------------------------------------------------------
# reverse_text


def test_reverse_text_random_mode_is_the_short_task_the_trainer_uses():
    env = ReverseTextEnv(mode="random", min_chars=2, max_chars=2, alphabet="ab")
    for example in env.examples(20, seed=0):
        system, user = example.prompt
        assert system == {
            "role": "system",
            "content": "Reverse the text. Answer as <reversed>...</reversed>.",
        }
        assert user["role"] == "user"
        assert len(user["content"]) == 2 and set(user["content"]) <= {"a", "b"}
        assert example.answer == user["content"][::-1]


def test_reverse_text_paragraph_excerpts_fit_the_length_and_end_on_a_whole_word():
    env = ReverseTextEnv(min_chars=40, max_chars=120)
    words = {word for paragraph in paragraphs() for word in paragraph.split()}
    for example in env.examples(30, seed=5):
        text = example.info["text"]
        assert 40 <= len(text) <= 120
        assert example.prompt[1]["content"] == f"<text>{text}</text>"
        # A word is cut only when no space falls between min_chars and the drawn length.
        assert text.split()[-1] in words or " " not in text[40:]
        assert example.answer == text[::-1]


def test_reverse_text_long_excerpts_join_paragraphs():
    env = ReverseTextEnv(min_chars=1500, max_chars=1600)
    text = env.examples(1, seed=0)[0].info["text"]
    assert 1500 <= len(text) <= 1600


def test_the_shipped_paragraphs_are_many_distinct_and_tag_free():
    shipped = paragraphs()
    assert len(shipped) >= 60
    assert len(set(shipped)) == len(shipped)
    assert not any("<" in p or ">" in p for p in shipped)


@pytest.mark.parametrize(
    ("params", "field", "fragment"),
    [
        ({"min_chars": 50, "max_chars": 10}, "min_chars", "at most max_chars (10)"),
        ({"min_chars": 0}, "min_chars", "at least 1"),
        ({"mode": "poem"}, "mode", "['paragraph', 'random']"),
        ({"alphabet": "  "}, "alphabet", "visible character"),
        ({"alphabet": "ab<"}, "alphabet", "must not contain <"),
        ({"max_chars": "lots"}, "max_chars", "expected an integer, got 'lots'"),
    ],
)
def test_reverse_text_rejects_bad_params(params, field, fragment):
    with pytest.raises(ParamError) as caught:
        ReverseTextEnv(**params)
    assert fragment in caught.value.errors[field]


def test_lcs_counts_a_common_subsequence_not_a_substring():
    assert lcs_length("abcde", "ace") == 3
    assert lcs_length("abc", "xyz") == 0
    assert lcs_length("", "abc") == 0
    assert lcs_length("AGGTAB", "GXTXAYB") == 4
    assert lcs_ratio("abc", "abc") == 1.0
    assert lcs_ratio("", "") == 1.0
    assert lcs_ratio("abc", "cba") == pytest.approx(2 * 1 / 6)


def test_reverse_text_rewards_on_hand_written_replies():
    env = ReverseTextEnv(mode="random", min_chars=5, max_chars=5, alphabet="abc")
    example = Example(
        id=0,
        seed=0,
        prompt=[{"role": "user", "content": "abcab"}],
        answer="bacba",
        info={"text": "abcab"},
    )
    exact = score_reply(env, example, "<reversed>bacba</reversed>")
    assert exact == {"lcs": 1.0, "format": 1.0}
    thought = score_reply(env, example, "<think>backwards</think>\n<reversed> bacba </reversed>")
    assert thought == {"lcs": 1.0, "format": 1.0}
    # Unreversed input shares "aba"/"bab" with its reversal: partial credit, not full.
    copied = score_reply(env, example, "<reversed>abcab</reversed>")
    assert copied["lcs"] == pytest.approx(2 * 3 / 10)
    chatty = score_reply(env, example, "Sure! <reversed>bacb</reversed> hope that helps")
    assert chatty == {"lcs": pytest.approx(2 * 4 / 9), "format": 0.5}
    assert score_reply(env, example, "bacba") == {"lcs": 0.0, "format": 0.0}
    assert score_reply(env, example, "<think><reversed>bacba</reversed></think> done") == {
        "lcs": 0.0,
        "format": 0.0,
    }
    assert score_reply(env, example, "<reversed>bacba") == {"lcs": 0.0, "format": 0.0}


def test_parse_reversal_takes_the_last_tag_after_thinking():
    assert parse_reversal("<reversed>x</reversed><reversed>y</reversed>") == "y"
    assert parse_reversal("<think><reversed>x</reversed></think><reversed>z</reversed>") == "z"
    assert parse_reversal(None) is None


async def test_reverse_text_baselines_span_floor_to_ceiling():
    env = ReverseTextEnv()
    oracle, rollouts = await mean_reward(env, "oracle")
    assert oracle == 1.0
    assert {r.outcome for r in rollouts} == {"correct"}
    assert all(env.rollout_metrics(r) == {"answered": 1.0, "length_ratio": 1.0} for r in rollouts)
    constant, rollouts = await mean_reward(env, "constant")
    assert constant < 0.1
    assert {r.outcome for r in rollouts} == {"incorrect"}
    echo, _ = await mean_reward(env, "echo")
    assert constant < echo < 1.0


# ---------------------------------------------------------------------------------------
# double_check


def test_double_check_questions_have_the_right_answers():
    env = DoubleCheckEnv(question_kinds="arithmetic,chain", max_operand=30)
    for example in env.examples(40, seed=2):
        expression = re.fullmatch(r"What is (.+)\?", example.prompt[1]["content"]).group(1)
        assert evaluate_arithmetic(expression) == example.answer


def test_double_check_cycles_question_kinds_as_groups():
    env = DoubleCheckEnv()
    assert env.num_groups == 3
    examples = env.examples(6, seed=0)
    assert [ex.info["kind"] for ex in examples] == ["arithmetic", "word", "chain"] * 2
    assert [ex.group for ex in examples] == [0, 1, 2, 0, 1, 2]
    word = DoubleCheckEnv(question_kinds="word").examples(10, seed=0)
    assert all(isinstance(ex.answer, int) and ex.answer >= 0 for ex in word)


@pytest.mark.parametrize(
    ("params", "field", "fragment"),
    [
        ({"question_kinds": "arithmetic,riddles"}, "question_kinds", "['riddles']"),
        ({"question_kinds": " , "}, "question_kinds", "accepted: a comma-separated list"),
        ({"question_kinds": "word,word"}, "question_kinds", "name each kind once"),
        ({"challenge": "   "}, "challenge", "must not be empty"),
        ({"max_operand": 1}, "max_operand", "at least 2"),
    ],
)
def test_double_check_rejects_bad_params(params, field, fragment):
    with pytest.raises(ParamError) as caught:
        DoubleCheckEnv(**params)
    assert fragment in caught.value.errors[field]


def _double_check_example(answer: int = 391) -> Example:
    return Example(
        id=0,
        seed=0,
        prompt=[{"role": "user", "content": "What is 17 * 23?"}],
        answer=answer,
        info={"kind": "arithmetic"},
    )


def _double_check_metrics(env, example, *replies):
    messages = list(example.prompt)
    for reply in replies:
        messages.append({"role": "assistant", "content": reply})
    rollout = Rollout(
        example_id=0,
        seed=0,
        group=0,
        messages=messages,
        prompt_len=len(example.prompt),
        state=env.setup_state(example),
    )
    return env.rollout_metrics(rollout)


@pytest.mark.parametrize(
    ("replies", "rewards", "metrics"),
    [
        (
            ("<answer>391</answer>", "Yes. <answer>391</answer>"),
            {"correct": 1.0, "first_correct": 1.0, "format": 1.0},
            {"changed_answer": 0.0, "fixed": 0.0, "broke": 0.0},
        ),
        (
            ("<answer>381</answer>", "Let me recheck. <answer>391</answer>"),
            {"correct": 1.0, "first_correct": 0.0, "format": 1.0},
            {"changed_answer": 1.0, "fixed": 1.0, "broke": 0.0},
        ),
        (
            ("<answer>391</answer>", "Sorry, it is <answer>392</answer>"),
            {"correct": 0.0, "first_correct": 1.0, "format": 1.0},
            {"changed_answer": 1.0, "fixed": 0.0, "broke": 1.0},
        ),
        (
            # A reply without a tag keeps the earlier answer.
            ("<think>17*23</think><answer>391.0</answer>", "Yes, I am sure."),
            {"correct": 1.0, "first_correct": 1.0, "format": 0.5},
            {"changed_answer": 0.0, "fixed": 0.0, "broke": 0.0},
        ),
        (
            ("It is 391", "<answer>three hundred</answer>"),
            {"correct": 0.0, "first_correct": 0.0, "format": 0.0},
            {"changed_answer": 0.0, "fixed": 0.0, "broke": 0.0},
        ),
    ],
)
def test_double_check_scores_the_final_answer(replies, rewards, metrics):
    env = DoubleCheckEnv()
    example = _double_check_example()
    assert score_reply(env, example, *replies) == rewards
    assert _double_check_metrics(env, example, *replies) == metrics


async def test_double_check_rollouts_challenge_once_and_score_the_oracle_fully():
    env = DoubleCheckEnv(challenge="Really?")
    oracle, rollouts = await mean_reward(env, "oracle")
    assert oracle == 1.0
    for rollout in rollouts:
        roles = [m["role"] for m in rollout.completion]
        assert roles == ["assistant", "user", "assistant"]
        assert rollout.completion[1]["content"] == "Really?"
        assert rollout.num_turns == 2 and not rollout.truncated
        assert rollout.rewards == {"correct": 1.0, "first_correct": 1.0, "format": 1.0}
        assert env.breakdowns(rollout)["kind"] in {"arithmetic", "word", "chain"}
    constant, rollouts = await mean_reward(env, "constant")
    assert constant < 0.2
    assert {r.outcome for r in rollouts} <= {"correct", "incorrect"}


# ---------------------------------------------------------------------------------------
# calculator


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("(37 * 12) - 145 / 5", "415"),
        ("1/3", "0.333333333333"),
        ("0.1 + 0.2", "0.3"),
        ("-(-3) * +2", "6"),
        ("10 / 4", "2.5"),
        ("2 × 3 ÷ 4", "1.5"),
        ("1/7 * 1e-30", "1.42857142857e-31"),
    ],
)
def test_calculate_evaluates_arithmetic_exactly(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize(
    ("expression", "fragment"),
    [
        ("1 / (2 - 2)", "division by zero"),
        ("2 ** 10", "unsupported operator '**'"),
        ("2 ^ 10", "unsupported operator '^'"),
        ("__import__('os').system('true')", "unsupported syntax (Call)"),
        ("x + 1", "unsupported syntax (Name)"),
        ("True + 1", "True is not a number"),
        ("1 +", "cannot parse"),
        ("", "empty"),
        ("1" * 501, "the limit is 500"),
        ("9" * 400, "too large"),
        ("1e999", "too large"),
    ],
)
def test_calculate_reports_bad_input_as_a_readable_error(expression, fragment):
    with pytest.raises(ValueError, match=re.escape(fragment)):
        calculate(expression)


def test_numbers_in_answers_parse_strictly():
    assert parse_number("42") == 42
    assert parse_number("-3.5") == Fraction(-7, 2)
    assert parse_number("1,234") == 1234
    assert parse_number("$12.") == 12
    assert parse_number("7/8") == Fraction(7, 8)
    assert parse_number("x = 5") == 5
    assert parse_number(format_number(Fraction(1, 3))) == Fraction(333333333333, 10**12)
    for not_an_answer in ("5 - 3", "", None, "abc", "1/0", "1e1000"):
        assert parse_number(not_an_answer) is None


def test_the_calculate_tool_schema_comes_from_its_signature():
    (schema,) = CalculatorEnv().tool_schemas
    function = schema["function"]
    assert function["name"] == "calculate"
    assert function["parameters"]["required"] == ["expression"]
    assert function["parameters"]["properties"]["expression"]["type"] == "string"
    assert "calculate" in CalculatorEnv().examples(1)[0].prompt[0]["content"]


def test_calculator_examples_have_the_requested_number_of_operations():
    for operations in (1, 4, 6):
        env = CalculatorEnv(num_operations=operations, max_operand=20)
        for example in env.examples(15, seed=operations):
            expression = example.info["expression"]
            assert sum(expression.count(op) for op in "+-*/") == operations
            assert evaluate_arithmetic(expression) == Fraction(example.answer)


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"num_operations": 0}, "num_operations"),
        ({"num_operations": 7}, "num_operations"),
        ({"max_turns": 0}, "max_turns"),
        ({"tolerance": -0.1}, "tolerance"),
        ({"tolerance": "nan"}, "tolerance"),
    ],
)
def test_calculator_rejects_bad_params(params, field):
    with pytest.raises(ParamError) as caught:
        CalculatorEnv(**params)
    assert list(caught.value.errors) == [field]


def test_calculator_answers_count_within_the_tolerance():
    env = CalculatorEnv(tolerance=0.001)
    example = Example(id=0, seed=0, prompt=[], answer="1000/3", info={"expression": "1000/3"})
    assert score_reply(env, example, "<answer>333.333</answer>") == {"correct": 1.0, "format": 1.0}
    assert score_reply(env, example, "<answer>1000/3</answer>")["correct"] == 1.0
    assert score_reply(env, example, "<answer>333.6</answer>")["correct"] == 1.0
    assert score_reply(env, example, "<answer>334</answer>")["correct"] == 0.0
    assert score_reply(env, example, "about 333.33") == {"correct": 0.0, "format": 0.0}


@pytest.mark.parametrize("native_tools", [False, True])
async def test_calculator_oracle_goes_through_the_tool(native_tools):
    env = CalculatorEnv()
    policy = CalculatorOraclePolicy(native_tools=native_tools)
    rollouts = await run_rollouts(env, policy, env.examples(8, seed=1), sampling=SAMPLING)
    for rollout in rollouts:
        assert rollout.error is None
        call_message, tool_message, final = rollout.completion
        (call,) = call_message["tool_calls"]
        assert call["function"]["name"] == "calculate"
        assert tool_message["role"] == "tool"
        assert tool_message["tool_call_id"] == call["id"]
        assert tool_message["content"] == rollout.info["value"]
        assert final == {
            "role": "assistant",
            "content": f"<answer>{rollout.info['value']}</answer>",
        }
        assert rollout.rewards == {"correct": 1.0, "format": 1.0}
        assert rollout.outcome == "correct"
        assert env.rollout_metrics(rollout) == {
            "tool_calls": 1.0,
            "tool_errors": 0.0,
            "used_tool": 1.0,
        }


async def test_calculator_offers_the_tool_schema_to_the_policy():
    env = CalculatorEnv()
    policy = ScriptedPolicy("<answer>1</answer>")
    await env.rollout(policy, env.examples(1)[0], SAMPLING)
    assert policy.seen_tools == [env.tool_schemas]


@pytest.mark.parametrize(
    ("call_text", "error_fragment"),
    [
        ("<tool_call>{not json</tool_call>", "unknown tool ''"),
        ('<tool_call>{"name": "calc", "arguments": {}}</tool_call>', "unknown tool 'calc'"),
        (
            '<tool_call>{"name": "calculate", "arguments": {"expr": "1"}}</tool_call>',
            "unexpected keyword argument 'expr'",
        ),
        (
            '<tool_call>{"name": "calculate", "arguments": {"expression": "1/0"}}</tool_call>',
            "division by zero",
        ),
        (
            '<tool_call>{"name": "calculate", "arguments": "[1]"}</tool_call>',
            "must be a JSON object",
        ),
    ],
)
async def test_calculator_bad_tool_calls_come_back_as_error_messages(call_text, error_fragment):
    env = CalculatorEnv()
    example = env.examples(1, seed=4)[0]
    policy = ScriptedPolicy(call_text, f"<answer>{example.info['value']}</answer>")
    rollout = await env.rollout(policy, example, SAMPLING)
    assert rollout.error is None
    tool_message = rollout.completion[1]
    assert tool_message["role"] == "tool"
    assert tool_message["tool_call_id"] == rollout.completion[0]["tool_calls"][0]["id"]
    assert tool_message["content"].startswith("Error: ")
    assert error_fragment in tool_message["content"]
    assert env.rollout_metrics(rollout) == {"tool_calls": 1.0, "tool_errors": 1.0, "used_tool": 1.0}
    assert rollout.rewards["correct"] == 1.0


async def test_calculator_stops_a_model_that_only_calls_tools_at_max_turns():
    env = CalculatorEnv(max_turns=3)
    policy = ScriptedPolicy(
        '<tool_call>{"name": "calculate", "arguments": {"expression": "1+1"}}</tool_call>'
    )
    rollout = await env.rollout(policy, env.examples(1)[0], SAMPLING)
    assert rollout.truncated and rollout.state["hit_max_turns"]
    assert rollout.num_turns == 3
    assert rollout.rewards == {"correct": 0.0, "format": 0.0}
    assert rollout.outcome == "incorrect"


async def test_calculator_constant_policy_is_near_the_floor():
    constant, rollouts = await mean_reward(CalculatorEnv(), "constant")
    assert constant < 0.2
    assert all(CalculatorEnv().rollout_metrics(r)["used_tool"] == 0.0 for r in rollouts)


# ---------------------------------------------------------------------------------------
# math


@pytest.mark.parametrize(
    ("text", "content"),
    [
        ("The answer is \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
        ("\\boxed{1} then \\boxed{2}", "2"),
        ("\\boxed{{a}{b}}", "{a}{b}"),
        ("\\boxed{3} and a truncated \\boxed{\\frac{1}{", "3"),
        ("<think>\\boxed{9}</think> so \\boxed{4}", "4"),
        ("<think>maybe \\boxed{9}</think> no box", None),
        ("\\boxed{a\\}b}", "a\\}b"),
        ("\\boxed {7}", "7"),
        ("no box here", None),
        ("", None),
    ],
)
def test_last_boxed_reads_the_last_balanced_box(text, content):
    assert last_boxed(text) == content


@pytest.mark.parametrize(
    ("written", "truth"),
    [
        ("1/2", "1/2"),
        ("0.5", "1/2"),
        (".5", "1/2"),
        ("\\frac{1}{2}", "1/2"),
        ("\\dfrac12", "1/2"),
        ("\\tfrac{1}{2}", "1/2"),
        ("2/4", "1/2"),
        ("x = \\frac{1}{2}", "1/2"),
        ("\\left(\\frac{1}{2}\\right)", "1/2"),
        ("-\\frac{3}{4}", "-3/4"),
        ("\\frac{-3}{4}", "-3/4"),
        ("-0.75", "-3/4"),
        ("12", "12"),
        ("12.0", "12"),
        ("1,000", "1000"),
        ("0.333333", "1/3"),
        # math-verify rejects this one; the exact fallback accepts it.
        ("0.5\\ ", "1/2"),
    ],
)
def test_math_accepts_equivalent_forms(written, truth):
    assert answer_matches(written, Fraction(truth))


@pytest.mark.parametrize(
    ("written", "truth"),
    [
        ("0.33", "1/3"),
        ("1/3", "1/2"),
        ("-0.5", "1/2"),
        ("2", "1/2"),
        ("x", "1/2"),
        ("\\frac{1}{0}", "1"),
        ("", "0"),
        ("9^{9^{9^{9}}}", "1"),
        ("\\sqrt{4}", "2"),
        ("1" * 201, "1"),
    ],
)
def test_math_rejects_wrong_or_unsafe_answers(written, truth):
    assert not answer_matches(written, Fraction(truth))


@pytest.mark.parametrize(
    ("latex", "value"),
    [
        ("\\dfrac12", "1/2"),
        ("x=\\frac{\\frac{1}{2}}{3}", "1/6"),
        ("\\left(2\\cdot\\frac{3}{4}\\right)", "3/2"),
        ("6 \\div 4", "3/2"),
        ("1,500", "1500"),
    ],
)
def test_the_fallback_turns_latex_into_plain_arithmetic(latex, value):
    assert evaluate_arithmetic(latex_to_arithmetic(latex)) == Fraction(value)


def test_math_problems_have_the_right_answers():
    env = MathEnv(max_value=20)
    for example in env.examples(60, seed=9):
        question, answer = example.prompt[1]["content"], Fraction(example.answer)
        if solved := re.fullmatch(r"Solve (\d+)x ([+-]) (\d+) = (-?\d+) for x\.", question):
            slope, sign, offset, total = solved.groups()
            offset = int(offset) if sign == "+" else -int(offset)
            assert int(slope) * answer + offset == int(total)
        elif percent := re.fullmatch(r"What is (\d+)% of (\d+)\?", question):
            assert answer == Fraction(int(percent.group(1)) * int(percent.group(2)), 100)
        elif written := re.fullmatch(r"Write (\d+)/(\d+) as a decimal\.", question):
            assert answer == Fraction(int(written.group(1)), int(written.group(2)))
        else:
            expression = re.fullmatch(r"Compute (.+)\.", question).group(1)
            assert evaluate_arithmetic(expression) == answer
        assert answer_matches(example.info["answer_latex"], answer)


def test_math_cycles_problem_kinds_and_rejects_unknown_ones():
    env = MathEnv(problem_kinds="linear,percent")
    assert [ex.info["kind"] for ex in env.examples(4)] == ["linear", "percent"] * 2
    with pytest.raises(ParamError) as caught:
        MathEnv(problem_kinds="linear,calculus")
    assert "['calculus']" in caught.value.errors["problem_kinds"]
    with pytest.raises(ParamError) as caught:
        MathEnv(max_value=1001)
    assert "at most 1000" in caught.value.errors["max_value"]


def test_math_rewards_on_hand_written_replies():
    env = MathEnv()
    example = Example(id=0, seed=0, prompt=[], answer="1/2", info={})
    assert score_reply(env, example, "<think>3/4-1/4</think>\\boxed{0.5}") == {
        "correct": 1.0,
        "format": 1.0,
    }
    assert score_reply(env, example, "\\boxed{1/3}") == {"correct": 0.0, "format": 1.0}
    assert score_reply(env, example, "The answer is 1/2.") == {"correct": 0.0, "format": 0.0}
    assert score_reply(env, example, "\\boxed{}") == {"correct": 0.0, "format": 0.0}
    assert score_reply(env, example, "\\boxed{\\frac{1}{2}") == {"correct": 0.0, "format": 0.0}


async def test_math_baselines_span_floor_to_ceiling():
    env = MathEnv()
    oracle, rollouts = await mean_reward(env, "oracle")
    assert oracle == 1.0
    assert {env.breakdowns(r)["kind"] for r in rollouts} == set(env.kinds)
    constant, _ = await mean_reward(env, "constant")
    assert constant < 0.2
