"""Decision sampling: a group of sampled answers at each decision a rollout made.

GRPO compares several rollouts of one prompt. In a multi-turn game most positions are met
by one rollout only, so a move is judged on one sample. When the env names the token that
carries a reply's decision (`Environment.decision_offset`: tic-tac-toe's move digit) and
can score another answer in the same position (`Environment.score_decision`: the per-turn
reward the move would have earned), RL's `decision_samples` K draws K tokens there from
the policy's own distribution (current weights, sampling temperature; or re-tempered with
`decision_temperature`, to explore), has the env score each as a whole reply with that
token in place of the sampled one, and trains on them as a group: each sample's reward
minus the group's mean (divided by its std with `decision_scale_rewards`), through the
same loss as every other token. The samples are drawn afresh in every update, so their
ratio is 1. They cost one env call per distinct token and no extra forward pass: the
training pass already computes the distribution at that position.

The functions here are pure and tested directly; `grpo.update_policy` calls them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rlcore.envs.base import Environment
from rlcore.types import Rollout


def token_pieces(completion_ids: list[int], pieces: dict[int, str], tokenizer) -> list[str]:
    """The text of each token of a completion; `pieces` caches id -> text across calls."""
    for token in completion_ids:
        if token not in pieces:
            pieces[token] = tokenizer.decode([token])
    return [pieces[token] for token in completion_ids]


def token_at(texts: list[str], offset: int) -> int | None:
    """Index of the token whose text covers character `offset` of their concatenation."""
    position = 0
    for index, text in enumerate(texts):
        if position <= offset < position + len(text):
            return index
        position += len(text)
    return None


def decision_tokens(
    env: Environment, rollout: Rollout, pieces: dict[int, str], tokenizer
) -> list[int | None]:
    """For each turn of `rollout`, the index in its completion of the token where the env
    says the reply's decision starts, or None (no decision in that reply)."""
    result: list[int | None] = []
    for turn in rollout.turns:
        texts = token_pieces(turn.completion_ids, pieces, tokenizer)
        offset = env.decision_offset("".join(texts))
        result.append(None if offset is None else token_at(texts, offset))
    return result


def alternative_reply(texts: list[str], index: int, replacement: str) -> str:
    """The reply with token `index` replaced by `replacement` (the rest as sampled)."""
    return "".join(texts[:index]) + replacement + "".join(texts[index + 1 :])


def decision_advantages(rewards: torch.Tensor, scale: bool) -> torch.Tensor:
    """Per sample of each decision [decisions, K]: its reward minus the row's mean, divided
    by the row's std (+1e-4) with `scale`. A row whose samples all scored the same gets 0."""
    advantages = rewards - rewards.mean(dim=1, keepdim=True)
    if scale:
        advantages = advantages / (rewards.std(dim=1, keepdim=True) + 1e-4)
    return advantages


class DecisionScorer:
    """Scores sampled tokens at the decisions of one step's rollouts, with a cache: in a
    position the same token always earns the same, and a group draws the likely ones
    again and again."""

    def __init__(
        self, env: Environment, rollouts: list[Rollout], pieces: dict[int, str], tokenizer
    ):
        self.env, self.rollouts, self.pieces, self.tokenizer = env, rollouts, pieces, tokenizer
        self.cache: dict[tuple[int, int, int], float] = {}
        self.env_calls = 0

    def __call__(self, rollout_index: int, turn_index: int, index: int, tokens: list[int]):
        """Rewards of replacing token `index` of the turn's completion by each of `tokens`."""
        turn = self.rollouts[rollout_index].turns[turn_index]
        texts = token_pieces(turn.completion_ids, self.pieces, self.tokenizer)
        rewards = []
        for token in tokens:
            key = (rollout_index, turn_index, token)
            if key not in self.cache:
                (replacement,) = token_pieces([token], self.pieces, self.tokenizer)
                reply = alternative_reply(texts, index, replacement)
                score = self.env.score_decision(self.rollouts[rollout_index], turn_index, reply)
                if score is None:
                    raise ValueError(
                        f"env {self.env.name!r} could not score a decision of rollout "
                        f"{rollout_index} turn {turn_index} (decision_samples needs "
                        "score_decision for every turn whose decision it names)"
                    )
                self.cache[key] = float(score)
                self.env_calls += 1
            rewards.append(self.cache[key])
        return rewards


Scorer = Callable[[int, int, int, list[int]], list[float]]


def supports_decisions(env: Environment) -> bool:
    """Whether the env overrides both hooks decision sampling needs."""
    return (
        type(env).decision_offset is not Environment.decision_offset
        and type(env).score_decision is not Environment.score_decision
    )
