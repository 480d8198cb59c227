"""The math environment: generated problems with exact fraction and decimal answers.

Problems (fraction arithmetic, linear equations, decimals, percentages) come from the seed;
their answers are exact rationals. The model puts its answer in `\\boxed{...}`; the last
box with balanced braces is read, and it counts when it equals the answer in any common
form: 1/2, 0.5, \\frac{1}{2}, \\dfrac12, x = 1/2. Checking uses math-verify; when it
does not accept the answer, a fallback turns the LaTeX into plain arithmetic and evaluates
it exactly with the calculator's AST walker (rather than sympy's own string parser, which
runs `eval`: model text must never reach it). Only short answers made of numbers,
operators, fractions and letters are evaluated at all: a power tower such as 9^{9^{9^9}}
would keep a symbolic engine busy for hours, and no answer here needs one; nor does any
answer nest brackets deeper than a few levels, which makes math-verify's LaTeX grammar
take exponential time.
"""

from __future__ import annotations

import functools
import logging
import random
import re
from collections.abc import Callable
from fractions import Fraction
from functools import partial

from rlcore.envs.base import Param, SingleTurnEnv, example_seed
from rlcore.envs.calculator import evaluate_arithmetic
from rlcore.parsers import ThinkParser, last_assistant_text
from rlcore.policy.base import ConstantPolicy, Policy
from rlcore.rubric import Rubric
from rlcore.types import Example, Generation, Message, Rollout

PROBLEM_KINDS = ("fractions", "linear", "decimals", "percent")

SYSTEM_PROMPT = (
    "Solve the problem. You may think in <think>...</think> first. Put the final answer "
    "in \\boxed{...} as an exact fraction or decimal."
)

MAX_ANSWER_CHARS = 200
# math-verify's LaTeX grammar takes time exponential in brace depth: 11 levels of {} take
# 1.5 s and 60 levels did not finish in 5 minutes. An answer here nests 2 or 3 deep
# (\\frac{\\frac{1}{2}}{3}); deeper is not an answer and is not evaluated.
MAX_ANSWER_DEPTH = 4
_BOXED_RE = re.compile(r"\\boxed\s*\{")
# What changes a box's brace count: a brace, or an escape pair (`\\{` counts for nothing).
_BRACE_OR_ESCAPE_RE = re.compile(r"\\.|[{}]", re.DOTALL)
# LaTeX commands that appear in plain numeric answers; any other command is not evaluated.
_SAFE_COMMANDS_RE = re.compile(r"\\(?:[dt]?frac|left|right|cdot|times|div|displaystyle|[,;:! %])")
_SAFE_RESIDUE_RE = re.compile(r"[0-9A-Za-z\s.+\-*/()\[\]{}=,:%$]*")


# ---------------------------------------------------------------------------------------
# Reading the answer


def last_boxed(text: str | None) -> str | None:
    """The content of the last `\\boxed{...}` whose braces balance, or None.

    A `<think>` block in front is skipped, so a box drafted while thinking is not the
    answer. Escaped braces (`\\{`) do not count toward the balance.

    Boxes are tried from the last one back, each scanned only up to where the next one
    starts: a box still open there would still be open at the end of the text (the later
    box's own braces sit on top of its count), so scanning on could not close it. That keeps
    the work linear in the text however many boxes it opens and never closes.
    """
    answer_part = ThinkParser().answer(text)
    starts = list(_BOXED_RE.finditer(answer_part))
    scan_until = len(answer_part)
    for match in reversed(starts):
        depth = 1
        for brace in _BRACE_OR_ESCAPE_RE.finditer(answer_part, match.end(), scan_until):
            depth += {"{": 1, "}": -1}.get(brace.group(), 0)  # an escape pair counts 0
            if depth == 0:
                return answer_part[match.end() : brace.start()]
        scan_until = match.start()
    return None


def bracket_depth(content: str) -> int:
    """How deep (), [] and {} nest in `content`, all kinds counted together."""
    depth = deepest = 0
    for char in content:
        if char in "([{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in ")]}":
            depth = max(0, depth - 1)
    return deepest


def is_safe_to_evaluate(content: str) -> bool:
    """Short, nested no deeper than MAX_ANSWER_DEPTH, and only numbers, operators,
    letters and the harmless LaTeX commands."""
    if len(content) > MAX_ANSWER_CHARS or bracket_depth(content) > MAX_ANSWER_DEPTH:
        return False
    return _SAFE_RESIDUE_RE.fullmatch(_SAFE_COMMANDS_RE.sub(" ", content)) is not None


def _read_latex_argument(text: str, position: int) -> tuple[str, int]:
    """One argument of a LaTeX command: `{...}` or a single character (`\\frac12`)."""
    while position < len(text) and text[position].isspace():
        position += 1
    if position >= len(text):
        raise ValueError("a \\frac is missing an argument")
    if text[position] != "{":
        return text[position], position + 1
    depth, start = 0, position
    while position < len(text):
        depth += {"{": 1, "}": -1}.get(text[position], 0)
        position += 1
        if depth == 0:
            return text[start + 1 : position - 1], position
    raise ValueError("a \\frac argument has unbalanced braces")


def latex_to_arithmetic(content: str) -> str:
    """Plain arithmetic (`((1)/(2))`) from a LaTeX answer (`\\dfrac12`, `x = \\frac{1}{2}`)."""
    text = re.sub(r"\\[dt]frac", r"\\frac", content)
    text = re.sub(r"\\(?:left|right|displaystyle|[,;:! ])", "", text)
    text = text.replace("\\cdot", "*").replace("\\times", "*").replace("\\div", "/")
    while (start := text.find("\\frac")) != -1:
        numerator, position = _read_latex_argument(text, start + len("\\frac"))
        denominator, position = _read_latex_argument(text, position)
        text = f"{text[:start]}(({numerator})/({denominator})){text[position:]}"
    text = text.replace("{", "(").replace("}", ")").replace("$", "")
    text = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", text)
    return re.sub(r"^\s*[A-Za-z]\s*=", "", text).strip()


@functools.cache
def _math_verify():
    """math-verify's parse, verify and LaTeX config, loaded on first use.

    Loaded late because sympy and the LaTeX grammar take a while to import, and listing the
    environments (the web form) should not pay for it. We call it with its timeouts off
    (they use SIGALRM, which fails outside the main thread and cancels other alarms);
    `is_safe_to_evaluate` bounds the work instead, so its warning that nothing does is
    wrong here and is filtered out rather than shown to every CLI user.
    """
    import math_verify

    def drop_timeout_warning(record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")

    for logger_name in ("math_verify.grader", "math_verify.parser"):
        logging.getLogger(logger_name).addFilter(drop_timeout_warning)
    return math_verify.parse, math_verify.verify, math_verify.LatexExtractionConfig


# Kept: a group of rollouts of one example often boxes the same answer, and one
# math-verify call (its LaTeX grammar) costs milliseconds.
@functools.lru_cache(maxsize=4096)
def _verify_with_math_verify(content: str, truth: Fraction) -> bool:
    """math-verify's judgement (False when it cannot read the answer).

    Decimals count when they agree with the answer to 6 places (math-verify's rounding):
    0.333333 is 1/3, 0.33 is not.
    """
    import sympy

    parse, verify, LatexExtractionConfig = _math_verify()
    parsed = parse(
        f"\\boxed{{{content}}}",
        extraction_config=[LatexExtractionConfig()],
        parsing_timeout=None,
    )
    if not parsed:
        return False
    gold = sympy.Rational(truth.numerator, truth.denominator)
    return bool(verify(gold, parsed, timeout_seconds=None))


def answer_matches(content: str | None, truth: Fraction) -> bool:
    """Whether a boxed answer equals `truth`, by math-verify or by exact evaluation."""
    if content is None or not content.strip() or not is_safe_to_evaluate(content):
        return False
    try:
        if _verify_with_math_verify(content, truth):
            return True
    except Exception as exc:  # sympy and the LaTeX grammar raise many kinds on odd input
        logging.getLogger(__name__).debug("math-verify failed on %r: %s", content, exc)
    # math-verify misreads a few plain forms (a trailing "\ " makes it reject 0.5), and
    # evaluating the same answer exactly as plain arithmetic is a sound second opinion.
    try:
        return evaluate_arithmetic(latex_to_arithmetic(content)) == truth
    except (ValueError, ZeroDivisionError):
        return False


def correct_reward(*, completion: list[Message], example: Example, **_) -> float:
    """1 when the last boxed answer equals the exact answer."""
    content = last_boxed(last_assistant_text(completion))
    return 1.0 if answer_matches(content, Fraction(example.answer)) else 0.0


def format_reward(*, completion: list[Message], **_) -> float:
    """1 when the reply (after any think block) holds a non-empty \\boxed{...}."""
    content = last_boxed(last_assistant_text(completion))
    return 1.0 if content is not None and content.strip() else 0.0


def rebox(write: Callable[[Fraction], str], text: str) -> str:
    """`text` with its last boxed answer written another way by `write` (unchanged when
    the box holds no number)."""
    content = last_boxed(text)
    if content is None:
        return text
    try:
        value = evaluate_arithmetic(latex_to_arithmetic(content))
    except (ValueError, ZeroDivisionError):
        return text
    start = text.rfind(f"\\boxed{{{content}}}")
    if start == -1:
        return text
    end = start + len(f"\\boxed{{{content}}}")
    return f"{text[:start]}\\boxed{{{write(value)}}}{text[end:]}"


def _decimal_or_fraction(value: Fraction) -> str:
    """The value as a decimal where it has at most 4 places (what _decimal_text writes)."""
    return _decimal_text(value) if 10**4 % value.denominator == 0 else str(value)


def latex_number(value: Fraction) -> str:
    """`3`, `\\frac{1}{2}` or `-\\frac{3}{4}`."""
    if value.denominator == 1:
        return str(value.numerator)
    sign = "-" if value < 0 else ""
    return f"{sign}\\frac{{{abs(value.numerator)}}}{{{value.denominator}}}"


# ---------------------------------------------------------------------------------------
# Problems from a seed


def _decimal_text(value: Fraction) -> str:
    """A terminating decimal written out (values here have at most 4 places)."""
    whole, rest = divmod(abs(value.numerator) * 10**4 // value.denominator, 10**4)
    sign = "-" if value < 0 else ""
    return f"{sign}{whole}.{rest:04d}".rstrip("0").rstrip(".")


def _fractions_problem(rng: random.Random, max_value: int) -> tuple[str, Fraction]:
    # Shown as drawn (4/8 stays 4/8): simplifying is part of the task.
    numbers = [rng.randint(1, max_value), rng.randint(2, max_value)]
    numbers += [rng.randint(1, max_value), rng.randint(2, max_value)]
    left, right = Fraction(numbers[0], numbers[1]), Fraction(numbers[2], numbers[3])
    left_text, right_text = f"{numbers[0]}/{numbers[1]}", f"{numbers[2]}/{numbers[3]}"
    op = rng.choice("+-*/")
    if op in "+-":
        return (
            f"Compute {left_text} {op} {right_text}.",
            left + right if op == "+" else left - right,
        )
    symbol = "×" if op == "*" else "÷"
    value = left * right if op == "*" else left / right
    return f"Compute ({left_text}) {symbol} ({right_text}).", value


def _linear_problem(rng: random.Random, max_value: int) -> tuple[str, Fraction]:
    slope = rng.randint(2, max_value)
    offset = rng.choice([n for n in range(-max_value, max_value + 1) if n != 0])
    total = rng.randint(-max_value, max_value)
    sign = "+" if offset > 0 else "-"
    return (
        f"Solve {slope}x {sign} {abs(offset)} = {total} for x.",
        Fraction(total - offset, slope),
    )


def _decimals_problem(rng: random.Random, max_value: int) -> tuple[str, Fraction]:
    if rng.random() < 0.3:
        # Denominators of the form 2^a 5^b, so the decimal terminates.
        denominator = rng.choice([2, 4, 5, 8, 10, 16, 20, 25, 40, 50])
        numerator = rng.randint(1, max(1, min(max_value, denominator * 3)))
        value = Fraction(numerator, denominator)
        return f"Write {numerator}/{denominator} as a decimal.", value
    left = Fraction(rng.randint(1, max_value * 100), 100)
    right = Fraction(rng.randint(1, max_value * 10), 10)
    op = rng.choice("+-*")
    value = {"+": left + right, "-": left - right, "*": left * right}[op]
    symbol = "×" if op == "*" else op
    return f"Compute {_decimal_text(left)} {symbol} {_decimal_text(right)}.", value


def _percent_problem(rng: random.Random, max_value: int) -> tuple[str, Fraction]:
    percent = rng.choice([1, 2, 5, 10, 12, 15, 20, 25, 30, 40, 50, 60, 75, 80, 90, 120, 150])
    amount = rng.randint(1, max_value * 10)
    return f"What is {percent}% of {amount}?", Fraction(percent * amount, 100)


_GENERATORS = {
    "fractions": _fractions_problem,
    "linear": _linear_problem,
    "decimals": _decimals_problem,
    "percent": _percent_problem,
}


def parse_kinds(text: str) -> list[str]:
    """The problem kinds named in a comma-separated list; ValueError if any is unknown."""
    kinds = [kind.strip() for kind in text.split(",") if kind.strip()]
    unknown = [kind for kind in kinds if kind not in PROBLEM_KINDS]
    if unknown or not kinds:
        raise ValueError(
            f"unknown problem kinds {unknown or [text]}; accepted: a comma-separated list "
            f"of {', '.join(PROBLEM_KINDS)}"
        )
    if len(set(kinds)) != len(kinds):
        raise ValueError(f"problem kinds repeat in {text!r}; name each kind once")
    return kinds


class MathEnv(SingleTurnEnv):
    """Generated problems with exact answers, checked in any equivalent written form."""

    name = "math"
    description = (
        "Fraction, equation, decimal and percent problems; the last \\boxed{} answer is "
        "checked with math-verify, so 1/2, 0.5 and \\frac{1}{2} all count."
    )
    outcome_labels = ("correct", "incorrect")
    params = [
        Param(
            "problem_kinds",
            str,
            ",".join(PROBLEM_KINDS),
            "Comma-separated problem kinds: fractions, linear (solve ax + b = c), decimals, "
            "percent. Examples cycle through them evenly.",
        ),
        Param(
            "max_value",
            int,
            12,
            "Largest numerator, denominator or coefficient drawn for a problem.",
            min=2,
            max=1000,
        ),
    ]

    def __init__(self, **params):
        super().__init__(**params)
        self.kinds = parse_kinds(self.config["problem_kinds"])

    def check_params(self, config: dict) -> dict[str, str]:
        try:
            parse_kinds(config["problem_kinds"])
        except ValueError as exc:
            return {"problem_kinds": str(exc)}
        return {}

    def build_rubric(self) -> Rubric:
        rubric = Rubric()
        rubric.add(correct_reward, 1.0, name="correct", bounds=(0.0, 1.0))
        rubric.add(format_reward, 0.0, name="format", bounds=(0.0, 1.0))
        return rubric

    @property
    def num_groups(self) -> int:
        return len(self.kinds)

    def make_example(self, index: int, seed: int) -> Example:
        ex_seed = example_seed(seed, index)
        rng = random.Random(ex_seed)
        group = index % len(self.kinds)
        kind = self.kinds[group]
        question, value = _GENERATORS[kind](rng, self.config["max_value"])
        return Example(
            id=index,
            seed=ex_seed,
            prompt=[
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": question},
            ],
            answer=str(value),
            info={"kind": kind, "answer_latex": latex_number(value)},
            group=group,
        )

    def setup_state(self, example: Example) -> dict:
        return {"answer_latex": latex_number(Fraction(example.answer))}

    def outcome(self, state: dict, rewards: dict[str, float]) -> str:
        return "correct" if rewards.get("correct") == 1.0 else "incorrect"

    def breakdowns(self, rollout: Rollout) -> dict[str, str]:
        return {"kind": str(rollout.info.get("kind", ""))}

    def format_variants(self) -> dict[str, Callable[[str], str]]:
        return {
            "a/b instead of \\frac": partial(rebox, lambda value: str(value)),
            "decimal where it ends": partial(rebox, _decimal_or_fraction),
            "x = in the box": partial(rebox, lambda value: f"x = {latex_number(value)}"),
            "\\dfrac": partial(rebox, lambda value: latex_number(value).replace("frac", "dfrac")),
        }

    def builtin_policies(self) -> dict[str, Callable[[], Policy]]:
        return {
            "constant": partial(ConstantPolicy, "\\boxed{0}"),
            "oracle": MathOraclePolicy,
        }


class MathOraclePolicy(Policy):
    """Boxes the exact answer as LaTeX."""

    name = "oracle"

    async def generate(self, messages, sampling, *, tools=None, state=None) -> Generation:
        return Generation(text=f"The answer is \\boxed{{{(state or {}).get('answer_latex')}}}.")
