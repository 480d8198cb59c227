"""Environment base classes and the typed parameter schema.

An environment builds a deterministic dataset from a seed, plays one rollout of an
example against a policy, and scores it with its rubric. `MultiTurnEnv` holds the loop
(`setup_state`, `env_response`, `is_completed`, `max_turns`); `SingleTurnEnv` is the
one-reply case; `ToolEnv` runs Python functions the model calls and answers with tool
messages. Parameters are declared as `Param`s so the CLI validates `-a` JSON and the web
builds its form from the same schema. An environment also declares what the rollout
inspector may filter and sort on (`facts`, valued per rollout by `rollout_facts`) and how
its final state is drawn (`state_views`), so the web knows no environment by name.
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import json
import re
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, get_type_hints

from rlcore.parsers import XMLParser, tag_contents
from rlcore.policy.base import ConstantPolicy, ContextExceeded, Policy, PolicyError
from rlcore.rubric import Rubric
from rlcore.types import Example, Message, Rollout, SamplingParams, Turn

# ---------------------------------------------------------------------------------------
# Parameters


class ParamError(ValueError):
    """Bad environment parameters; `errors` maps each bad field to what was wrong."""

    def __init__(self, errors: dict[str, str]):
        self.errors = errors
        super().__init__("; ".join(f"{k}: {v}" for k, v in errors.items()))


@dataclass(frozen=True)
class Param:
    """One typed, documented environment parameter."""

    name: str
    type: type  # int, float, bool or str
    default: Any
    help: str
    min: float | None = None
    max: float | None = None
    choices: tuple | None = None

    def __post_init__(self) -> None:
        # A number with no bounds lets a form or API post 1e308 into a reward or a loop
        # count; every environment states what range makes sense.
        if self.type in (int, float) and not self.choices and None in (self.min, self.max):
            raise TypeError(f"parameter {self.name!r}: a number needs both min and max")

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "type": self.type.__name__,
            "default": self.default,
            "help": self.help,
            "min": self.min,
            "max": self.max,
            "choices": list(self.choices) if self.choices else None,
        }

    def coerce(self, value: Any) -> Any:
        """The value as this parameter's type, or ValueError saying what is accepted."""
        if self.type is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "on", "off"):
                return value.lower() in ("true", "1", "on")
            if isinstance(value, int) and value in (0, 1):
                return bool(value)
            raise ValueError(f"expected true or false, got {value!r}")
        if self.type is int:
            # int(4.5) would quietly truncate; a fractional value is an error, not 4.
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError(f"expected an integer, got {value!r}")
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            try:
                value = int(value) if not isinstance(value, int) else value
            except (TypeError, ValueError):
                raise ValueError(f"expected an integer, got {value!r}") from None
        elif self.type is float:
            if isinstance(value, bool):
                raise ValueError(f"expected a number, got {value!r}")
            try:
                value = float(value)
            except (TypeError, ValueError):
                raise ValueError(f"expected a number, got {value!r}") from None
            if value != value or value in (float("inf"), float("-inf")):
                raise ValueError(f"expected a finite number, got {value!r}")
        elif self.type is str and not isinstance(value, str):
            raise ValueError(f"expected text, got {value!r}")
        if self.choices is not None and value not in self.choices:
            raise ValueError(f"expected one of {list(self.choices)}, got {value!r}")
        if self.min is not None and value < self.min:
            raise ValueError(f"must be at least {self.min}, got {value!r}")
        if self.max is not None and value > self.max:
            raise ValueError(f"must be at most {self.max}, got {value!r}")
        return value


def validate_params(schema: list[Param], values: dict | None) -> dict:
    """Defaults filled in, every value coerced; unknown names are errors, not ignored."""
    values = dict(values or {})
    known = {p.name for p in schema}
    errors = {
        name: f"unknown parameter; accepted: {', '.join(sorted(known)) or 'none'}"
        for name in values
        if name not in known
    }
    resolved = {}
    for param in schema:
        if param.name not in values:
            resolved[param.name] = param.default
            continue
        try:
            resolved[param.name] = param.coerce(values[param.name])
        except ValueError as exc:
            errors[param.name] = str(exc)
    if errors:
        raise ParamError(errors)
    return resolved


FACT_TYPES = ("int", "float", "str")


@dataclass(frozen=True)
class Fact:
    """One thing the rollout inspector may filter and sort rollouts of an env on: numbers
    by a range, text by equality. `rollout_facts` gives its value per rollout."""

    name: str
    label: str
    type: str  # one of FACT_TYPES
    help: str = ""
    min: float | None = None  # the range a filter may ask for, where one makes sense
    max: float | None = None

    def __post_init__(self) -> None:
        if self.type not in FACT_TYPES:
            raise TypeError(
                f"fact {self.name!r}: type must be one of {FACT_TYPES}, got {self.type!r}"
            )
        if not re.fullmatch(r"[a-z][a-z0-9_]*", self.name):
            raise TypeError(f"fact {self.name!r}: a name is lower-case letters, digits and _")

    def coerce(self, value: Any) -> Any:
        """`value` as this fact's type, or None when it is missing or not one (a rollout
        that failed before the env set it up)."""
        if value is None or isinstance(value, bool):
            return None
        if self.type == "str":
            return value if isinstance(value, str) else None
        if not isinstance(value, int | float) or value != value or abs(value) == float("inf"):
            return None
        if self.type == "int":
            return int(value) if float(value).is_integer() else None
        return float(value)

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "label": self.label,
            "type": self.type,
            "help": self.help,
            "min": self.min,
            "max": self.max,
        }


def example_seed(seed: int, index: int) -> int:
    """A stable 31-bit seed for example `index` of a dataset built from `seed`."""
    digest = hashlib.sha256(f"{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


# ---------------------------------------------------------------------------------------
# Environments


@dataclass(frozen=True)
class Validation:
    """One set of validation games and what it counts for in a checkpoint's score (RL's
    `select`): the env's params changed for these games (`env_args`, over the run's own),
    and a weight for each metric of their summary, by `summary_metrics` name
    ("reward/mean", "outcome/win", "tictactoe/invalid_move_rate")."""

    name: str
    env_args: dict
    weights: dict[str, float]


@dataclass
class MoveOptions:
    """A judged move of a reply and the other moves its position allowed (see
    Environment.move_options): `prefix` is the reply's text up to the move, `played` the
    move's text, `others` the text of each other legal move, and `judge(option)` the env's
    per-move verdict of the played move or one of `others` made in that position instead,
    on the scale of `turn_rewards` (only the options a trainer asks about are judged)."""

    prefix: str
    played: str
    others: list[str]
    judge: Callable[[str], float]


class Environment(ABC):
    """An environment: dataset + rollout loop + rubric, configured by typed params."""

    name: ClassVar[str] = "env"
    description: ClassVar[str] = ""
    params: ClassVar[list[Param]] = []
    # Outcome labels a summary always reports, at zero when none occurred, so "0 losses"
    # is shown rather than left out (labels seen but not listed are reported too).
    outcome_labels: ClassVar[tuple[str, ...]] = ()
    # What the rollout inspector filters and sorts this env's rollouts on (values come
    # from `rollout_facts`); none by default.
    facts: ClassVar[list[Fact]] = []
    # The heading the inspector puts over `state_views`.
    state_views_title: ClassVar[str] = "Final state"
    # For an env that scores with an LLM judge: which parameters name the judge's model,
    # endpoint and API key variable ({"model": ..., "base_url": ..., "api_key_env": ...}).
    # The lab recommends a judge of another family than the policy's, and sends a key only
    # to the endpoint staff declared it for. Empty if none.
    judge_params: ClassVar[dict[str, str]] = {}
    # Where an env may keep files of its rollouts (the browser env's screenshots): the
    # run's own directory, set by whoever runs it (eval, RL), so the inspector, which serves
    # files of a job's directory only, can show them. None: the env's own default.
    output_dir: str | None = None

    def __init__(self, **params: Any):
        self.config = validate_params(self.params, params)
        errors = self.check_params(self.config)
        if errors:
            raise ParamError(errors)
        self.parser = self.build_parser()
        self.rubric = self.build_rubric()

    # -- to override ---------------------------------------------------------------------
    def check_params(self, config: dict) -> dict[str, str]:
        """Cross-field checks (e.g. min <= max); returns field -> error."""
        return {}

    def build_parser(self) -> Any:
        return XMLParser(["answer"])

    @abstractmethod
    def build_rubric(self) -> Rubric: ...

    @abstractmethod
    def make_example(self, index: int, seed: int) -> Example:
        """Example `index`, fully determined by (seed, index)."""

    @property
    def num_groups(self) -> int:
        """How many strata examples fall into (1 = no stratification)."""
        return 1

    def outcome(self, state: dict, rewards: dict[str, float]) -> str | None:
        """A categorical label for summaries (e.g. win/draw/loss); None if the env has none."""
        return None

    def rollout_metrics(self, rollout: Rollout) -> dict[str, float]:
        """Env-specific numbers per rollout, averaged in summaries and training metrics
        under `<env name>/<key>` (e.g. `tictactoe/invalid_move_rate`)."""
        return {}

    def turn_rewards(self, rollout: Rollout) -> list[float] | None:
        """One reward per model turn of a finished rollout, in order, verified by the env
        itself (tic-tac-toe: whether each move kept the game-theoretic value), or None
        (the default) when the env judges only whole episodes. RL's `turn_reward_weight`
        credits each turn with its own reward on top of the episode's."""
        return None

    def move_options(self, rollout: Rollout, turn: int, reply: str) -> MoveOptions | None:
        """For turn `turn` of a finished rollout (its reply's text `reply`) that made a legal
        move the env judges: where the move sits in the reply and the other moves the
        position allowed, each judged on request (see MoveOptions). None for any other
        turn, and (the default) from an env without per-move verdicts. RL's
        `sound_mass_weight` judges every option of every such turn."""
        return None

    def validation(self) -> list[Validation]:
        """What makes one checkpoint better than another, as games to play: RL's `select`
        plays each set greedily on every candidate save and sums the weighted metrics. The
        default: the env as the run configured it, scored by its mean reward."""
        return [Validation("reward", {}, {"reward/mean": 1.0})]

    async def exact_validation(self, policy, max_tokens: int) -> dict[str, dict] | None:
        """What `validation`'s sets would measure of a greedy `policy`, computed exactly
        instead of sampled from games (by set name, in `summary_metrics` names), for an env
        that can (tic-tac-toe walks its whole game tree); None: play the games."""
        return None

    def breakdowns(self, rollout: Rollout) -> dict[str, str]:
        """Labels to split summaries by (e.g. {"starter": "model"}); outcome rates are
        reported per value of each label."""
        return {}

    def rollout_values(self, rollout: Rollout) -> dict[str, Any]:
        """The raw value of each declared fact for one rollout (may be partial: a rollout
        that failed early has little state); `rollout_facts` types and filters them."""
        return {}

    def rollout_facts(self, rollout: Rollout) -> dict[str, Any]:
        """{fact name: value} for the facts declared in `facts`, each of its declared
        type; a fact without a value is left out rather than stored as a guess."""
        values = self.rollout_values(rollout)
        facts = {}
        for fact in self.facts:
            value = fact.coerce(values.get(fact.name))
            if value is not None:
                facts[fact.name] = value
        return facts

    @classmethod
    def state_views(cls, state: dict) -> list[dict]:
        """How a final state is drawn, as plain data a generic page renders: a list of
        views such as {"kind": "grid", "title", "rows": [[text, ...], ...], "highlight":
        [[row, col]], "tones": {text: 1 or 2}, "muted", "notes": [{"name", "ok", "text"}]}
        or {"kind": "text", "title", "text"}. None by default: the page shows the state's
        JSON. A classmethod, because stored states are drawn without rebuilding the env
        from a job's (maybe older) parameters; it must not fail on a malformed state."""
        return []

    def builtin_policies(self) -> dict[str, Callable[[], Policy]]:
        """Players the env provides itself, by name (e.g. oracle, random)."""
        return {"constant": ConstantPolicy}

    def known_exploits(self) -> dict[str, Callable[[], Policy]]:
        """Players that try this env's known ways to earn reward without doing the task;
        `python -m rlcore audit` checks each scores near the floor. None by default."""
        return {}

    def format_variants(self) -> dict[str, Callable[[str], str]]:
        """Rewrites of a correct reply into equivalent forms (1/2 for \\frac{1}{2}) that
        must score alike; the audit adds generic ones (whitespace, line ends)."""
        return {}

    @property
    def verify_parallelism(self) -> int:
        """How many rollouts this env verifies at once (the audit's throughput check)."""
        return 1

    # -- shared --------------------------------------------------------------------------
    def examples(self, n: int, seed: int = 0, offset: int = 0) -> list[Example]:
        return [self.make_example(offset + i, seed) for i in range(n)]

    @abstractmethod
    async def rollout(
        self, policy: Policy, example: Example, sampling: SamplingParams
    ) -> Rollout: ...

    async def verify(self, rollout: Rollout, example: Example) -> None:
        """Slow checking of a finished rollout (running its code in a sandbox), stored in
        `rollout.state` for the rubric to read; awaited, so other rollouts generate
        meanwhile. Nothing by default: most rubrics read the reply directly."""
        return None

    def score(self, rollout: Rollout, example: Example) -> None:
        """Fill rewards, reward and outcome of a finished rollout."""
        rollout.rewards, rollout.reward = self.rubric.score(
            messages=rollout.messages,
            completion=rollout.completion,
            state=rollout.state,
            example=example,
            parser=self.parser,
        )
        rollout.outcome = self.outcome(rollout.state, rollout.rewards)

    @classmethod
    def schema(cls) -> list[dict]:
        return [p.to_dict() for p in cls.params]


_FLAT = (str, int, float, bool, type(None))


def copy_messages(messages: list[Message]) -> list[Message]:
    """A rollout's own copy of `messages`: a message of plain values (role, content) is
    copied as a dict, any other (tool calls, content parts) in depth. The rollout appends to
    and edits its list; the example's prompt must not change with it."""
    return [
        dict(message)
        if all(isinstance(value, _FLAT) for value in message.values())
        else copy.deepcopy(message)
        for message in messages
    ]


class MultiTurnEnv(Environment):
    """The multi-turn loop: the model replies, the env answers, until done or max turns."""

    max_turns: int = 10

    def setup_state(self, example: Example) -> dict:
        return {}

    def is_completed(self, messages: list[Message], state: dict) -> bool:
        return False

    def env_response(self, messages: list[Message], state: dict) -> list[Message]:
        """Messages the environment appends after a model turn (may be async)."""
        return []

    def decision_key(self, messages: list[Message], state: dict) -> str | None:
        """A name for the position the model is about to answer, equal for two rollouts of
        one example exactly when what happens next depends on the same things (so a trainer
        may compare the moves made there); None (the default) leaves the prompt itself as
        the position. Tic-tac-toe names the board and the turns used, not the history."""
        return None

    def turn_limit(self) -> int:
        return int(self.config.get("max_turns", self.max_turns))

    @property
    def tool_schemas(self) -> list[dict] | None:
        return None

    def assistant_message(self, generation) -> Message:
        message: Message = {"role": "assistant", "content": generation.text}
        if generation.tool_calls:
            message["tool_calls"] = generation.tool_calls
        return message

    async def rollout(self, policy: Policy, example: Example, sampling: SamplingParams) -> Rollout:
        started = time.monotonic()
        messages = copy_messages(example.prompt)
        state = self.setup_state(example)
        rollout = Rollout(
            example_id=example.id,
            seed=example.seed,
            group=example.group,
            messages=messages,
            prompt_len=len(messages),
            info=dict(example.info),
        )
        try:
            while not self.is_completed(messages, state):
                if rollout.num_turns >= self.turn_limit():
                    rollout.truncated = True
                    state["hit_max_turns"] = True
                    break
                key = self.decision_key(messages, state)
                generation = await policy.generate(
                    messages, sampling, tools=self.tool_schemas, state=state
                )
                rollout.num_turns += 1
                rollout.prompt_tokens += generation.prompt_tokens
                rollout.completion_tokens += generation.completion_tokens
                if generation.finish_reason == "length":
                    rollout.truncated = True
                if generation.completion_ids is not None:
                    rollout.turns.append(
                        Turn(
                            prompt_ids=list(generation.prompt_ids or []),
                            completion_ids=list(generation.completion_ids),
                            logprobs=generation.logprobs,
                            finish_reason=generation.finish_reason,
                            state_key=key,
                        )
                    )
                messages.append(self.assistant_message(generation))
                if self.is_completed(messages, state):
                    break
                reply = self.env_response(messages, state)
                if inspect.isawaitable(reply):
                    reply = await reply
                messages.extend(reply)
        except ContextExceeded as exc:
            # Not a failure: the game outgrew the model, as a reply can outgrow max_tokens.
            rollout.truncated = True
            state["context_exceeded"] = str(exc)
        except PolicyError as exc:
            rollout.error = f"policy error: {exc}"
        rollout.state = state
        await self.verify(rollout, example)
        self.score(rollout, example)
        rollout.seconds = time.monotonic() - started
        return rollout


class SingleTurnEnv(MultiTurnEnv):
    """One prompt, one reply, scored."""

    max_turns = 1

    def turn_limit(self) -> int:
        return 1

    def is_completed(self, messages: list[Message], state: dict) -> bool:
        return bool(messages) and messages[-1].get("role") == "assistant"


# ---------------------------------------------------------------------------------------
# Tools

_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean"}


def tool_schema(func: Callable) -> dict:
    """An OpenAI-style function schema from a Python function's signature and docstring."""
    hints = get_type_hints(func)
    properties, required = {}, []
    doc = inspect.getdoc(func) or ""
    arg_docs = dict(re.findall(r"^\s*(\w+):\s*(.+)$", doc, re.MULTILINE))
    for name, param in inspect.signature(func).parameters.items():
        prop = {"type": _JSON_TYPES.get(hints.get(name, str), "string")}
        if name in arg_docs:
            prop["description"] = arg_docs[name]
        properties[name] = prop
        if param.default is inspect.Parameter.empty:
            required.append(name)
    return {
        "type": "function",
        "function": {
            "name": func.__name__,
            "description": doc.split("\n\n")[0].strip(),
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


# Far longer than any real call; a longer one is answered with an error, unparsed.
MAX_TOOL_CALL_CHARS = 10_000


def _read_text_tool_call(raw: str) -> tuple[str, Any]:
    """(name, arguments) of one `<tool_call>` body, or ("", what to show) when it is not a
    JSON object of a name and arguments. json.loads raises ValueError, not only
    JSONDecodeError, on an integer of more than 4300 digits, and RecursionError on deep
    nesting: both are a malformed call, not a crash."""
    body = raw.strip()
    if len(body) > MAX_TOOL_CALL_CHARS:
        return "", f"{body[:200]}... ({len(body)} characters; the limit is {MAX_TOOL_CALL_CHARS})"
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError):
        return "", body
    if not isinstance(parsed, dict):
        return "", body
    return str(parsed.get("name", "")), parsed.get("arguments", {})


def _arguments_text(arguments: Any) -> str:
    if isinstance(arguments, str):
        return arguments
    try:
        return json.dumps(arguments)
    except (ValueError, RecursionError):  # parsed once, but too deep to write back
        return ""


def parse_text_tool_calls(text: str | None) -> list[dict]:
    """Tool calls written as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

    Models served without native tool calling write calls in text (the Hermes/Qwen
    convention). A malformed call (not JSON, not an object, too long) becomes a call named
    "" so the env can answer with an error.
    """
    calls = []
    for i, raw in enumerate(tag_contents(text, "tool_call")):
        name, arguments = _read_text_tool_call(raw)
        calls.append(
            {
                "id": f"call_{i}_{uuid.uuid4().hex[:8]}",
                "type": "function",
                "function": {"name": name, "arguments": _arguments_text(arguments)},
            }
        )
    return calls


class ToolEnv(MultiTurnEnv):
    """The model may call Python functions; each call's result comes back as a tool message.

    The episode ends when the model replies without a tool call (its final answer) or at
    max turns. `state` counts calls and errors for tool-use metrics.
    """

    tools: ClassVar[list[Callable]] = []
    facts: ClassVar[list[Fact]] = [
        Fact("tool_calls", "tool calls", "int", "Calls the model made in the episode."),
        Fact(
            "tool_errors", "tool errors", "int", "Calls that failed (unknown tool, bad arguments)."
        ),
    ]

    @property
    def tool_schemas(self) -> list[dict]:
        return [tool_schema(f) for f in self.tools]

    def tools_prompt(self) -> str:
        """Tool instructions for models without native tool calling."""
        lines = [json.dumps(s["function"]) for s in self.tool_schemas]
        return (
            "You can call these tools:\n"
            + "\n".join(lines)
            + '\nTo call one, write <tool_call>{"name": NAME, "arguments": {...}}</tool_call> '
            "and wait for the result."
        )

    def setup_state(self, example: Example) -> dict:
        return {"tool_calls": 0, "tool_errors": 0}

    def rollout_values(self, rollout: Rollout) -> dict[str, Any]:
        return {name: rollout.state.get(name) for name in ("tool_calls", "tool_errors")}

    def _calls(self, message: Message) -> list[dict]:
        native = message.get("tool_calls")
        if isinstance(native, list) and native:
            return native
        return parse_text_tool_calls(message.get("content"))

    def assistant_message(self, generation) -> Message:
        message = super().assistant_message(generation)
        if not generation.tool_calls:
            calls = parse_text_tool_calls(generation.text)
            if calls:
                message["tool_calls"] = calls
        return message

    def is_completed(self, messages: list[Message], state: dict) -> bool:
        last = messages[-1] if messages else {}
        return last.get("role") == "assistant" and not self._calls(last)

    def call_tool(self, name: str, arguments: Any) -> str:
        by_name = {f.__name__: f for f in self.tools}
        if name not in by_name:
            shown = name if len(name) <= 80 else f"{name[:80]}..."
            raise ValueError(f"unknown tool {shown!r}; available: {', '.join(by_name)}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as exc:
                raise ValueError(f"arguments are not valid JSON: {exc.msg}") from None
            except (ValueError, RecursionError):
                raise ValueError(
                    "arguments are not readable JSON (a number of thousands of digits, or "
                    "nesting too deep); pass a JSON object of plain values"
                ) from None
        if not isinstance(arguments, dict):
            raise ValueError(f"arguments must be a JSON object, got {type(arguments).__name__}")
        return str(by_name[name](**arguments))

    def env_response(self, messages: list[Message], state: dict) -> list[Message]:
        replies = []
        for call in self._calls(messages[-1]):
            state["tool_calls"] += 1
            # Native calls come from an endpoint as it sent them: anything may be missing.
            call = call if isinstance(call, dict) else {}
            function = call.get("function")
            function = function if isinstance(function, dict) else {}
            name = function.get("name")
            name = name if isinstance(name, str) else ""
            try:
                content = self.call_tool(name, function.get("arguments", {}))
            except Exception as exc:  # a tool's failure is the model's feedback, not a crash
                state["tool_errors"] += 1
                content = f"Error: {exc}"
            replies.append(
                {
                    "role": "tool",
                    "tool_call_id": str(call.get("id", "")),
                    "name": name,
                    "content": content,
                }
            )
        return replies


@dataclass
class EnvInfo:
    """What the registry tells the CLI and the web about one environment."""

    name: str
    cls: type[Environment]
    description: str = ""
    params: list[dict] = field(default_factory=list)
