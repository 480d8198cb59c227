"""Exploration moves: RL's lever for a policy that is sure of a wrong move.

Once the policy puts probability ~1 on an unsound move, sampling at temperature 1 tries
nothing else there: the env's per-move reward and the tree advantages have nothing to
compare, and the gradient of a token of probability ~1 vanishes (docs/mastery.md, tenth
session). With `explore_rate` p, each model turn's reply is, with probability p, replaced
before the env applies it by the env's own well-formed reply carrying a uniformly random
legal move (`Environment.exploration_reply`). The replacement is what the env plays and
scores, what the next turn's prompt shows, and what is trained: its token ids are
encoded from its text, ended by the token the model ended its reply with (the
tokenizer's eos where the reply was cut short).

The gradient: the loss takes its old logprobs from a forward pass over the trained
tokens (update_policy's own pass, or score_sequences), never from the engine's sample, so
a replaced turn's are those of its actual tokens; its sampled logprobs are dropped, and
the logprob-mismatch metric leaves it out. There is no importance correction for having
sampled from something other than the policy: a replaced move is trained as if the
policy had sampled it, A * grad log pi(move). That is the point: a sound move the policy
gives almost no probability is pushed up when its advantage is positive (and an unsound
one pushed down).

The draws are reproducible: each rollout of a step gets its own RNG seeded from the run's
seed, the step and the rollout's place in the batch, whatever order the turns run in.
"""

from __future__ import annotations

import random

from rlcore.envs.base import Environment
from rlcore.policy.base import Policy
from rlcore.types import Generation, Message, Rollout, SamplingParams


class ExploringPolicy(Policy):
    """`policy`, whose reply is replaced by the env's `exploration_reply` with probability
    `explore_rate` per turn, drawn from `rng` (one draw per turn, then the env's own)."""

    def __init__(
        self, policy: Policy, env: Environment, explore_rate: float, rng: random.Random, tokenizer
    ):
        self.policy = policy
        self.env = env
        self.explore_rate = explore_rate
        self.rng = rng
        self.tokenizer = tokenizer
        self.name = policy.name

    async def generate(
        self,
        messages: list[Message],
        sampling: SamplingParams,
        *,
        tools: list[dict] | None = None,
        state: dict | None = None,
    ) -> Generation:
        generation = await self.policy.generate(messages, sampling, tools=tools, state=state)
        if self.rng.random() >= self.explore_rate or generation.completion_ids is None:
            return generation
        text = self.env.exploration_reply(generation.text, state, self.rng)
        if text is None:
            return generation
        # Ended as the model ended its reply (its stop token), or with the tokenizer's eos
        # where the reply was cut short: the replacement is a finished reply.
        end = generation.completion_ids[-1:]
        if generation.finish_reason != "stop" or not end:
            end = [self.tokenizer.eos_token_id]
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) + end
        return Generation(
            text=text,
            prompt_ids=generation.prompt_ids,
            completion_ids=ids,
            prompt_tokens=generation.prompt_tokens,
            completion_tokens=len(ids),
            explored=True,
        )


class ExplorationMoves:
    """The players of one RL step's rollouts (`run_rollouts`' `player_for`): the rollout at
    `position` gets an `ExploringPolicy` with its own RNG, seeded by (seed, step, position)."""

    def __init__(self, env: Environment, tokenizer, explore_rate: float, seed: int, step: int):
        self.env = env
        self.tokenizer = tokenizer
        self.explore_rate = explore_rate
        self.seed = seed
        self.step = step

    def __call__(self, policy: Policy, position: int) -> Policy:
        # A string seeds Random through sha512: the same draws in every process.
        rng = random.Random(f"explore:{self.seed}:{self.step}:{position}")
        return ExploringPolicy(policy, self.env, self.explore_rate, rng, self.tokenizer)


def explored_rate(rollouts: list[Rollout]) -> float:
    """The share of the batch's model turns that were exploration moves."""
    turns = [turn.explored for rollout in rollouts for turn in rollout.turns]
    return sum(turns) / max(len(turns), 1)
