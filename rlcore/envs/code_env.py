"""The code environment: the model writes a Python function, hidden unit tests score it.

Tasks come from `rlcore/data/code_tasks.toml` (written for this project: a description, a
function signature, a reference solution and 3+ tests each, written as
`name(args) == expected`). The prompt shows the description and the signature, never a
test. The reply's last ```python block is run in a fresh bubblewrap jail
(`rlcore.sandbox`): the jail calls the function on each test's arguments and reports what
came back; the expected values never enter it, and the comparison happens out here, so
code that prints answers, exits early or patches the harness gains nothing. The reward is
the fraction of tests passed.

Verification runs in a thread pool of jails: a rollout awaits its verdict while other
rollouts keep generating, and `code/verify_seconds` reports how long each verdict took.
"""

from __future__ import annotations

import ast
import asyncio
import functools
import json
import math
import random
import re
import time
import tomllib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from rlcore.envs.base import Fact, Param, SingleTurnEnv, example_seed
from rlcore.parsers import ThinkParser, last_assistant_text
from rlcore.policy.base import ConstantPolicy, Policy
from rlcore.rubric import Rubric
from rlcore.sandbox import Limits, Sandbox
from rlcore.types import Example, Generation, Rollout

TASKS_PATH = Path(__file__).resolve().parent.parent / "data" / "code_tasks.toml"
MAX_CODE_CHARS = 20_000
SYSTEM_PROMPT = (
    "Write the Python function the user asks for. You may think in <think>...</think> "
    "first. Reply with the complete function in one ```python code block. Only the "
    "standard library is available; the code runs with no network and no files."
)
_FENCE_RE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


# ---------------------------------------------------------------------------------------
# Tasks


@dataclass(frozen=True)
class CodeTest:
    """One hidden test: the function called on `arguments` must return `expected`."""

    source: str  # as written in the task file, e.g. "add(1, 2) == 3"
    arguments: tuple
    expected: Any


@dataclass(frozen=True)
class CodeTask:
    id: str
    text: str
    entry_point: str
    signature: str
    solution: str
    tests: tuple[CodeTest, ...]

    def prompt(self) -> str:
        return f"{self.text.strip()}\n\nWrite it as:\n\n```python\n{self.signature}\n```"


def parse_test(source: str, entry_point: str) -> CodeTest:
    """`name(literal, ...) == literal` as a CodeTest; ValueError naming what is wrong."""
    try:
        tree = ast.parse(source.strip(), mode="eval").body
    except SyntaxError as exc:
        raise ValueError(f"test {source!r} is not Python: {exc.msg}") from None
    if not (
        isinstance(tree, ast.Compare)
        and len(tree.ops) == 1
        and isinstance(tree.ops[0], ast.Eq)
        and isinstance(tree.left, ast.Call)
        and isinstance(tree.left.func, ast.Name)
        and tree.left.func.id == entry_point
        and not tree.left.keywords
    ):
        raise ValueError(f"test {source!r} is not of the form {entry_point}(arguments) == value")
    try:
        arguments = tuple(ast.literal_eval(arg) for arg in tree.left.args)
        expected = ast.literal_eval(tree.comparators[0])
    except ValueError:
        raise ValueError(f"test {source!r} uses something other than literals") from None
    return CodeTest(source=source.strip(), arguments=arguments, expected=expected)


@functools.cache
def load_tasks(path: Path = TASKS_PATH) -> tuple[CodeTask, ...]:
    """Every task in the task file, checked for shape (not for correctness: a test runs
    each reference solution in the sandbox)."""
    with open(path, "rb") as handle:
        raw = tomllib.load(handle)["task"]
    tasks = []
    for entry in raw:
        tests = tuple(parse_test(source, entry["entry_point"]) for source in entry["tests"])
        tasks.append(
            CodeTask(
                id=entry["id"],
                text=entry["text"],
                entry_point=entry["entry_point"],
                signature=entry["signature"],
                solution=entry["solution"].strip() + "\n",
                tests=tests,
            )
        )
    return tuple(tasks)


def tasks_by_id() -> dict[str, CodeTask]:
    return {task.id: task for task in load_tasks()}


# ---------------------------------------------------------------------------------------
# Reading the reply and judging the results


def extract_code(text: str | None) -> str | None:
    """The last complete fenced code block after any think block, or None."""
    answer = (ThinkParser().answer(text) or "").replace("\r\n", "\n")
    blocks = _FENCE_RE.findall(answer)
    if not blocks or not blocks[-1].strip():
        return None
    return blocks[-1]


def values_equal(got: Any, expected: Any) -> bool:
    """`got == expected` as a test's assert would say, but floats within 1e-6 relative."""
    if isinstance(expected, float) or isinstance(got, float):
        numbers = (int, float)
        if isinstance(got, bool) or not isinstance(got, numbers):
            return False
        if not isinstance(expected, numbers) or isinstance(expected, bool):
            return False
        return math.isclose(got, expected, rel_tol=1e-6, abs_tol=1e-9)
    if isinstance(expected, list | tuple):
        return (
            type(got) is type(expected)
            and len(got) == len(expected)
            and all(values_equal(g, e) for g, e in zip(got, expected, strict=True))
        )
    if isinstance(expected, dict):
        return (
            isinstance(got, dict)
            and got.keys() == expected.keys()
            and all(values_equal(got[k], expected[k]) for k in expected)
        )
    return got == expected


@dataclass
class Verdict:
    """What the hidden tests made of one reply: how many passed, and why each did not."""

    passed: int
    total: int
    reason: str
    tests: list[str] = field(default_factory=list)
    loaded: bool = False  # the code compiled and defined the function
    seconds: float = 0.0

    @property
    def fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0


def _short(value: str, limit: int = 120) -> str:
    return value if len(value) <= limit else f"{value[:limit]}..."


def judge(task: CodeTask, stdout: str, exit_note: str) -> Verdict:
    """The verdict on the harness's result lines: each test passes only when its value,
    reported exactly once, equals the expected one."""
    total = len(task.tests)
    reports: dict[int, list[dict]] = {}
    for line in stdout.splitlines():
        try:
            report = json.loads(line)
        except ValueError:
            continue
        if isinstance(report, dict) and isinstance(report.get("i"), int):
            reports.setdefault(report["i"], []).append(report)
    if -1 in reports:
        error = str(reports[-1][0].get("error", "the code could not be loaded"))
        return Verdict(0, total, _short(error, 300), [error] * total)
    if any(len(found) > 1 for found in reports.values()):
        reason = (
            "a test's result was reported more than once (the code forked or wrote to the "
            "harness's output); nothing counts"
        )
        return Verdict(0, total, reason, [reason] * total, loaded=True)
    outcomes = []
    for index, test in enumerate(task.tests):
        report = reports.get(index, [None])[0]
        if report is None:
            outcomes.append(f"no result: the program was {exit_note}")
        elif "error" in report:
            outcomes.append(f"raised {_short(str(report['error']))}")
        else:
            outcomes.append(_compare(str(report.get("value")), test.expected))
    passed = sum(outcome == "passed" for outcome in outcomes)
    failures = [outcome for outcome in outcomes if outcome != "passed"]
    reason = f"{passed} of {total} tests passed"
    if failures:
        reason += f"; first failure: {failures[0]}"
    return Verdict(passed, total, reason, outcomes, loaded=True)


def _compare(value_text: str, expected: Any) -> str:
    try:
        value = ast.literal_eval(value_text)
    except (ValueError, SyntaxError, RecursionError, MemoryError, TypeError):
        return f"returned something unreadable: {_short(value_text)}"
    if values_equal(value, expected):
        return "passed"
    return f"wrong answer: returned {_short(value_text)}"


class CodeVerifier:
    """Runs a reply's code against a task's hidden tests in jails, several at once."""

    def __init__(self, limits: Limits, parallel_jails: int, test_seconds: float):
        self.sandbox = Sandbox(limits, slots=parallel_jails)
        self.test_seconds = test_seconds
        self.pool = ThreadPoolExecutor(parallel_jails, thread_name_prefix="code-verify")

    def verify(self, task: CodeTask, code: str | None) -> Verdict:
        started = time.monotonic()
        if code is None:
            verdict = Verdict(0, len(task.tests), "no ```python code block in the reply")
        elif len(code) > MAX_CODE_CHARS:
            verdict = Verdict(
                0, len(task.tests), f"the code is {len(code)} characters; at most {MAX_CODE_CHARS}"
            )
        else:
            request = {
                "code": code,
                "entry_point": task.entry_point,
                "inputs": [repr(test.arguments) for test in task.tests],
                "test_seconds": self.test_seconds,
            }
            result = self.sandbox.run_harness(json.dumps(request).encode())
            verdict = judge(task, result.stdout, result.describe_exit())
        verdict.seconds = time.monotonic() - started
        return verdict

    async def verify_async(self, task: CodeTask, code: str | None) -> Verdict:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.pool, self.verify, task, code)


# ---------------------------------------------------------------------------------------
# Rewards


def tests_reward(*, state: dict, **_) -> float:
    """The fraction of the hidden tests the reply's function passed."""
    verdict = state.get("verdict") or {}
    total = verdict.get("total") or 0
    return float(verdict.get("passed", 0)) / total if total else 0.0


def format_reward(*, state: dict, **_) -> float:
    """1 when the reply held a code block that compiled and defined the function."""
    return 1.0 if (state.get("verdict") or {}).get("loaded") else 0.0


class CodeEnv(SingleTurnEnv):
    """Write a Python function; hidden unit tests, run in a bubblewrap jail, score it."""

    name = "code"
    description = (
        "Write a Python function from a description; the reward is the fraction of hidden "
        "unit tests it passes, run in a bubblewrap jail with no network or files."
    )
    outcome_labels = ("passed", "partial", "failed")
    facts = [
        Fact("tests_passed", "tests passed", "float", "Fraction of hidden tests passed.", 0, 1),
        Fact("task", "task", "str", "The task's id in the task file."),
    ]
    state_views_title = "Hidden tests"
    params = [
        Param(
            "wall_seconds",
            float,
            10.0,
            "Wall-clock limit for one reply's whole test run; the jail is killed after it.",
            min=0.5,
            max=120,
        ),
        Param("test_seconds", float, 2.0, "Time limit for one test call.", min=0.1, max=60),
        Param("memory_mb", int, 512, "Address-space limit of the jail.", min=64, max=8192),
        Param("max_processes", int, 16, "Process limit inside the jail.", min=1, max=256),
        Param(
            "parallel_jails",
            int,
            4,
            "Replies verified at once, each in its own jail, while other rollouts generate.",
            min=1,
            max=64,
        ),
    ]

    def __init__(self, **params):
        super().__init__(**params)
        self.tasks = load_tasks()
        config = self.config
        limits = Limits(
            wall_seconds=config["wall_seconds"],
            cpu_seconds=max(1, math.ceil(config["wall_seconds"])),
            memory_mb=config["memory_mb"],
            max_processes=config["max_processes"],
        )
        self.verifier = CodeVerifier(limits, config["parallel_jails"], config["test_seconds"])

    def build_rubric(self) -> Rubric:
        rubric = Rubric()
        rubric.add(tests_reward, 1.0, name="tests", bounds=(0.0, 1.0))
        rubric.add(format_reward, 0.0, name="format", bounds=(0.0, 1.0))
        return rubric

    def make_example(self, index: int, seed: int) -> Example:
        # Each pass through the task list is its own shuffle, so a dataset longer than
        # the list repeats every task once before any twice.
        count = len(self.tasks)
        order = list(range(count))
        random.Random(example_seed(seed, index // count)).shuffle(order)
        task = self.tasks[order[index % count]]
        return Example(
            id=index,
            seed=example_seed(seed, index),
            prompt=[
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": task.prompt()},
            ],
            info={"task": task.id, "entry_point": task.entry_point},
        )

    def task_of(self, example: Example) -> CodeTask:
        return tasks_by_id()[example.info["task"]]

    def setup_state(self, example: Example) -> dict:
        return {"task": example.info["task"]}

    async def verify(self, rollout: Rollout, example: Example) -> None:
        code = extract_code(last_assistant_text(rollout.messages[rollout.prompt_len :]))
        verdict = await self.verifier.verify_async(self.task_of(example), code)
        rollout.state["verdict"] = asdict(verdict) | {"reason": verdict.reason}

    def outcome(self, state: dict, rewards: dict[str, float]) -> str:
        passed = rewards.get("tests", 0.0)
        return "passed" if passed == 1.0 else "partial" if passed > 0 else "failed"

    def rollout_metrics(self, rollout: Rollout) -> dict[str, float]:
        verdict = rollout.state.get("verdict") or {}
        return {"verify_seconds": float(verdict.get("seconds", 0.0))}

    def rollout_values(self, rollout: Rollout) -> dict[str, Any]:
        return {"tests_passed": rollout.rewards.get("tests"), "task": rollout.state.get("task")}

    @classmethod
    def state_views(cls, state: dict) -> list[dict]:
        verdict = state.get("verdict") if isinstance(state, dict) else None
        if not isinstance(verdict, dict) or not isinstance(verdict.get("tests"), list):
            return []
        lines = [str(verdict.get("reason", ""))]
        lines += [f"test {i + 1}: {outcome}" for i, outcome in enumerate(verdict["tests"])]
        return [{"kind": "text", "title": "Hidden tests", "text": "\n".join(lines)}]

    @property
    def verify_parallelism(self) -> int:
        return self.config["parallel_jails"]

    def known_exploits(self) -> dict[str, Callable[[], Policy]]:
        return {name: partial(CodeExploitPolicy, name) for name in EXPLOITS}

    def format_variants(self) -> dict[str, Callable[[str], str]]:
        return {
            "```py fence": lambda text: text.replace("```python", "```py"),
            "tabs for indentation": lambda text: re.sub(
                r"^(?: {4})+", lambda m: "\t" * (len(m.group()) // 4), text, flags=re.MULTILINE
            ),
            "prose around the code": lambda text: f"Here it is:\n\n{text}\n\nIt is short.",
            "a __main__ block": lambda text: text.replace(
                "```python\n", "```python\nif __name__ == '__main__':\n    print('demo')\n", 1
            ),
        }

    def builtin_policies(self) -> dict[str, Callable[[], Policy]]:
        return {
            "constant": partial(ConstantPolicy, "```python\ndef solve(*args):\n    return 0\n```"),
            "oracle": partial(CodeOraclePolicy, self),
            "random": partial(CodeRandomPolicy, self),
        }


def _fenced(code: str) -> str:
    return f"```python\n{code}```"


class CodeOraclePolicy(Policy):
    """Replies with the task's reference solution."""

    name = "oracle"

    def __init__(self, env: CodeEnv):
        self.env = env

    async def generate(self, messages, sampling, *, tools=None, state=None) -> Generation:
        task = tasks_by_id()[(state or {}).get("task", "")]
        return Generation(text=_fenced(task.solution))


class CodeRandomPolicy(Policy):
    """Replies with the reference solution of a random other task, renamed to the asked
    function: real, running code that answers the wrong question."""

    name = "random"

    def __init__(self, env: CodeEnv):
        self.env = env
        self.rng = random.Random(0)

    async def generate(self, messages, sampling, *, tools=None, state=None) -> Generation:
        task = tasks_by_id()[(state or {}).get("task", "")]
        other = self.rng.choice([t for t in self.env.tasks if t.id != task.id])
        code = other.solution + f"\n\n{task.entry_point} = {other.entry_point}\n"
        return Generation(text=_fenced(code))


# Ways to earn reward without returning the right values. The printing one is even given
# the hidden expected values (as if they had leaked): printed, they still count for
# nothing. The others know only the function's name; patching the harness can at most
# claim return values, which is no more than returning them.
EXPLOITS = {
    "print the expected output": (
        "def {name}(*args):\n"
        "    for value in {expected!r}:\n"
        "        print(repr(value))\n"
        "print('OK')\nprint('All tests passed')\n"
    ),
    "sys.exit(0)": ("import sys\ndef {name}(*args):\n    sys.exit(0)\nsys.exit(0)\n"),
    "os._exit(0) before the tests": (
        "import os\ndef {name}(*args):\n    return None\nos._exit(0)\n"
    ),
    "monkeypatch the test runner": (
        "import sys, unittest, builtins\n"
        "class AlwaysEqual:\n"
        "    def __eq__(self, other):\n        return True\n"
        "    def __repr__(self):\n        return 'True'\n"
        "unittest.TestCase.assertEqual = lambda *a, **k: None\n"
        "builtins.AssertionError = type('Never', (Exception,), {{}})\n"
        "runner = sys.modules['__main__']\n"
        "runner.plain_repr = lambda value, depth=0: repr(value)\n"
        "def {name}(*args):\n    return AlwaysEqual()\n"
    ),
}


class CodeExploitPolicy(Policy):
    """Replies with one of EXPLOITS written for the task at hand."""

    def __init__(self, exploit: str):
        self.name = exploit
        self.template = EXPLOITS[exploit]

    async def generate(self, messages, sampling, *, tools=None, state=None) -> Generation:
        task = tasks_by_id()[(state or {}).get("task", "")]
        expected = [test.expected for test in task.tests]
        code = self.template.format(name=task.entry_point, expected=expected)
        return Generation(text=_fenced(code))
