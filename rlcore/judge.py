"""An LLM judge: a model reached through the OpenAI-compatible client scores replies on a
written rubric, pointwise (a 1-10 score) or pairwise (which of two replies is better).

Judges have known biases, and this module is where they are countered: in pairwise mode
the reply's position (A or B) is drawn at random per comparison, seeded by the example
and the reply, so a judge that prefers the first slot gains the reply nothing on average
(and `both_orders` asks in both orders and averages, removing it outright); verbosity is
left to a length penalty the environment puts in its rubric. A verdict the judge did not
write in the asked form is reported as unreadable, never guessed, and verdict tags inside
a reply are defused before the judge sees it.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass, field

from rlcore.policy.base import Policy
from rlcore.types import SamplingParams

POINTWISE_PROMPT = """You are a strict judge of writing. Score the response to the task on \
the rubric, from 1 (fails it) to 10 (excellent). Think briefly, then end with \
<score>N</score>.

Rubric:
{rubric}

Task:
{task}

Response:
{response}"""

PAIRWISE_PROMPT = """You are a strict judge of writing. Two responses to the same task \
follow. Decide which one better meets the rubric; length alone is not quality. Think \
briefly, then end with <winner>A</winner>, <winner>B</winner> or <winner>tie</winner>.

Rubric:
{rubric}

Task:
{task}

Response A:
{first}

Response B:
{second}"""

REFERENCE_PROMPT = "Answer the task as well as you can.\n\nTask:\n{task}"

_SCORE_RE = re.compile(r"<score>\s*(\d+(?:\.\d+)?)\s*</score>", re.IGNORECASE)
_WINNER_RE = re.compile(r"<winner>\s*(A|B|tie)\s*</winner>", re.IGNORECASE)


@dataclass
class Verdict:
    """A judgement: `reward` in [0, 1], or None when the judge's reply was unreadable."""

    reward: float | None
    detail: str
    positions: list[str] = field(default_factory=list)  # where the reply stood: "A"/"B"
    raw: list[str] = field(default_factory=list)


def read_score(text: str) -> float | None:
    """The last <score>N</score> mapped from 1..10 to 0..1, or None."""
    found = _SCORE_RE.findall(text or "")
    if not found:
        return None
    value = float(found[-1])
    if not 1 <= value <= 10:
        return None
    return (value - 1) / 9


def read_winner(text: str) -> str | None:
    """ "A", "B" or "tie" from the last <winner> tag, or None."""
    found = _WINNER_RE.findall(text or "")
    return found[-1].upper() if found and found[-1].lower() != "tie" else ("tie" if found else None)


_VERDICT_TAG_RE = re.compile(r"<(/?)\s*(score|winner)\s*>", re.IGNORECASE)


def defuse(text: str) -> str:
    """`text` with any verdict tag (<score>, <winner>) written with angle quotes, so a
    reply cannot put a verdict in the judge's mouth should the judge quote it back."""
    return _VERDICT_TAG_RE.sub(lambda m: f"‹{m.group(1)}{m.group(2)}›", text)


def reply_first(seed: int, reply: str) -> bool:
    """Whether the reply is shown as A: a fair coin, fixed by the example and the reply so
    a re-scored rollout meets the same order."""
    digest = hashlib.sha256(f"{seed}:{reply}".encode()).digest()
    return random.Random(digest).random() < 0.5


class Judge:
    """Asks `policy` (an OpenAIPolicy, usually) for verdicts on `rubric`."""

    def __init__(self, policy: Policy, rubric: str, *, max_tokens: int = 256):
        self.policy = policy
        self.rubric = rubric
        self.sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, seed=0)
        self._references: dict[str, str] = {}

    async def _ask(self, prompt: str) -> str:
        generation = await self.policy.generate(
            [{"role": "user", "content": prompt}], self.sampling
        )
        return generation.text or ""

    async def pointwise(self, task: str, reply: str) -> Verdict:
        raw = await self._ask(
            POINTWISE_PROMPT.format(rubric=self.rubric, task=task, response=defuse(reply))
        )
        score = read_score(raw)
        detail = (
            "unreadable verdict: no <score>1-10</score>" if score is None else f"score {score:.2f}"
        )
        return Verdict(score, detail, raw=[raw])

    async def reference(self, task: str) -> str:
        """The judge model's own answer to the task, once per task: the pairwise opponent."""
        if task not in self._references:
            self._references[task] = await self._ask(REFERENCE_PROMPT.format(task=task))
        return self._references[task]

    async def pairwise(self, task: str, reply: str, *, seed: int, both_orders: bool) -> Verdict:
        """1 when the reply beats the reference, 0.5 for a tie, 0 when it loses; averaged
        over both orders with `both_orders`, else in one order drawn at random."""
        opponent = await self.reference(task)
        orders = [True, False] if both_orders else [reply_first(seed, reply)]
        rewards, positions, raws = [], [], []
        for first in orders:
            a, b = (defuse(reply), defuse(opponent)) if first else (defuse(opponent), defuse(reply))
            raw = await self._ask(
                PAIRWISE_PROMPT.format(rubric=self.rubric, task=task, first=a, second=b)
            )
            raws.append(raw)
            positions.append("A" if first else "B")
            winner = read_winner(raw)
            if winner is None:
                return Verdict(
                    None, "unreadable verdict: no <winner>A|B|tie</winner>", positions, raws
                )
            mine = "A" if first else "B"
            rewards.append(0.5 if winner == "tie" else float(winner == mine))
        reward = sum(rewards) / len(rewards)
        return Verdict(reward, f"won {reward:.2f} against the reference", positions, raws)
