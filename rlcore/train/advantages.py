"""Advantages: how much better each rollout, or each move, did than its alternatives.

`group_advantages` is GRPO's (a rollout's reward against its group's mean);
`tree_advantages` credits each move of a multi-turn game against the other moves its group
tried in the same position; `turn_reward_advantages` does the same with the environment's
own per-move verdicts (Environment.turn_rewards). Pure functions over rewards, tested
directly.
"""

from __future__ import annotations

import torch

from rlcore.types import Rollout, Turn


def group_advantages(rewards: torch.Tensor, group_size: int, scale: bool) -> torch.Tensor:
    """Each reward minus the mean of its group of `group_size` adjacent rewards; with
    `scale`, divided by the group's standard deviation too (original GRPO). A group whose
    rewards are all equal gets advantage 0 either way: it carries no learning signal."""
    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    groups = rewards.view(-1, group_size)
    advantages = groups - groups.mean(dim=1, keepdim=True)
    if scale:
        advantages = advantages / (groups.std(dim=1, keepdim=True) + 1e-4)
    return advantages.flatten()


def position(turn: Turn) -> object:
    """The position a turn answered: the env's `decision_key`, else its prompt's token ids."""
    return turn.state_key or tuple(turn.prompt_ids)


def tree_advantages(rollouts: list[Rollout], group_size: int) -> list[list[float]]:
    """Per-turn advantages from the tree a group's rollouts make: credit to each move.

    Rollouts of one example share their start, and a seeded environment answers the same
    history the same way, so a group's rollouts form a tree of states. A turn's state is
    the env's `decision_key` for it (tic-tac-toe: board and turns used), else its prompt
    (token ids); keys merge rollouts that reached one position through different texts.
    The move made there leads to the next turn's state, or on the last turn to the end.
    Turn t of a rollout gets
        mean(return of the rollouts through the state its move led to)
        - mean(return of the rollouts through the state it was made in),
    a Monte Carlo Q(s, a) - V(s): the move is compared with the other moves tried in that
    very position, not the whole game with the whole group. A state only one rollout
    reached has nothing to compare with: its turn gets 0. The last turn's advantage is the
    rollout's return minus its state's mean, so for single-turn rollouts this is exactly
    `group_advantages` (unscaled).
    """
    if len(rollouts) % group_size:
        raise ValueError(f"{len(rollouts)} rollouts do not split into groups of {group_size}")
    advantages: list[list[float]] = []
    for start in range(0, len(rollouts), group_size):
        group = rollouts[start : start + group_size]
        totals: dict[tuple, list[float]] = {}  # node -> [sum of returns, count]
        paths = []
        for index, rollout in enumerate(group):
            states = [("state", position(turn)) for turn in rollout.turns]
            # A rollout with no turns (its first turn failed) has no moves to credit.
            children = states[1:] + [("end", index)] if states else []
            paths.append(list(zip(states, children, strict=True)))
            for node in set(states) | set(children):
                total = totals.setdefault(node, [0.0, 0])
                total[0] += rollout.reward
                total[1] += 1
        for path in paths:
            advantages.append(
                [
                    totals[child][0] / totals[child][1] - totals[state][0] / totals[state][1]
                    if totals[state][1] > 1
                    else 0.0
                    for state, child in path
                ]
            )
    return advantages


def turn_reward_advantages(
    rollouts: list[Rollout],
    turn_rewards: list[list[float]],
    group_size: int,
    batch_mean: float | None = None,
) -> list[list[float]]:
    """Per-turn advantages from the env's per-turn rewards (Environment.turn_rewards).

    Each turn's reward minus a baseline: the mean reward of the group's turns made in the
    same position (the env's `decision_key`, else the prompt) when those turns' rewards
    differ; otherwise (a position met once, or every move tried there scored the same)
    the mean over every turn of the batch. Where moves differed this compares a move with
    the others tried in its position, as `tree_advantages` does; where they did not, the
    reward still judges the move itself: a policy that always makes the same bad move in
    a position is pushed off it, where a per-position baseline would give it 0. A
    data-parallel rank passes `batch_mean`, the whole batch's over every rank, where the
    rollouts are its share.
    """
    if len(rollouts) % group_size:
        raise ValueError(f"{len(rollouts)} rollouts do not split into groups of {group_size}")
    for index, (rollout, rewards) in enumerate(zip(rollouts, turn_rewards, strict=True)):
        if len(rewards) != len(rollout.turns):
            raise ValueError(
                f"rollout {index} (example {rollout.example_id}) has {len(rollout.turns)} "
                f"turns but {len(rewards)} per-turn rewards"
            )
    if batch_mean is None:
        every = [reward for rewards in turn_rewards for reward in rewards]
        batch_mean = sum(every) / len(every) if every else 0.0
    advantages: list[list[float]] = []
    for start in range(0, len(rollouts), group_size):
        group = list(
            zip(
                rollouts[start : start + group_size],
                turn_rewards[start : start + group_size],
                strict=True,
            )
        )
        seen: dict[object, list[float]] = {}  # position -> rewards of the moves made there
        keys = []
        for rollout, rewards in group:
            row = [position(turn) for turn in rollout.turns]
            keys.append(row)
            for key, reward in zip(row, rewards, strict=True):
                seen.setdefault(key, []).append(reward)
        baselines = {
            key: sum(values) / len(values) if len(set(values)) > 1 else batch_mean
            for key, values in seen.items()
        }
        for row, (_, rewards) in zip(keys, group, strict=True):
            advantages.append(
                [reward - baselines[key] for key, reward in zip(row, rewards, strict=True)]
            )
    return advantages


def add_turn_advantages(
    base: list[list[float]], extra: list[list[float]], weight: float
) -> list[list[float]]:
    """base + weight * extra, turn by turn."""
    return [
        [a + weight * b for a, b in zip(row, more, strict=True)]
        for row, more in zip(base, extra, strict=True)
    ]
