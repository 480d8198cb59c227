"""Stratified example batches for RL: every step sees an even mix of the env's groups.

An environment puts each example in a group (`example.group`, e.g. an opponent-strength
bucket in tic-tac-toe). Drawing examples in index order can give a batch of only easy or
only hard opponents; the sampler instead deals examples round robin over the groups, so a
batch of 8 examples over 4 groups holds 2 of each, and when the batch size is not a
multiple of the group count the group that starts the deal rotates from step to step.
Each example index is used once (fresh examples every step), and everything follows from
the seed, so a resumed run draws exactly the batches it would have drawn.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from rlcore.envs.base import Environment
from rlcore.types import Example, Rollout

# How far past the last scanned index to look for an example of a group before deciding
# the environment never produces that group.
MAX_SCAN_PER_EXAMPLE = 10_000


class StratifiedSampler:
    """Deals `examples_per_step` fresh examples per step, round robin over env groups."""

    def __init__(self, env: Environment, seed: int, examples_per_step: int):
        if examples_per_step < 1:
            raise ValueError(f"examples_per_step must be at least 1, got {examples_per_step!r}")
        self.env = env
        self.seed = seed
        self.examples_per_step = examples_per_step
        self.num_groups = max(1, int(env.num_groups))
        self.next_index = 0  # next dataset index not yet looked at
        self.first_group = 0  # group that starts the next deal
        # Examples already built while looking for another group, kept for their own turn.
        self.pending: list[deque[tuple[int, Example]]] = [deque() for _ in range(self.num_groups)]

    def __iter__(self) -> Iterator[list[Example]]:
        while True:
            yield self.next_batch()

    def next_batch(self) -> list[Example]:
        """The next batch, dealt round robin over the env's groups."""
        batch = []
        for offset in range(self.examples_per_step):
            batch.append(self._take((self.first_group + offset) % self.num_groups))
        self.first_group = (self.first_group + self.examples_per_step) % self.num_groups
        return batch

    def _take(self, group: int) -> Example:
        queue = self.pending[group]
        scanned = 0
        while not queue:
            if scanned >= MAX_SCAN_PER_EXAMPLE:
                raise ValueError(
                    f"environment {self.env.name!r} declares {self.num_groups} groups but no "
                    f"example of group {group} appeared in {scanned} examples after index "
                    f"{self.next_index - scanned}; groups must be in 0..num_groups-1"
                )
            example = self.env.make_example(self.next_index, self.seed)
            self.next_index += 1
            scanned += 1
            if not 0 <= example.group < self.num_groups:
                raise ValueError(
                    f"example {example.id} of {self.env.name!r} has group {example.group}, "
                    f"outside 0..{self.num_groups - 1}"
                )
            self.pending[example.group].append((self.next_index - 1, example))
        return queue.popleft()[1]

    def state_dict(self) -> dict:
        """What a checkpoint stores to continue the same stream of batches."""
        return {
            "seed": self.seed,
            "next_index": self.next_index,
            "first_group": self.first_group,
            "pending": [[index for index, _ in queue] for queue in self.pending],
        }

    def load_state_dict(self, state: dict) -> None:
        if state["seed"] != self.seed or len(state["pending"]) != self.num_groups:
            raise ValueError(
                f"sampler state is for seed {state['seed']} with {len(state['pending'])} "
                f"groups, this run has seed {self.seed} with {self.num_groups} groups"
            )
        self.next_index = state["next_index"]
        self.first_group = state["first_group"]
        self.pending = [
            deque((index, self.env.make_example(index, self.seed)) for index in indices)
            for indices in state["pending"]
        ]


def sample_places(rank: int, world_size: int, num_examples: int, group_size: int) -> list[int]:
    """Where each rollout of a data-parallel rank's share (its examples every world_size-th
    of the batch's `num_examples`, dealt as `Ranks.deal` does, each rolled out `group_size`
    times in a row) stands in `rollout_sample`'s order over every rank's rollouts put
    together rank by rank: the rank's rollouts at places below `count` are the sample's."""
    offset = sum(len(range(r, num_examples, world_size)) for r in range(rank))
    mine = len(range(rank, num_examples, world_size))
    return [m * num_examples + offset + e for e in range(mine) for m in range(group_size)]


def rollout_sample(rollouts: list[Rollout], group_size: int, count: int) -> list[Rollout]:
    """`count` rollouts for the sink: the first of every example, then the second...,
    so the sample spreads over examples and so over the stratified groups."""
    order = sorted(range(len(rollouts)), key=lambda i: (i % group_size, i // group_size))
    return [rollouts[i] for i in order[:count]]
