"""The reverse-text environment: write a text backwards, character by character.

In `paragraph` mode the text is an excerpt of an English paragraph shipped in
`rlcore/data/paragraphs.txt`, cut at a word boundary to a length drawn from
[min_chars, max_chars]; in `random` mode it is a random string over `alphabet`. The model
answers in `<reversed>...</reversed>` (optionally after `<think>`), and the reward is the
LCS ratio 2*LCS/(len(answer)+len(target)), which gives partial credit and is 1 only for
the exact reversal. The random mode with a two-letter alphabet and two characters is the
trivially learnable task the RL trainer's own test uses, so its prompt is kept short.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from functools import partial
from importlib import resources

from rlcore.envs.base import Fact, Param, SingleTurnEnv, example_seed
from rlcore.parsers import ThinkParser, XMLParser, last_assistant_text
from rlcore.policy.base import ConstantPolicy, Policy
from rlcore.rubric import Rubric
from rlcore.types import Example, Generation, Message, Rollout

MODES = ("paragraph", "random")
PARAGRAPH_SYSTEM_PROMPT = (
    "Reverse the text inside <text> tags character by character. You may think in "
    "<think>...</think> first; then answer as <reversed>...</reversed>."
)
# Short on purpose: tiny models trained on `random` mode should spend their context on
# the text, not on instructions.
RANDOM_SYSTEM_PROMPT = "Reverse the text. Answer as <reversed>...</reversed>."
# An answer longer than this many times the text is scored 0 without the LCS (lcs_ratio).
MAX_ANSWER_FACTOR = 10


@functools.cache
def paragraphs() -> tuple[str, ...]:
    """The shipped paragraphs, one per non-blank line."""
    text = resources.files("rlcore.data").joinpath("paragraphs.txt").read_text("utf-8")
    return tuple(line.strip() for line in text.splitlines() if line.strip())


def lcs_length(first: str, second: str) -> int:
    """Length of the longest common subsequence of two strings.

    The classic dynamic program, one row per character of `first`, with the row held as
    the bits of one integer (Allison and Dix, 1986; Hyyrö, 2004): a zero bit j marks a
    column where the row's value steps up by one, so the last value, the LCS, is the count
    of zero bits. Each row costs a few big-integer operations instead of a Python loop
    over `second`, so long replies score quickly.
    """
    if not first or not second:
        return 0
    masks: dict[str, int] = {}
    for position, char in enumerate(second):
        masks[char] = masks.get(char, 0) | (1 << position)
    all_columns = (1 << len(second)) - 1
    row = all_columns
    for char in first:
        matches = row & masks.get(char, 0)
        row = ((row + matches) | (row - matches)) & all_columns
    return len(second) - row.bit_count()


def lcs_ratio(answer: str, target: str) -> float:
    """2*LCS/(len(answer)+len(target)): 1 for equal strings, 0 when nothing is shared.

    An answer more than `MAX_ANSWER_FACTOR` times the target's length (plus a little) is
    scored 0 without computing the LCS, whose cost grows with the answer's length: its
    ratio could be at most 2 / (1 + that factor) anyway, and a reply that long is not an
    attempt at the reversal.
    """
    if not answer and not target:
        return 1.0
    if len(answer) > MAX_ANSWER_FACTOR * len(target) + 100:
        return 0.0
    return 2 * lcs_length(answer, target) / (len(answer) + len(target))


def parse_reversal(text: str | None) -> str | None:
    """The content of the last <reversed> tag after any <think> block, or None."""
    return XMLParser(["reversed"]).parse_answer(ThinkParser().answer(text), "reversed")


def lcs_reward(*, completion: list[Message], example: Example, **_) -> float:
    """LCS ratio between the parsed answer and the true reversal (0 with no answer).

    Both sides are compared without surrounding whitespace, as the tag parser strips it.
    """
    answer = parse_reversal(last_assistant_text(completion))
    if answer is None:
        return 0.0
    return lcs_ratio(answer, example.answer.strip())


def format_reward(*, completion: list[Message], **_) -> float:
    """1 for exactly `[<think>...</think>]<reversed>...</reversed>`, 0.5 when the tag is
    there among other text, 0 without it."""
    text = last_assistant_text(completion)
    if parse_reversal(text) is None:
        return 0.0
    rest = ThinkParser().answer(text)
    exact = (
        rest.startswith("<reversed>")
        and rest.endswith("</reversed>")
        and rest.count("<reversed>") == 1
    )
    return 1.0 if exact else 0.5


def paragraph_excerpt(rng: random.Random, length: int, min_chars: int) -> str:
    """An excerpt of at most `length` characters starting at a random paragraph.

    Paragraphs are joined in order until there is enough text, then cut at the last space
    that leaves at least `min_chars` characters; with no such space it is cut mid-word.
    """
    shipped = paragraphs()
    index = rng.randrange(len(shipped))
    text = shipped[index]
    while len(text) < length:
        index += 1
        text += " " + shipped[index % len(shipped)]
    if len(text) == length:
        return text
    cut = text.rfind(" ", min_chars, length + 1)
    return text[:cut] if cut != -1 else text[:length]


class ReverseTextEnv(SingleTurnEnv):
    """Reverse a paragraph excerpt or a random string; scored by LCS ratio."""

    name = "reverse_text"
    description = (
        "Reverse a text character by character; the answer in <reversed> tags is scored "
        "by its longest-common-subsequence ratio to the true reversal."
    )
    outcome_labels = ("correct", "incorrect")
    facts = [Fact("text_chars", "text length", "int", "Characters in the text to reverse.")]
    params = [
        Param(
            "mode",
            str,
            "paragraph",
            "paragraph: excerpts of shipped English paragraphs; random: random strings "
            "over the alphabet.",
            choices=MODES,
        ),
        Param("min_chars", int, 20, "Shortest text to reverse.", min=1, max=4000),
        Param("max_chars", int, 200, "Longest text to reverse.", min=1, max=4000),
        Param(
            "alphabet",
            str,
            "abcdefghijklmnopqrstuvwxyz",
            "Characters random-mode strings are drawn from (not < or >).",
        ),
    ]

    def check_params(self, config: dict) -> dict[str, str]:
        errors = {}
        if config["min_chars"] > config["max_chars"]:
            errors["min_chars"] = (
                f"must be at most max_chars ({config['max_chars']}), got {config['min_chars']}"
            )
        alphabet = config["alphabet"]
        if not alphabet.strip():
            errors["alphabet"] = (
                f"needs at least one visible character, got {alphabet!r}; e.g. 'ab'"
            )
        elif "<" in alphabet or ">" in alphabet:
            errors["alphabet"] = (
                f"must not contain < or > (they would read as answer tags), got {alphabet!r}"
            )
        return errors

    def build_parser(self) -> XMLParser:
        return XMLParser(["reversed"])

    def build_rubric(self) -> Rubric:
        rubric = Rubric()
        rubric.add(lcs_reward, 1.0, name="lcs", bounds=(0.0, 1.0))
        rubric.add(format_reward, 0.0, name="format", bounds=(0.0, 1.0))
        return rubric

    def make_example(self, index: int, seed: int) -> Example:
        ex_seed = example_seed(seed, index)
        rng = random.Random(ex_seed)
        length = rng.randint(self.config["min_chars"], self.config["max_chars"])
        if self.config["mode"] == "random":
            alphabet = self.config["alphabet"]
            text = "".join(rng.choice(alphabet) for _ in range(length))
            prompt = [
                {"role": "system", "content": RANDOM_SYSTEM_PROMPT},
                {"role": "user", "content": text},
            ]
        else:
            text = paragraph_excerpt(rng, length, self.config["min_chars"])
            prompt = [
                {"role": "system", "content": PARAGRAPH_SYSTEM_PROMPT},
                {"role": "user", "content": f"<text>{text}</text>"},
            ]
        return Example(
            id=index, seed=ex_seed, prompt=prompt, answer=text[::-1], info={"text": text}
        )

    def setup_state(self, example: Example) -> dict:
        return {"text": example.info["text"], "reversed": example.answer}

    def outcome(self, state: dict, rewards: dict[str, float]) -> str:
        return "correct" if rewards.get("lcs") == 1.0 else "incorrect"

    def rollout_values(self, rollout: Rollout) -> dict:
        text = rollout.info.get("text")
        return {"text_chars": len(text) if isinstance(text, str) else None}

    def rollout_metrics(self, rollout: Rollout) -> dict[str, float]:
        answer = parse_reversal(last_assistant_text(rollout.completion))
        target = str(rollout.state.get("reversed", "")).strip()
        return {
            "answered": 0.0 if answer is None else 1.0,
            # Over 1 means the reply ran on; under 1 means it stopped early.
            "length_ratio": len(answer or "") / max(1, len(target)),
        }

    def builtin_policies(self) -> dict[str, Callable[[], Policy]]:
        return {
            "constant": partial(ConstantPolicy, "<reversed>eht</reversed>"),
            "oracle": partial(ReverseTextPolicy, "reversed", "oracle"),
            "echo": partial(ReverseTextPolicy, "text", "echo"),
        }


class ReverseTextPolicy(Policy):
    """Answers with a field of the env state: `reversed` (the oracle) or `text` (echo,
    which copies the text unreversed: the baseline a model that ignores the task gets)."""

    def __init__(self, field: str, name: str):
        self.field = field
        self.name = name

    async def generate(self, messages, sampling, *, tools=None, state=None) -> Generation:
        return Generation(text=f"<reversed>{(state or {}).get(self.field, '')}</reversed>")
