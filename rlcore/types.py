"""The plain data that flows through rlcore: examples, sampling settings, generations,
turns and rollouts. Nothing here knows about models, Django or Celery; every class can be
turned into JSON with `to_dict()` so the CLI, the workers and the web share one shape."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

Message = dict[str, Any]

# Characters JSON leaves raw (with ensure_ascii=False) that str.splitlines(), and so many
# JSONL readers, take for line ends; models, untrained ones above all, do write them.
_LINE_BREAKING = {"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"}


def jsonl_line(value: Any) -> str:
    """One JSONL line (newline included): readable text for any language, with every
    character a line splitter could break on escaped, so each record stays on its line."""
    text = json.dumps(value, ensure_ascii=False, default=str)
    for raw, escaped in _LINE_BREAKING.items():
        text = text.replace(raw, escaped)
    return text + "\n"


@dataclass
class SamplingParams:
    """How a policy samples one reply."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 256
    seed: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Generation:
    """One reply from a policy.

    Token ids and logprobs are filled by backends that have them (the local engine);
    training needs them, evaluation does not. `prompt_ids` are the exact ids the model
    was conditioned on and `completion_ids` the ids it sampled, so the trainer never
    re-tokenizes text.
    """

    text: str
    finish_reason: str = "stop"  # "stop" | "length"
    prompt_ids: list[int] | None = None
    completion_ids: list[int] | None = None
    logprobs: list[float] | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    tool_calls: list[dict] | None = None  # OpenAI-style native tool calls, if any


@dataclass
class Example:
    """One dataset row: the initial prompt messages plus what the verifier needs."""

    id: int
    seed: int
    prompt: list[Message]
    answer: Any = None
    info: dict = field(default_factory=dict)
    group: int = 0  # stratum for stratified sampling (e.g. opponent strength bucket)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Turn:
    """One model call inside a rollout, kept for training (ids straight from generation)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float] | None = None
    finish_reason: str = "stop"
    # The env's name for the decision this turn answered (see Environment.decision_key):
    # turns of one example with equal keys faced the same position. None: no such name.
    state_key: str | None = None


@dataclass
class Rollout:
    """One episode of one example: the whole conversation and how it was scored."""

    example_id: int
    seed: int
    group: int
    messages: list[Message]
    prompt_len: int  # how many leading messages were the example's prompt
    rewards: dict[str, float] = field(default_factory=dict)  # every reward function's value
    reward: float = 0.0  # weighted sum
    state: dict = field(default_factory=dict)  # final env state (e.g. the board)
    outcome: str | None = None  # env-specific label, e.g. "win" / "draw" / "loss"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    num_turns: int = 0
    truncated: bool = False  # a reply hit max_tokens, or the episode hit max_turns
    error: str | None = None
    turns: list[Turn] = field(default_factory=list)
    info: dict = field(default_factory=dict)
    seconds: float = 0.0
    # The env's declared facts about this rollout (Environment.rollout_facts), which the
    # inspector filters and sorts on.
    facts: dict = field(default_factory=dict)

    @property
    def completion(self) -> list[Message]:
        return self.messages[self.prompt_len :]

    def to_dict(self, *, with_tokens: bool = False) -> dict:
        """JSON form, as written to results.jsonl and the database."""
        row = {
            "example_id": self.example_id,
            "seed": self.seed,
            "group": self.group,
            "messages": self.messages,
            "prompt_len": self.prompt_len,
            "rewards": self.rewards,
            "reward": self.reward,
            "state": self.state,
            "outcome": self.outcome,
            "tokens": {"prompt": self.prompt_tokens, "completion": self.completion_tokens},
            "num_turns": self.num_turns,
            "truncated": self.truncated,
            "error": self.error,
            "info": self.info,
            "facts": self.facts,
            "seconds": round(self.seconds, 4),
        }
        if with_tokens:
            row["turns"] = [asdict(t) for t in self.turns]
        return row

    @classmethod
    def from_dict(cls, row: dict) -> Rollout:
        tokens = row.get("tokens") or {}
        return cls(
            example_id=row["example_id"],
            seed=row["seed"],
            group=row.get("group", 0),
            messages=row["messages"],
            prompt_len=row.get("prompt_len", 0),
            rewards=row.get("rewards", {}),
            reward=row.get("reward", 0.0),
            state=row.get("state", {}),
            outcome=row.get("outcome"),
            prompt_tokens=tokens.get("prompt", 0),
            completion_tokens=tokens.get("completion", 0),
            num_turns=row.get("num_turns", 0),
            truncated=row.get("truncated", False),
            error=row.get("error"),
            turns=[Turn(**t) for t in row.get("turns", [])],
            info=row.get("info", {}),
            seconds=row.get("seconds", 0.0),
            facts=row.get("facts", {}),
        )
