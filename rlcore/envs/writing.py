"""The writing environment: short open-ended tasks, scored by an LLM judge on a rubric.

Tasks (a form, a subject and a constraint) come from the seed. The reply is judged by a
model behind any OpenAI-compatible endpoint (`judge_base_url`, `judge_model`; a model of
another family than the policy's is recommended, since a judge favours its own family's
style), pointwise (1-10) or pairwise against the judge's own answer with the reply's
position drawn at random (see rlcore/judge.py). Verbosity bias is countered by the
`length` function: the share by which a reply overruns `max_words`, weighted by
`-length_penalty`. Without a judge, or when its verdict is unreadable, the rollout is
`unjudged`: its judge reward is 0 and the reason is kept in its state.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from functools import partial

from rlcore.envs.base import Param, SingleTurnEnv, example_seed
from rlcore.judge import Judge
from rlcore.parsers import ThinkParser, last_assistant_text
from rlcore.policy.base import ConstantPolicy, Policy, PolicyError
from rlcore.rubric import Rubric
from rlcore.types import Example, Rollout

FORMS = (
    ("a haiku", "three lines of 5, 7 and 5 syllables"),
    ("a two-sentence story", "exactly two sentences"),
    ("a limerick", "five lines, rhyming AABBA"),
    ("an explanation for a ten-year-old", "at most three sentences"),
    ("a product description", "under 50 words"),
    ("a polite complaint email", "under 80 words"),
)
SUBJECTS = (
    "a lighthouse keeper",
    "the first snow of winter",
    "a lost umbrella",
    "how a bicycle stays upright",
    "a robot learning to cook",
    "the smell of rain",
    "a train that is always late",
    "why the sky is blue",
    "a cat who guards a library",
    "a kettle that sings",
)
RUBRIC = (
    "Follows the form and its constraint exactly; is about the subject; is vivid and "
    "specific rather than generic; has no errors of grammar or spelling."
)
SYSTEM_PROMPT = "Write what the user asks for. Reply with the piece itself, nothing else."


def word_count(text: str) -> int:
    return len(re.findall(r"\S+", text))


def judge_reward(*, state: dict, **_) -> float:
    """The judge's verdict in [0, 1]; 0 when unjudged."""
    value = (state.get("judge") or {}).get("reward")
    return float(value) if value is not None else 0.0


def length_reward(*, completion, state: dict, **_) -> float:
    """How far the reply overruns the word limit, as a share of it (0 within it, at most 1)."""
    limit = state.get("max_words") or 1
    words = word_count(ThinkParser().answer(last_assistant_text(completion)) or "")
    return min(1.0, max(0.0, words / limit - 1))


class WritingEnv(SingleTurnEnv):
    """Short open-ended writing, judged by a model on a rubric."""

    name = "writing"
    description = (
        "Short open-ended writing tasks scored by an LLM judge on a rubric (pointwise, or "
        "pairwise with the order randomised), with an optional length penalty."
    )
    outcome_labels = ("judged", "unjudged")
    judge_params = {
        "model": "judge_model",
        "base_url": "judge_base_url",
        "api_key_env": "judge_api_key_env",
    }
    params = [
        Param(
            "judge_base_url",
            str,
            "",
            "OpenAI-compatible endpoint of the judge, e.g. http://host:8000/v1. Pick a judge "
            "of another model family than the policy's.",
        ),
        Param("judge_model", str, "", "The judge's model name at that endpoint."),
        Param(
            "judge_api_key_env",
            str,
            "OPENAI_API_KEY",
            "Environment variable holding the judge's API key.",
        ),
        Param(
            "mode",
            str,
            "pairwise",
            "pointwise: a 1-10 score; pairwise: against the judge's own answer.",
            choices=("pointwise", "pairwise"),
        ),
        Param(
            "both_orders",
            bool,
            False,
            "Pairwise: judge in both orders and average (twice the calls, no position bias).",
        ),
        Param("judge_max_tokens", int, 256, "Most tokens of one judge reply.", min=16, max=4096),
        Param("max_words", int, 80, "Words a reply may use before the length penalty.", 5, 1000),
        Param(
            "length_penalty",
            float,
            0.0,
            "Weight of the length penalty (0 = off; 1 = a reply twice too long loses 1).",
            min=0.0,
            max=1.0,
        ),
    ]

    def check_params(self, config: dict) -> dict[str, str]:
        url = config["judge_base_url"]
        if url and not url.startswith(("http://", "https://")):
            return {"judge_base_url": f"{url!r} is not an HTTP URL; accepted: http(s)://HOST/v1"}
        if url and not config["judge_model"]:
            return {"judge_model": "a judge endpoint needs the judge's model name"}
        return {}

    def __init__(self, **params):
        super().__init__(**params)
        self._judge: Judge | None = None

    def judge(self) -> Judge | None:
        if self._judge is None and self.config["judge_base_url"]:
            from rlcore.policy.openai_client import OpenAIPolicy

            policy = OpenAIPolicy(
                base_url=self.config["judge_base_url"],
                model=self.config["judge_model"],
                api_key_env=self.config["judge_api_key_env"],
            )
            self._judge = Judge(policy, RUBRIC, max_tokens=self.config["judge_max_tokens"])
        return self._judge

    def build_rubric(self) -> Rubric:
        rubric = Rubric()
        rubric.add(judge_reward, 1.0, name="judge", bounds=(0.0, 1.0))
        rubric.add(length_reward, -self.config["length_penalty"], name="length", bounds=(0.0, 1.0))
        return rubric

    def make_example(self, index: int, seed: int) -> Example:
        ex_seed = example_seed(seed, index)
        rng = random.Random(ex_seed)
        form, constraint = rng.choice(FORMS)
        subject = rng.choice(SUBJECTS)
        task = f"Write {form} about {subject} ({constraint})."
        return Example(
            id=index,
            seed=ex_seed,
            prompt=[
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": task},
            ],
            info={"task": task, "form": form},
        )

    def setup_state(self, example: Example) -> dict:
        return {"max_words": self.config["max_words"]}

    async def verify(self, rollout: Rollout, example: Example) -> None:
        judge = self.judge()
        if judge is None:
            rollout.state["judge"] = {"reward": None, "detail": "no judge: set judge_base_url"}
            return
        reply = ThinkParser().answer(last_assistant_text(rollout.messages)) or ""
        task = example.info["task"]
        try:
            if self.config["mode"] == "pointwise":
                verdict = await judge.pointwise(task, reply)
            else:
                verdict = await judge.pairwise(
                    task, reply, seed=example.seed, both_orders=self.config["both_orders"]
                )
        except PolicyError as exc:
            rollout.state["judge"] = {"reward": None, "detail": f"judge unreachable: {exc}"}
            return
        rollout.state["judge"] = {
            "reward": verdict.reward,
            "detail": verdict.detail,
            "positions": verdict.positions,
            "raw": [text[:2000] for text in verdict.raw],
        }

    def outcome(self, state: dict, rewards: dict[str, float]) -> str:
        return "judged" if (state.get("judge") or {}).get("reward") is not None else "unjudged"

    def rollout_metrics(self, rollout: Rollout) -> dict[str, float]:
        positions = (rollout.state.get("judge") or {}).get("positions") or []
        metrics = {"words": float(word_count(last_assistant_text(rollout.messages) or ""))}
        if positions:
            metrics["reply_shown_first"] = positions.count("A") / len(positions)
        return metrics

    def breakdowns(self, rollout: Rollout) -> dict[str, str]:
        return {"form": str(rollout.info.get("form", ""))}

    @classmethod
    def state_views(cls, state: dict) -> list[dict]:
        judge = state.get("judge") if isinstance(state, dict) else None
        if not isinstance(judge, dict):
            return []
        raw = judge.get("raw") if isinstance(judge.get("raw"), list) else []
        text = "\n\n".join([str(judge.get("detail", "")), *map(str, raw)])
        return [{"kind": "text", "title": "Judge", "text": text}]

    def builtin_policies(self) -> dict[str, Callable[[], Policy]]:
        return {"constant": partial(ConstantPolicy, "A short piece of writing.")}
