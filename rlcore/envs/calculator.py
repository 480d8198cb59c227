"""The calculator environment: multi-step arithmetic with a `calculate` tool.

Each example is an expression such as `(37 * 12) - 145 / 5`, built from the seed with
`num_operations` operators. The model may call `calculate(expression)` (natively or as
`<tool_call>{...}</tool_call>` text) and must end with `<answer>NUMBER</answer>`; the
answer counts when it is within `tolerance` (relative) of the exact value. The tool
evaluates with exact fractions through a small AST walker, never `eval`, and reports bad
input as an error message the model can read. `evaluate_arithmetic`, `format_number` and
`parse_number` are also used by the double-check and math environments.
"""

from __future__ import annotations

import ast
import json
import operator
import random
import re
from collections.abc import Callable
from decimal import Context, Decimal
from fractions import Fraction
from functools import partial

from rlcore.envs.base import Param, ToolEnv, example_seed
from rlcore.parsers import XMLParser, last_assistant_text
from rlcore.policy.base import ConstantPolicy, Policy
from rlcore.rubric import Rubric
from rlcore.types import Example, Generation, Message, Rollout

# Long enough for any expression this env asks about, short enough that no input can
# make the exact arithmetic slow.
MAX_EXPRESSION_CHARS = 500
# Results beyond this many bits (about 300 digits) are refused rather than printed:
# Python refuses to print ints over 4300 digits, and no answer here is that large.
MAX_RESULT_BITS = 1000
SIGNIFICANT_DIGITS = 12

_BINARY_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}
# Named in error messages, so the model learns what it wrote that is not supported.
_OTHER_OP_SYMBOLS = {
    ast.Pow: "**",
    ast.Mod: "%",
    ast.FloorDiv: "//",
    ast.BitXor: "^",
    ast.BitAnd: "&",
    ast.BitOr: "|",
    ast.LShift: "<<",
    ast.RShift: ">>",
    ast.MatMult: "@",
}


def _check_size(value: Fraction) -> Fraction:
    if max(value.numerator.bit_length(), value.denominator.bit_length()) > MAX_RESULT_BITS:
        raise ValueError("a value is too large (more than about 300 digits)")
    return value


def _evaluate_node(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Expression):
        return _evaluate_node(node.body)
    if isinstance(node, ast.Constant):
        # bool is an int subclass; "True + 1" is not arithmetic we accept.
        if isinstance(node.value, bool) or not isinstance(node.value, int | float):
            raise ValueError(f"{node.value!r} is not a number")
        if isinstance(node.value, float):
            if node.value != node.value or node.value in (float("inf"), float("-inf")):
                raise ValueError("the number is too large")
            # str() keeps the decimal the model wrote (0.1 -> 1/10), not the binary float.
            return _check_size(Fraction(str(node.value)))
        return _check_size(Fraction(node.value))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _evaluate_node(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY_OPS:
        left, right = _evaluate_node(node.left), _evaluate_node(node.right)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ValueError("division by zero")
        return _check_size(_BINARY_OPS[type(node.op)](left, right))
    if isinstance(node, ast.BinOp):
        symbol = _OTHER_OP_SYMBOLS.get(type(node.op), type(node.op).__name__)
        raise ValueError(f"unsupported operator {symbol!r}; use + - * / and parentheses")
    raise ValueError(
        f"unsupported syntax ({type(node).__name__}); use numbers, + - * / and parentheses"
    )


def evaluate_arithmetic(expression: str) -> Fraction:
    """The exact value of an expression of numbers, + - * / and parentheses.

    Raises ValueError with a message meant for the model (division by zero, unsupported
    syntax, too long) for anything else.
    """
    if not isinstance(expression, str):
        raise ValueError(f"the expression must be text, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(
            f"the expression is {len(expression)} characters long; the limit is "
            f"{MAX_EXPRESSION_CHARS}"
        )
    text = expression.replace("×", "*").replace("÷", "/").replace("−", "-").strip()
    if not text:
        raise ValueError("the expression is empty")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"cannot parse {expression!r}: {exc.msg}") from None
    except (ValueError, RecursionError, MemoryError):
        # Null bytes, or nesting deep enough to exhaust the parser.
        raise ValueError(f"cannot parse {expression!r}") from None
    try:
        return _evaluate_node(tree)
    except RecursionError:
        raise ValueError("the expression is nested too deeply") from None


def format_number(value: Fraction) -> str:
    """An integer exactly, anything else as a decimal with 12 significant digits."""
    if value.denominator == 1:
        return str(value.numerator)
    context = Context(prec=SIGNIFICANT_DIGITS)
    decimal = context.divide(Decimal(value.numerator), Decimal(value.denominator))
    # Plain digits for everyday sizes; exponent form where zeros would swamp the digits.
    return format(decimal.normalize(context), "f" if abs(decimal.adjusted()) < 20 else "e")


_NUMBER = r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d{1,3})?"
_NUMBER_RE = re.compile(_NUMBER)
_FRACTION_RE = re.compile(r"\s*([+-]?\d+)\s*/\s*(\d+)\s*")
_THOUSANDS_RE = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")


def parse_number(text: str | None) -> Fraction | None:
    """A number the model wrote as its answer, or None.

    Accepts `42`, `-3.5`, `1,234`, `1e-5`, `7/8`, `$12` and text holding exactly one number
    (`391 apples`, `x = 5`); anything with several numbers (`5 - 3`) is not an answer.
    """
    if not text:
        return None
    cleaned = _THOUSANDS_RE.sub("", text.replace("$", "")).strip().rstrip(".")
    fraction = _FRACTION_RE.fullmatch(cleaned)
    try:
        if fraction:
            return Fraction(int(fraction.group(1)), int(fraction.group(2)))
        if re.fullmatch(_NUMBER, cleaned):
            return Fraction(cleaned)
        numbers = _NUMBER_RE.findall(cleaned)
        if len(numbers) == 1:
            return Fraction(numbers[0].rstrip("."))
    except (ValueError, ZeroDivisionError):
        # A zero denominator, or digits beyond what Python converts.
        return None
    return None


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / and parentheses.

    expression: the arithmetic to evaluate, e.g. "(37 * 12) - 145 / 5"
    """
    return format_number(evaluate_arithmetic(expression))


# ---------------------------------------------------------------------------------------
# Expressions from a seed

_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}


def _random_tree(rng: random.Random, operations: int, max_operand: int):
    """A random expression tree: an int leaf, or (op, left, right)."""
    if operations == 0:
        return rng.randint(1, max_operand)
    left_operations = rng.randint(0, operations - 1)
    return (
        rng.choice("+-*/"),
        _random_tree(rng, left_operations, max_operand),
        _random_tree(rng, operations - 1 - left_operations, max_operand),
    )


def _render(tree, rng: random.Random) -> str:
    if isinstance(tree, int):
        return str(tree)
    op, left, right = tree
    parts = []
    for side, child in (("left", left), ("right", right)):
        text = _render(child, rng)
        if not isinstance(child, int):
            child_precedence = _PRECEDENCE[child[0]]
            needed = child_precedence < _PRECEDENCE[op] or (
                side == "right" and child_precedence == _PRECEDENCE[op] and op in "-/"
            )
            # Some redundant parentheses around products, as people write them.
            if needed or (child_precedence > _PRECEDENCE[op] and rng.random() < 0.5):
                text = f"({text})"
        parts.append(text)
    return f"{parts[0]} {op} {parts[1]}"


def random_expression(rng: random.Random, operations: int, max_operand: int) -> str:
    """An expression with `operations` operators that does not divide by zero."""
    while True:
        text = _render(_random_tree(rng, operations, max_operand), rng)
        try:
            evaluate_arithmetic(text)
        except ValueError:
            continue  # divided by a subexpression that came out 0: draw again
        return text


# ---------------------------------------------------------------------------------------
# Rewards


def final_answer(completion: list[Message]) -> Fraction | None:
    """The number in the last assistant message's <answer> tag."""
    return parse_number(
        XMLParser(["answer"]).parse_answer(last_assistant_text(completion), "answer")
    )


def format_reward(*, completion: list[Message], **_) -> float:
    """1 when the final message holds <answer> with one number in it, else 0."""
    return 1.0 if final_answer(completion) is not None else 0.0


class CalculatorEnv(ToolEnv):
    """Arithmetic expressions solved with a calculator tool; the final answer is checked."""

    name = "calculator"
    description = (
        "Multi-step arithmetic with a calculate() tool (native or <tool_call> text); the "
        "final <answer> must match the exact value within a relative tolerance."
    )
    tools = [calculate]
    outcome_labels = ("correct", "incorrect")
    params = [
        Param("num_operations", int, 3, "Operators in each expression.", min=1, max=6),
        Param("max_operand", int, 100, "Largest number in an expression.", min=2, max=100000),
        Param(
            "max_turns",
            int,
            4,
            "Most model replies per episode (tool calls included); then it is cut off.",
            min=1,
            max=20,
        ),
        Param(
            "tolerance",
            float,
            1e-4,
            "Relative error an answer may have: |answer - value| <= tolerance * max(1, |value|).",
            min=0.0,
            max=1.0,
        ),
    ]

    def build_rubric(self) -> Rubric:
        rubric = Rubric()
        rubric.add(self.correct_reward, 1.0, name="correct", bounds=(0.0, 1.0))
        rubric.add(format_reward, 0.0, name="format", bounds=(0.0, 1.0))
        return rubric

    def correct_reward(self, *, completion: list[Message], example: Example, **_) -> float:
        """1 when the final answer is within the relative tolerance of the exact value."""
        answer = final_answer(completion)
        if answer is None:
            return 0.0
        value = Fraction(example.answer)
        allowed = Fraction(str(self.config["tolerance"])) * max(Fraction(1), abs(value))
        return 1.0 if abs(answer - value) <= allowed else 0.0

    def make_example(self, index: int, seed: int) -> Example:
        ex_seed = example_seed(seed, index)
        rng = random.Random(ex_seed)
        expression = random_expression(
            rng, self.config["num_operations"], self.config["max_operand"]
        )
        value = evaluate_arithmetic(expression)
        system = (
            "Compute the value of the arithmetic expression. You may use the calculate tool. "
            "Give the final answer as a number in <answer>...</answer>.\n\n" + self.tools_prompt()
        )
        return Example(
            id=index,
            seed=ex_seed,
            prompt=[
                {"role": "system", "content": system},
                {"role": "user", "content": f"What is {expression}?"},
            ],
            answer=str(value),
            info={"expression": expression, "value": format_number(value)},
        )

    def setup_state(self, example: Example) -> dict:
        return {**super().setup_state(example), "expression": example.info["expression"]}

    def outcome(self, state: dict, rewards: dict[str, float]) -> str:
        return "correct" if rewards.get("correct") == 1.0 else "incorrect"

    def rollout_metrics(self, rollout: Rollout) -> dict[str, float]:
        calls = float(rollout.state.get("tool_calls", 0))
        return {
            "tool_calls": calls,
            "tool_errors": float(rollout.state.get("tool_errors", 0)),
            "used_tool": 1.0 if calls > 0 else 0.0,
        }

    def builtin_policies(self) -> dict[str, Callable[[], Policy]]:
        return {
            "constant": partial(ConstantPolicy, "<answer>0</answer>"),
            "oracle": CalculatorOraclePolicy,
        }


class CalculatorOraclePolicy(Policy):
    """Calls `calculate` once with the example's expression, then answers with its result.

    It goes through the tool path on purpose, so its score also checks the tool plumbing.
    `native_tools=True` sends an OpenAI-style tool call; otherwise it writes the
    `<tool_call>` text convention that models without native tool calling use.
    """

    name = "oracle"

    def __init__(self, native_tools: bool = False):
        self.native_tools = native_tools

    async def generate(self, messages, sampling, *, tools=None, state=None) -> Generation:
        results = [m for m in messages if m.get("role") == "tool"]
        if results:
            return Generation(text=f"<answer>{results[-1].get('content', '')}</answer>")
        expression = (state or {}).get("expression", "")
        arguments = {"expression": expression}
        if self.native_tools:
            call = {
                "id": "call_oracle_0",
                "type": "function",
                "function": {"name": "calculate", "arguments": json.dumps(arguments)},
            }
            return Generation(text="", tool_calls=[call])
        body = json.dumps({"name": "calculate", "arguments": arguments})
        return Generation(text=f"<tool_call>{body}</tool_call>")
