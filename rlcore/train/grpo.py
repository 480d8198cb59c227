"""On-policy RL of a local model on a multi-turn environment: the GRPO family.

One step, as `run_rl` does it from top to bottom:
1. draw `batch_size / rollouts_per_example` fresh examples, an even mix of the env's
   groups (`StratifiedSampler`);
2. play `rollouts_per_example` rollouts of each with a `LocalEngine` that shares the
   training model, so rollouts always sample the current weights;
3. score them (the env's rubric already did: `rollout.reward`) and turn rewards into
   group advantages, reward minus the mean of its group (`group_advantages`), or per-move
   ones (`tree_advantages`), plus, with `turn_reward_weight`, the env's own verdict on
   each move (`turn_reward_advantages`);
4. build training sequences from each rollout's turns, with the token ids straight from
   generation, never re-tokenized text (`build_sequences`): the loss mask is 1 exactly on
   sampled tokens (with `train_think` off, on those after each reply's think block);
5. recompute the old logprobs with a no-grad forward pass (and the reference model's, for
   the KL term; with one update and no KL the update's own pass gives them), then take
   `num_iterations` optimizer updates on the masked loss (`policy_loss`: grpo, cispo or
   dr_grpo), micro-batched with gradient accumulation;
6. log metrics and sample rollouts to the sink, save a checkpoint when due.

A stop request (the sink's `should_stop`) is heard inside a step, not only between steps:
the engine abandons a generation between tokens, rollouts end before their next turn, and
the update stops between micro-batches. The step is then dropped whole, never stepped on
from a partial batch, and the state after the last complete step is saved (`stop_inside`).

Checkpoints hold everything a resumed run needs to continue exactly where this one was:
model and tokenizer, optimizer and scheduler state, the step, the example stream and the
python/numpy/torch random states, all as tensors and plain values, read back with
`torch.load(weights_only=True)` so that a crafted file cannot run code.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from rlcore.envs.base import Environment
from rlcore.envs.registry import load_environment
from rlcore.evaluate import summarize, summary_metrics
from rlcore.events import EventSink, NullSink
from rlcore.policy.local import LocalEngine
from rlcore.rollout import run_rollouts
from rlcore.train.config import RLConfig, save_config
from rlcore.train.decisions import (
    DecisionScorer,
    Scorer,
    decision_advantages,
    decision_tokens,
    supports_decisions,
    token_pieces,
)
from rlcore.train.sampling import StratifiedSampler
from rlcore.train.sft import (
    autocast,
    build_optimizer,
    checkpoint_dir,
    clip_gradients,
    load_model_and_tokenizer,
    pad_batch,
    resolve_device,
    save_checkpoint,
    seed_everything,
)
from rlcore.types import Rollout, SamplingParams, Turn

TRAINER_STATE = "trainer_state.pt"
# Config fields a resumed run may change without changing what it computes.
RESUMABLE_CHANGES = {
    "resume_from",
    "max_steps",
    "output_dir",
    "save_every",
    "device",
    "log_rollouts",
}

# ---------------------------------------------------------------------------------------
# Advantages, sequences and the loss: pure functions, tested directly


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
            children = states[1:] + [("end", index)]
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
    rollouts: list[Rollout], turn_rewards: list[list[float]], group_size: int
) -> list[list[float]]:
    """Per-turn advantages from the env's per-turn rewards (Environment.turn_rewards).

    Each turn's reward minus a baseline: the mean reward of the group's turns made in the
    same position (the env's `decision_key`, else the prompt) when those turns' rewards
    differ; otherwise (a position met once, or every move tried there scored the same)
    the mean over every turn of the batch. Where moves differed this compares a move with
    the others tried in its position, as `tree_advantages` does; where they did not, the
    reward still judges the move itself: a policy that always makes the same bad move in
    a position is pushed off it, where a per-position baseline would give it 0.
    """
    if len(rollouts) % group_size:
        raise ValueError(f"{len(rollouts)} rollouts do not split into groups of {group_size}")
    for index, (rollout, rewards) in enumerate(zip(rollouts, turn_rewards, strict=True)):
        if len(rewards) != len(rollout.turns):
            raise ValueError(
                f"rollout {index} (example {rollout.example_id}) has {len(rollout.turns)} "
                f"turns but {len(rewards)} per-turn rewards"
            )
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


def scale_negative(turn_advantages: list[list[float]], scale: float) -> list[list[float]]:
    """Every advantage below 0 times `scale` (cfg.negative_advantage_scale); the others
    unchanged. 0 keeps only the moves that did better than their alternatives."""
    return [[a * scale if a < 0 else a for a in turns] for turns in turn_advantages]


def think_length(completion_ids: list[int], pieces: dict[int, str], tokenizer) -> int:
    """How many leading tokens of a reply make up its think block, through `</think>`
    (0 when it has none). `pieces` caches each token id's text across calls."""
    text = ""
    for count, piece in enumerate(token_pieces(completion_ids, pieces, tokenizer), start=1):
        text += piece
        if "</think>" in text:
            return count
    return 0


Assembled = tuple[list[int], list[int], list[float] | None, list[int], list[int]]


def _assemble(rollout: Rollout) -> list[Assembled]:
    """The sequences of `build_sequences`, each with the turn index of every token and its
    position in that turn's completion (both -1 off the loss mask)."""
    sequences: list[Assembled] = []
    for index, turn in enumerate(rollout.turns):
        if sequences and turn.prompt_ids[: len(sequences[-1][0])] == sequences[-1][0]:
            input_ids, loss_mask, logprobs, turn_ids, offsets = sequences[-1]
            new_prompt = turn.prompt_ids[len(input_ids) :]
        else:
            input_ids, loss_mask, logprobs, turn_ids, offsets = [], [], [], [], []
            sequences.append((input_ids, loss_mask, logprobs, turn_ids, offsets))
            new_prompt = turn.prompt_ids
        input_ids.extend(new_prompt)
        loss_mask.extend([0] * len(new_prompt))
        turn_ids.extend([-1] * len(new_prompt))
        offsets.extend([-1] * len(new_prompt))
        input_ids.extend(turn.completion_ids)
        loss_mask.extend([1] * len(turn.completion_ids))
        turn_ids.extend([index] * len(turn.completion_ids))
        offsets.extend(range(len(turn.completion_ids)))
        if logprobs is not None:
            logprobs.extend([0.0] * len(new_prompt))
            logprobs.extend(turn.logprobs or [])
            if turn.logprobs is None:
                sequences[-1] = (input_ids, loss_mask, None, turn_ids, offsets)
    return sequences


def build_sequences(
    rollout: Rollout, *, with_logprobs: bool = False
) -> list[tuple[list[int], list[int]]] | list[tuple[list[int], list[int], list[float] | None]]:
    """Training sequences (input_ids, loss_mask) of one rollout, from its turns' token ids.

    Turn k+1 joins the current sequence when its prompt starts with that sequence (prompt
    and completion so far): only the new tokens, the env's reply and the next assistant
    header, are appended with mask 0, then the completion with mask 1. Otherwise (the chat
    template re-rendered history differently, say) turn k+1 starts a new sequence. With
    `with_logprobs` each tuple also holds the generation-time logprob of every token (0 off
    the mask), or None when the backend gave none.
    """
    sequences = _assemble(rollout)
    if with_logprobs:
        return [(input_ids, mask, logprobs) for input_ids, mask, logprobs, _, _ in sequences]
    return [(input_ids, mask) for input_ids, mask, _, _, _ in sequences]


def training_sequences(
    rollout: Rollout,
    turn_advantages: list[float],
    aggregation: str,
    skip: list[int] | None = None,
    kl_only: list[int] | None = None,
    decision_tokens: list[int | None] | None = None,
    rollout_index: int = 0,
    *,
    decision_only: bool = False,
    kl_untrained: bool = False,
) -> list[TrainingSequence]:
    """`build_sequences` of one rollout as TrainingSequences: every sampled token carries
    its turn's advantage and its weight in the loss's sum, 1 (token aggregation),
    1 / the sequence's sampled tokens (sequence) or 1 / its turn's sampled tokens (turn).
    `skip[t]` leading tokens of turn t (its think block, with train_think off) stay off
    the policy loss, and out of those counts.

    `kl_only[t]`, when given, limits the KL term to the leading tokens of turn t (its think
    block, with kl_scope "think"): those tokens join the mask with their own `kl_weights`
    (same aggregation rule, over the think tokens), even where `skip` keeps them out of the
    policy loss; every other token gets KL weight 0. Without it the KL term weighs tokens
    as the policy loss does.

    `decision_tokens[t]`, when given, is the index in turn t's completion of its decision
    token (None: no decision): each such token under the policy loss is listed in the
    sequence's `decisions` as (position in input_ids, rollout_index, t, that index), for
    decision sampling. With `decision_only` (train_scope "decision") a turn that has a
    decision keeps only that token under the policy loss (a turn without one, a malformed
    reply, keeps all its tokens). With `kl_untrained` (kl_scope "untrained") the KL term
    covers exactly the completion tokens the policy loss leaves out, weighed as `kl_only`'s
    are."""
    if len(turn_advantages) != len(rollout.turns):
        raise ValueError(
            f"{len(turn_advantages)} advantages for a rollout of {len(rollout.turns)} turns"
        )
    result = []
    if decision_only and decision_tokens is None:
        raise ValueError("decision_only needs decision_tokens")
    for input_ids, _, logprobs, turn_ids, offsets in _assemble(rollout):
        policy = [
            turn >= 0
            and offset >= (skip[turn] if skip else 0)
            and (
                not decision_only
                or decision_tokens[turn] is None
                or offset == decision_tokens[turn]
            )
            for turn, offset in zip(turn_ids, offsets, strict=True)
        ]
        if kl_untrained:
            anchored = [turn >= 0 and not keep for turn, keep in zip(turn_ids, policy, strict=True)]
        else:
            anchored = [
                kl_only is not None and turn >= 0 and offset < kl_only[turn]
                for turn, offset in zip(turn_ids, offsets, strict=True)
            ]
        separate_kl = kl_only is not None or kl_untrained
        weights = _aggregated_weights(turn_ids, policy, aggregation)
        kl_weights = _aggregated_weights(turn_ids, anchored, aggregation) if separate_kl else None
        loss_mask = [int(a or b) for a, b in zip(policy, anchored, strict=True)]
        advantages = [
            turn_advantages[turn] if keep else 0.0
            for turn, keep in zip(turn_ids, policy, strict=True)
        ]
        decisions = []
        if decision_tokens is not None:
            decisions = [
                (position, rollout_index, turn, offset)
                for position, (turn, offset, keep) in enumerate(
                    zip(turn_ids, offsets, policy, strict=True)
                )
                if keep and position > 0 and offset == decision_tokens[turn]
            ]
        result.append(
            TrainingSequence(
                input_ids,
                loss_mask,
                advantages,
                logprobs,
                weights=weights,
                turns=len({turn for turn, keep in zip(turn_ids, policy, strict=True) if keep}),
                kl_weights=kl_weights,
                decisions=decisions,
            )
        )
    return result


def _aggregated_weights(turn_ids: list[int], selected: list[bool], aggregation: str) -> list[float]:
    """Each selected token's weight in a loss sum: 1 (token), 1 / the sequence's selected
    tokens (sequence) or 1 / its turn's selected tokens (turn); 0 for the others."""
    turn_sizes: dict[int, int] = {}
    for turn, keep in zip(turn_ids, selected, strict=True):
        if keep:
            turn_sizes[turn] = turn_sizes.get(turn, 0) + 1
    total = max(sum(turn_sizes.values()), 1)
    weights = []
    for turn, keep in zip(turn_ids, selected, strict=True):
        if not keep:
            weights.append(0.0)
        elif aggregation == "sequence":
            weights.append(1.0 / total)
        elif aggregation == "turn":
            weights.append(1.0 / turn_sizes[turn])
        else:
            weights.append(1.0)
    return weights


def loss_normalizer(
    completion_tokens: int, num_sequences: int, cfg: RLConfig, num_turns: int | None = None
) -> float:
    """What the summed loss of a whole batch is divided by: the number of completion
    tokens (grpo, cispo with token aggregation: a token-level mean), the number of
    sequences (sequence aggregation: each sequence's own token mean is summed), the number
    of assistant turns (turn aggregation: each turn's own token mean is summed; one turn
    per sequence if not given), or the constant max_tokens * num_sequences (dr_grpo: no
    length bias)."""
    if cfg.loss_type == "dr_grpo":
        return float(cfg.max_tokens * num_sequences)
    if cfg.loss_aggregation == "sequence":
        return float(num_sequences)
    if cfg.loss_aggregation == "turn":
        return float(num_sequences if num_turns is None else num_turns)
    return float(completion_tokens)


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: RLConfig,
    *,
    normalizer: float | None = None,
    weights: torch.Tensor | None = None,
    kl_weights: torch.Tensor | None = None,
    decisions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The masked loss of `cfg.loss_type` on per-token logprobs of shape [sequences, tokens].

    grpo, dr_grpo: -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A) per token.
    cispo: -stopgrad(min(ratio, 1 + eps_high)) * A * logprob per token, so every token
    keeps a gradient, however far its ratio moved. The sum over masked tokens is divided by
    `normalizer` (default: this batch's `loss_normalizer`); pass the whole batch's value
    when this is one micro-batch of it, so accumulated gradients equal the full batch's.
    `advantages` is one value per sequence [sequences] or per token [sequences, tokens];
    `weights` [sequences, tokens], when given, weighs each token in the sum instead of the
    aggregation's own rule (it is what `training_sequences` computed).
    With `cfg.beta` > 0 the k3 estimate of KL(policy || reference) per token, normalized
    the same way, is added times beta; `kl_weights`, when given, weighs each token in the
    KL sum instead (kl_scope "think": the think block only). `decisions` [sequences,
    tokens], when given, limits `cfg.unlikelihood_below` to the tokens it marks.
    Stats: `loss/policy`, `loss/kl` (mean per token), `policy/clip_fraction` (share of
    tokens whose clip was active), `policy/unlikelihood_fraction` (share pushed down by
    `cfg.unlikelihood_below`), `tokens`.
    """
    mask = mask.to(logprobs.dtype)
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    if normalizer is None:
        normalizer = loss_normalizer(int(mask.sum()), logprobs.shape[0], cfg)
    normalizer = max(float(normalizer), 1e-8)
    ratio = torch.exp(logprobs - old_logprobs)
    if cfg.loss_type == "cispo":
        weight = ratio.clamp(max=1 + cfg.clip_eps_high).detach()
        per_token = -weight * advantages * logprobs
        clipped = ratio > 1 + cfg.clip_eps_high
    elif cfg.loss_type in ("grpo", "dr_grpo"):
        unclipped = ratio * advantages
        clipped_objective = ratio.clamp(1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high) * advantages
        per_token = -torch.minimum(unclipped, clipped_objective)
        clipped = clipped_objective < unclipped
    else:
        raise ValueError(f"loss_type must be one of grpo, cispo, dr_grpo; got {cfg.loss_type!r}")
    unlikely = torch.zeros_like(mask, dtype=torch.bool)
    if cfg.unlikelihood_below > 0:
        # Negative-advantage tokens the policy was not sure of: -|A| log(1 - p) in place
        # of the policy gradient term, so a confident mistake is pushed off at full
        # strength (its logit's gradient is |A| p, not |A| (1 - p)).
        probability = logprobs.exp()
        unlikely = (advantages < 0) & (probability.detach() < cfg.unlikelihood_below)
        if decisions is not None:  # only where the starting model was unsure
            unlikely = unlikely & decisions
        pushed = advantages * torch.log1p(-probability.clamp(max=1 - 1e-6))
        per_token = torch.where(unlikely, pushed, per_token)
        clipped = clipped & ~unlikely
    # Per-token weights of the sum: 1 (token and dr_grpo aggregation) or 1 / the
    # sequence's own token count (sequence aggregation: every sequence weighs the same).
    if weights is not None:
        weights = weights.to(logprobs.dtype) * mask
    elif cfg.loss_aggregation == "sequence" and cfg.loss_type != "dr_grpo":
        weights = mask / mask.sum(dim=1, keepdim=True).clamp(min=1.0)
    else:
        weights = mask
    policy = (per_token * weights).sum() / normalizer
    tokens = float(mask.sum())
    kl_mean = 0.0
    loss = policy
    if ref_logprobs is not None and cfg.beta > 0:
        log_ratio_ref = ref_logprobs - logprobs
        kl = torch.exp(log_ratio_ref) - log_ratio_ref - 1  # k3: unbiased, always >= 0
        if kl_weights is None:
            kl_weights, kl_mask = weights, mask
        else:
            kl_weights = kl_weights.to(logprobs.dtype) * mask
            kl_mask = (kl_weights > 0).to(logprobs.dtype)
        loss = policy + cfg.beta * (kl * kl_weights).sum() / normalizer
        kl_mean = float((kl * kl_mask).sum().detach()) / max(float(kl_mask.sum()), 1.0)
    stats = {
        "loss/policy": float(policy.detach()),
        "loss/kl": kl_mean,
        "policy/clip_fraction": float((clipped.to(mask.dtype) * mask).sum()) / max(tokens, 1.0),
        "policy/unlikelihood_fraction": float((unlikely.to(mask.dtype) * mask).sum())
        / max(tokens, 1.0),
        "tokens": tokens,
    }
    return loss, stats


def token_logprobs(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float,
    *,
    with_entropy: bool = False,
    at: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Logprob of every next token under softmax(logits / temperature), shape [B, T-1]
    (the distribution the engine sampled from), optionally its entropy, and with `at`
    (row and target-column indices) the whole log-distribution at those targets [n, V].
    Gathering minus logsumexp avoids a second vocabulary-sized tensor for the log-softmax."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
    logits = logits.float() / temperature
    log_normalizer = torch.logsumexp(logits, dim=-1)
    logprobs = logits.gather(-1, input_ids[:, 1:, None]).squeeze(-1) - log_normalizer
    entropy = None
    if with_entropy:
        entropy = log_normalizer - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    distributions = None
    if at is not None:
        rows, columns = at
        distributions = logits[rows, columns] - log_normalizer[rows, columns, None]
    return logprobs, entropy, distributions


# ---------------------------------------------------------------------------------------
# Batches


@dataclass
class TrainingSequence:
    """One training sequence and what the loss needs about it."""

    input_ids: list[int]
    loss_mask: list[int]
    advantages: list[float]  # per token: its turn's advantage (0 off the mask)
    sampled_logprobs: list[float] | None  # at generation time, per token (0 off the mask)
    weights: list[float] | None = None  # per token, in the loss's sum (None: the mask)
    turns: int = 1  # assistant turns in this sequence
    old_logprobs: torch.Tensor | None = None  # [len - 1], from the no-grad pass
    ref_logprobs: torch.Tensor | None = None
    kl_weights: list[float] | None = None  # per token, in the KL term's sum (None: weights)
    ref_entropy: torch.Tensor | None = None  # [len - 1], the reference's sampling entropy
    # (position in input_ids, rollout index, turn index, index in the turn's completion)
    # of each decision token, for decision sampling
    decisions: list[tuple[int, int, int, int]] = field(default_factory=list)


def micro_batches(sequences: list[TrainingSequence], size: int) -> list[list[TrainingSequence]]:
    """Chunks of `size` sequences of similar length, so little compute goes to padding."""
    ordered = sorted(sequences, key=lambda s: len(s.input_ids))
    return [ordered[start : start + size] for start in range(0, len(ordered), size)]


def collate(chunk: list[TrainingSequence], pad_id: int, device: torch.device):
    """Right-padded input ids, attention mask and the loss mask aligned with the targets."""
    input_ids = pad_batch([s.input_ids for s in chunk], pad_id).to(device)
    attention_mask = pad_batch([[1] * len(s.input_ids) for s in chunk], 0).to(device)
    loss_mask = pad_batch([s.loss_mask for s in chunk], 0)[:, 1:].to(device)
    return input_ids, attention_mask, loss_mask


def target_rows(values: list[list[float]], width: int, device) -> torch.Tensor:
    """Per-token values of each sequence, aligned with the targets (`collate`'s mask: the
    first token is never predicted), right-padded with 0 to `width`."""
    return padded([torch.tensor(v[1:], dtype=torch.float32) for v in values], width, device)


def policy_weights(chunk: list[TrainingSequence], width: int, device) -> torch.Tensor:
    """Each target token's weight in the policy loss's sum, aligned with `collate`'s mask."""
    return target_rows([s.weights or s.loss_mask for s in chunk], width, device)


def padded(tensors: list[torch.Tensor], width: int, device: torch.device) -> torch.Tensor:
    rows = [torch.nn.functional.pad(t, (0, width - t.numel())) for t in tensors]
    return torch.stack(rows).to(device)


# ---------------------------------------------------------------------------------------
# Checkpoints


def random_states() -> dict:
    """The python, numpy and torch random states as tensors and plain numbers only, so
    `torch.load(weights_only=True)` can read them back (pickled numpy arrays and the like
    would need the unpickler that runs code)."""
    version, internal, gauss_next = random.getstate()
    algorithm, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    states = {
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
        "numpy": {
            "algorithm": str(algorithm),
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(position),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore_random_states(states: dict) -> None:
    python = states["python"]
    random.setstate((python["version"], tuple(python["internal"]), python["gauss_next"]))
    numpy = states["numpy"]
    np.random.set_state(
        (
            numpy["algorithm"],
            numpy["keys"].numpy().astype(np.uint32),
            numpy["pos"],
            numpy["has_gauss"],
            numpy["cached_gaussian"],
        )
    )
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def save_training_checkpoint(
    path,
    *,
    step,
    model,
    tokenizer,
    cfg,
    optimizer,
    scheduler,
    sampler_state: dict,
    random_state: dict,
):
    """Model and tokenizer (safetensors, via save_pretrained) plus TRAINER_STATE: the step,
    optimizer, scheduler, sampler and random states, all tensors and plain values."""
    save_checkpoint(model, tokenizer, cfg, path)
    state = {
        "step": step,
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "sampler": sampler_state,
        "random": random_state,
    }
    torch.save(state, Path(path) / TRAINER_STATE)
    return str(path)


def load_trainer_state(path: str | Path, cfg: RLConfig) -> tuple[dict, list[str]]:
    """The trainer state of checkpoint `path`, and the config fields that differ from it.

    Read with `weights_only=True`: a checkpoint directory may come from anywhere (an
    upload, a shared folder), and a full unpickle runs whatever code the file names. A
    file that needs more than tensors and plain values is refused, not run."""
    path = Path(path)
    state_path = path / TRAINER_STATE
    if not state_path.is_file():
        raise ValueError(
            f"resume_from={str(path)!r} is not an RL checkpoint (no {TRAINER_STATE}); "
            "accepted: a step_NNNNNN/ or final/ directory written by an RL run"
        )
    try:
        state = torch.load(state_path, map_location="cpu", weights_only=True)
    except Exception as exc:  # UnpicklingError, or whatever a damaged file makes torch raise
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(
            f"refusing to load {str(state_path)!r}: it is not a trainer state this version "
            "writes (tensors and plain values, loadable with weights_only=True); it may hold "
            f"code to run, or come from an older version ({type(exc).__name__}: {reason})"
        ) from None
    missing = {"step", "optimizer", "scheduler", "sampler", "random"} - set(
        state if isinstance(state, dict) else ()
    )
    if missing:
        raise ValueError(
            f"{str(state_path)!r} is not a trainer state: it lacks {sorted(missing)}; "
            "accepted: the file an RL run writes in each checkpoint"
        )
    saved_config = json.loads((path / "train_config.json").read_text())
    current = cfg.to_dict()
    changed = sorted(
        key
        for key in current
        if key not in RESUMABLE_CHANGES and saved_config.get(key) != current[key]
    )
    return state, changed


# ---------------------------------------------------------------------------------------
# The two passes over a batch of sequences


class StepStopped(Exception):
    """A stop request heard between micro-batches: the step is to be dropped. `updates`
    is how many optimizer updates of the step were already taken, `where` says where."""

    def __init__(self, where: str, updates: int):
        super().__init__(where)
        self.where = where
        self.updates = updates


@torch.no_grad()
def score_sequences(
    model, reference, sequences, cfg: RLConfig, pad_id: int, device, should_stop=None
) -> dict:
    """Fill each sequence's old (and reference) logprobs with one no-grad pass of the
    current weights; return the mean entropy of the trained completion tokens and the mean
    absolute gap to the logprobs the engine sampled with (policy/logprob_mismatch).
    `should_stop` is asked before each micro-batch; StepStopped when it says True."""
    entropy_sum, completion_tokens, mismatch_sum, mismatch_tokens = 0.0, 0, 0.0, 0
    chunks = micro_batches(sequences, cfg.micro_batch_size)
    for index, chunk in enumerate(chunks):
        if should_stop is not None and should_stop():
            raise StepStopped(f"scoring: micro-batch {index + 1} of {len(chunks)} not run", 0)
        input_ids, attention_mask, loss_mask = collate(chunk, pad_id, device)
        weights = policy_weights(chunk, loss_mask.shape[1], device)
        trained = loss_mask * (weights > 0)  # under the policy loss, not the KL alone
        with autocast(device):
            old, entropy, _ = token_logprobs(
                model, input_ids, attention_mask, cfg.temperature, with_entropy=True
            )
            ref = ref_entropy = None
            if reference is not None:
                ref, ref_entropy, _ = token_logprobs(
                    reference,
                    input_ids,
                    attention_mask,
                    cfg.temperature,
                    with_entropy=cfg.unlikelihood_ref_entropy > 0,
                )
        entropy_sum += float((entropy * trained).sum())
        completion_tokens += int(trained.sum())
        for row, sequence in enumerate(chunk):
            length = len(sequence.input_ids) - 1
            sequence.old_logprobs = old[row, :length].cpu()
            if ref is not None:
                sequence.ref_logprobs = ref[row, :length].cpu()
                if ref_entropy is not None:
                    sequence.ref_entropy = ref_entropy[row, :length].float().cpu()
            if sequence.sampled_logprobs is not None:
                sampled = torch.tensor(sequence.sampled_logprobs[1:])
                on_mask = torch.tensor(sequence.loss_mask[1:], dtype=torch.bool)
                mismatch_sum += float((sequence.old_logprobs - sampled).abs()[on_mask].sum())
                mismatch_tokens += int(on_mask.sum())
    return {
        "policy/entropy": entropy_sum / max(completion_tokens, 1),
        "policy/logprob_mismatch": mismatch_sum / max(mismatch_tokens, 1),
    }


def update_policy(
    model,
    optimizer,
    scheduler,
    sequences,
    normalizer: float,
    cfg: RLConfig,
    pad_id: int,
    device,
    *,
    with_reference: bool,
    scorer: Scorer | None = None,
    should_stop=None,
) -> dict:
    """`cfg.num_iterations` optimizer updates on the batch, each accumulating the gradient
    of `policy_loss` over length-sorted micro-batches; returns the loss statistics.
    With `cfg.decision_samples` and a `scorer`, each sequence's decisions add
    `decision_loss` (samples drawn afresh in every update). `should_stop` is asked before
    each micro-batch; when it says True, StepStopped is raised with the gradient of the
    partial batch left for the caller to drop (never stepped on)."""
    sampling_decisions = cfg.decision_samples > 0 and scorer is not None
    # A sequence with advantage 0 adds no policy gradient, so without a KL term it is
    # skipped; its tokens still count in `normalizer`, so the loss is the full batch's.
    # (An entropy bonus reaches every sampled token, so it keeps them all.)
    trainable = [
        s
        for s in sequences
        if any(s.advantages)
        or with_reference
        or cfg.entropy_coef > 0
        or (sampling_decisions and s.decisions)
    ]
    decision_stats = DecisionStats()
    # With one update and no reference the old logprobs are the current ones: take them
    # from this very forward pass (ratio exactly 1) instead of a separate no-grad pass,
    # and measure entropy and the sampling mismatch here, on the sequences trained on.
    single_pass = cfg.num_iterations == 1 and not with_reference
    with_entropy = single_pass or cfg.entropy_coef > 0
    policy_sum, kl_sum, clipped_sum, tokens = 0.0, 0.0, 0.0, 0.0
    entropy_sum, entropy_tokens, bonus_sum, unlikely_sum = 0.0, 0.0, 0.0, 0.0
    mismatch_sum, mismatch_tokens = 0.0, 0
    grad_norms, learning_rates = [], []
    chunks = micro_batches(trainable, cfg.micro_batch_size)
    for iteration in range(cfg.num_iterations):
        for index, chunk in enumerate(chunks):
            if should_stop is not None and should_stop():
                raise StepStopped(
                    f"update {iteration + 1} of {cfg.num_iterations}: micro-batch "
                    f"{index + 1} of {len(chunks)} not run",
                    iteration,
                )
            input_ids, attention_mask, loss_mask = collate(chunk, pad_id, device)
            width = loss_mask.shape[1]
            ref = padded([s.ref_logprobs for s in chunk], width, device) if with_reference else None
            advantages = target_rows([s.advantages for s in chunk], width, device)
            weights = policy_weights(chunk, width, device)
            kl_weights = None
            if with_reference and chunk[0].kl_weights is not None:
                kl_weights = target_rows([s.kl_weights for s in chunk], width, device)
            decisions = None
            if cfg.unlikelihood_ref_entropy > 0:
                entropies = padded([s.ref_entropy for s in chunk], width, device)
                decisions = entropies >= cfg.unlikelihood_ref_entropy
            at = decision_targets(chunk, device) if sampling_decisions else None
            with autocast(device):
                logprobs, entropy, distributions = token_logprobs(
                    model,
                    input_ids,
                    attention_mask,
                    cfg.temperature,
                    with_entropy=with_entropy,
                    at=at,
                )
            trained = loss_mask * (weights > 0)  # under the policy loss, not the KL alone
            if with_entropy:
                entropy_sum += float((entropy.detach() * trained).sum())
                entropy_tokens += float(trained.sum())
            if single_pass:
                old = logprobs.detach()
                for row, sequence in enumerate(chunk):
                    if sequence.sampled_logprobs is None:
                        continue
                    length = len(sequence.input_ids) - 1
                    sampled = torch.tensor(sequence.sampled_logprobs[1:], device=device)
                    on_mask = loss_mask[row, :length].bool()
                    gap = (old[row, :length].float() - sampled).abs()[on_mask]
                    mismatch_sum += float(gap.sum())
                    mismatch_tokens += int(on_mask.sum())
            else:
                old = padded([s.old_logprobs for s in chunk], width, device)
            loss, stats = policy_loss(
                logprobs,
                old,
                ref,
                advantages,
                loss_mask,
                cfg,
                normalizer=normalizer,
                weights=weights,
                kl_weights=kl_weights,
                decisions=decisions,
            )
            if cfg.entropy_coef > 0:
                # The entropy of each trained token's sampling distribution, weighed and
                # normalized as the policy loss is, rewarded: it keeps exploration alive.
                bonus = (entropy * weights * trained).sum() / max(float(normalizer), 1e-8)
                loss = loss - cfg.entropy_coef * bonus
                bonus_sum += float(bonus.detach())
            if distributions is not None and len(distributions):
                loss = loss + decision_loss(
                    chunk, distributions, cfg, scorer, normalizer, decision_stats
                )
            loss.backward()
            policy_sum += stats["loss/policy"]
            kl_sum += stats["loss/kl"] * stats["tokens"]
            clipped_sum += stats["policy/clip_fraction"] * stats["tokens"]
            unlikely_sum += stats["policy/unlikelihood_fraction"] * stats["tokens"]
            tokens += stats["tokens"]
        grad_norms.append(clip_gradients(model, cfg.max_grad_norm))
        learning_rates.append(scheduler.get_last_lr()[0])
        optimizer.step()  # with nothing trainable no parameter has a gradient: none moves
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    kl = kl_sum / max(tokens, 1.0)
    policy = policy_sum / cfg.num_iterations
    bonus = bonus_sum / cfg.num_iterations
    measured = {}
    if with_entropy:
        measured["policy/entropy"] = entropy_sum / max(entropy_tokens, 1.0)
    if single_pass:
        measured["policy/logprob_mismatch"] = mismatch_sum / max(mismatch_tokens, 1)
    if cfg.entropy_coef > 0:
        measured["loss/entropy_bonus"] = bonus
    if cfg.unlikelihood_below > 0:
        measured["policy/unlikelihood_fraction"] = unlikely_sum / max(tokens, 1.0)
    if sampling_decisions:
        measured.update(decision_stats.metrics(cfg.num_iterations))
    return measured | {
        "loss/policy": policy,
        "loss/kl": kl,
        "loss/total": policy + cfg.beta * kl - cfg.entropy_coef * bonus,
        "policy/clip_fraction": clipped_sum / max(tokens, 1.0),
        "optim/grad_norm": sum(grad_norms) / len(grad_norms),
        "optim/lr": learning_rates[-1],
    }


def decision_targets(chunk: list[TrainingSequence], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and target-column indices of the chunk's decision tokens, in `decisions` order
    (the target predicting input position j sits in column j - 1)."""
    rows = [row for row, s in enumerate(chunk) for _ in s.decisions]
    columns = [position - 1 for s in chunk for position, *_ in s.decisions]
    return (
        torch.tensor(rows, dtype=torch.long, device=device),
        torch.tensor(columns, dtype=torch.long, device=device),
    )


class DecisionStats:
    """Running sums for the decision-sampling metrics of one update_policy call."""

    def __init__(self) -> None:
        self.groups = 0
        self.reward_sum = 0.0
        self.samples = 0
        self.zero_groups = 0
        self.loss_sum = 0.0

    def metrics(self, iterations: int) -> dict[str, float]:
        return {
            "decision/groups": self.groups / max(iterations, 1),
            "decision/reward_mean": self.reward_sum / max(self.samples, 1),
            "decision/zero_group_rate": self.zero_groups / max(self.groups, 1),
            "loss/decision": self.loss_sum / max(iterations, 1),
        }


def decision_loss(
    chunk: list[TrainingSequence],
    distributions: torch.Tensor,
    cfg: RLConfig,
    scorer: Scorer,
    normalizer: float,
    stats: DecisionStats,
) -> torch.Tensor:
    """The decision-sampling term of a micro-batch (rlcore.train.decisions).

    `distributions` [decisions, V] are the log-probabilities at the chunk's decision
    tokens (`decision_targets` order), with gradient. `cfg.decision_samples` tokens are
    drawn per decision from exp(distributions) (with `cfg.decision_temperature`, from that
    distribution re-tempered: an exploring draw), scored by `scorer` and given group
    advantages. Samples are drawn afresh in every update from the current weights, so
    they are always on-policy: each update of a batch (`num_iterations`) is a new round of
    answers in the positions the rollouts reached, with no rollout to pay for, and the
    ratio is 1 (no clip). An exploring draw is trained as if the policy had drawn it (no
    importance weight): a good answer the policy rarely gives is pushed up as hard as a
    common one, which is the point of exploring. Each sample then is one more token of `policy_loss` (same loss type and clip),
    weighing `cfg.decision_weight / K`: a decision's K samples together weigh as much as
    one turn under turn aggregation, in the sum `normalizer` divides.
    """
    count = cfg.decision_samples
    tokens, advantages = [], []
    start = 0
    for sequence in chunk:
        size = len(sequence.decisions)
        if not size:
            continue
        rows = distributions[start : start + size]
        start += size
        detached = rows.detach().float()
        draw_from = detached
        if cfg.decision_temperature > 0:
            draw_from = detached * (cfg.temperature / cfg.decision_temperature)
        sampled = torch.multinomial(torch.softmax(draw_from, dim=-1), count, replacement=True)
        rewards = torch.tensor(
            [
                scorer(rollout_index, turn_index, index, row_tokens)
                for (_, rollout_index, turn_index, index), row_tokens in zip(
                    sequence.decisions, sampled.tolist(), strict=True
                )
            ],
            dtype=torch.float32,
            device=rows.device,
        )
        stats.groups += size
        stats.samples += rewards.numel()
        stats.reward_sum += float(rewards.sum())
        stats.zero_groups += int((rewards.std(dim=1) == 0).sum())
        tokens.append(sampled)
        advantages.append(decision_advantages(rewards, cfg.decision_scale_rewards))
    sampled = torch.cat(tokens)
    logprobs = distributions.float().gather(1, sampled)
    mask = torch.ones_like(logprobs)
    loss, _ = policy_loss(
        logprobs,
        logprobs.detach(),
        None,
        torch.cat(advantages),
        mask,
        cfg,
        normalizer=normalizer,
        weights=mask * (cfg.decision_weight / count),
    )
    stats.loss_sum += float(loss.detach())
    return loss


def curriculum_groups(cfg: RLConfig, num_groups: int, step: int) -> list[int]:
    """The env groups step `step` (1-based) deals from: all of them without a curriculum;
    with `curriculum_steps` N, the first 1 + floor((step - 1) * groups / N) of
    `curriculum_order` (all once step > N)."""
    order = list(cfg.curriculum_order) or list(range(num_groups))
    if sorted(order) != list(range(num_groups)):
        raise ValueError(
            f"curriculum_order {cfg.curriculum_order!r} must list each of the env's "
            f"{num_groups} groups (0..{num_groups - 1}) once"
        )
    if not cfg.curriculum_steps:
        return order
    unlocked = 1 + (step - 1) * len(order) // cfg.curriculum_steps
    return order[: min(len(order), unlocked)]


def rollout_sample(rollouts: list[Rollout], group_size: int, count: int) -> list[Rollout]:
    """`count` rollouts for the sink: the first of every example, then the second...,
    so the sample spreads over examples and so over the stratified groups."""
    order = sorted(range(len(rollouts)), key=lambda i: (i % group_size, i // group_size))
    return [rollouts[i] for i in order[:count]]


# ---------------------------------------------------------------------------------------
# The training loop


def run_rl(cfg: RLConfig, sink: EventSink | None = None) -> str | None:
    """Train `cfg.model` with RL on `cfg.env`; returns the final checkpoint directory.

    `sink.should_stop()` is asked between steps, before every model turn of the rollouts
    and between micro-batches of the update; once it says True the run ends within the
    step (see `stop_inside` there) and returns the checkpoint it saved: the state after
    the last complete step, or None when a stop in a later update of a step
    (num_iterations > 1) left nothing complete to save and no earlier checkpoint exists."""
    sink = sink or NullSink()
    cfg.validate()
    device = resolve_device(cfg.device)
    seed_everything(cfg.seed)
    output_dir = Path(cfg.output_dir)
    save_config(cfg, output_dir)

    # Environment, policy model, optional frozen reference, optimizer, example stream.
    env = load_environment(cfg.env, **cfg.env_args)
    if cfg.turn_reward_weight > 0 and type(env).turn_rewards is Environment.turn_rewards:
        raise ValueError(
            f"turn_reward_weight={cfg.turn_reward_weight} needs an env with per-turn rewards; "
            f"{env.name!r} judges whole episodes only (set turn_reward_weight = 0)"
        )
    if (cfg.decision_samples or cfg.train_scope == "decision") and not supports_decisions(env):
        raise ValueError(
            f"decision_samples={cfg.decision_samples} / train_scope={cfg.train_scope!r} need "
            "an env that names each reply's decision and scores alternatives "
            f"(decision_offset, score_decision); {env.name!r} does not (set decision_samples "
            "= 0 and train_scope = 'reply')"
        )
    model, tokenizer = load_model_and_tokenizer(cfg.resume_from or cfg.model, device)
    model.eval()  # no dropout: the importance ratio must be exactly 1 before an update
    reference = None
    if cfg.beta > 0 or cfg.unlikelihood_ref_entropy > 0:
        reference, _ = load_model_and_tokenizer(cfg.model, device)
        reference.eval().requires_grad_(False)
    optimizer, scheduler = build_optimizer(model, cfg, cfg.max_steps * cfg.num_iterations)
    examples_per_step = cfg.batch_size // cfg.rollouts_per_example
    sampler = StratifiedSampler(env, cfg.seed, examples_per_step)
    curriculum_groups(cfg, sampler.num_groups, 1)  # a bad curriculum_order fails here
    engine = LocalEngine(
        None, model=model, tokenizer=tokenizer, name="policy", should_stop=sink.should_stop
    )
    sampling = SamplingParams(
        temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=cfg.max_tokens
    )
    start_step = 0
    if cfg.resume_from:
        state, changed = load_trainer_state(cfg.resume_from, cfg)
        if changed:
            sink.log(f"rl: resuming with changed settings {changed}", "warning")
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        sampler.load_state_dict(state["sampler"])
        restore_random_states(state["random"])
        start_step = state["step"]
        sink.log(f"rl: resumed from {cfg.resume_from} at step {start_step}")
    sink.log(
        f"rl: {cfg.loss_type} on {env.name}, {examples_per_step} examples x "
        f"{cfg.rollouts_per_example} rollouts per step, steps {start_step + 1}..{cfg.max_steps}"
    )

    last_saved: str | None = cfg.resume_from

    def checkpoint(step: int, path: Path, start: tuple[dict, dict] | None = None) -> str:
        """Save the run after `step`; `start` (sampler and random states) replaces the
        current ones when the step after it was begun and then dropped."""
        nonlocal last_saved
        sampler_state, random_state = start or (sampler.state_dict(), random_states())
        last_saved = save_training_checkpoint(
            path,
            step=step,
            model=model,
            tokenizer=tokenizer,
            cfg=cfg,
            optimizer=optimizer,
            scheduler=scheduler,
            sampler_state=sampler_state,
            random_state=random_state,
        )
        sink.checkpoint(step, last_saved)
        return last_saved

    def stop_inside(step: int, where: str, updates: int, start: tuple[dict, dict]) -> str | None:
        """End the run on a stop request that came in the middle of `step`: the step is
        dropped (its gradients too: no optimizer step from a partial batch). Before the
        step's first update the weights and optimizer are still those after step - 1, so
        that state is saved, with the sampler and random states the step began from: a
        resumed run plays the dropped step exactly. After an update (num_iterations > 1)
        the weights are part-way through the step, so nothing is saved; the last
        checkpoint saved, if any, is returned."""
        optimizer.zero_grad(set_to_none=True)
        if updates == 0:
            path = checkpoint(step - 1, checkpoint_dir(output_dir, step - 1), start)
            sink.log(
                f"rl: stopped on request inside step {step} ({where}); the step is dropped, "
                f"saved the state after step {step - 1}: {path}",
                "warning",
            )
            return path
        sink.log(
            f"rl: stopped on request inside step {step} ({where}), after {updates} of its "
            f"{cfg.num_iterations} updates; no checkpoint of this part-way state is saved "
            f"(last saved: {last_saved or 'none'})",
            "warning",
        )
        return last_saved

    outcome_labels: set[str] = set()  # every label seen so far, reported even at rate 0
    pieces: dict[int, str] = {}  # token id -> text, for think_length
    loop = asyncio.new_event_loop()  # one loop for the run: the engine keeps its queue on it
    try:
        for step in range(start_step + 1, cfg.max_steps + 1):
            if sink.should_stop():
                path = checkpoint(step - 1, checkpoint_dir(output_dir, step - 1))
                sink.log(f"rl: stopped on request after step {step - 1}; saved {path}", "warning")
                return path
            step_started = time.monotonic()
            # Where this step starts from, saved instead if a stop request drops it.
            start = (sampler.state_dict(), random_states())

            # 1-2. A stratified batch of examples, each rolled out as a group; a stop
            #      request cuts the engine's generation short and drops the rollouts.
            unlocked = curriculum_groups(cfg, sampler.num_groups, step)
            examples = sampler.next_batch(unlocked)
            rollouts = loop.run_until_complete(
                run_rollouts(
                    env,
                    engine,
                    examples,
                    sampling=sampling,
                    rollouts_per_example=cfg.rollouts_per_example,
                    concurrency=cfg.concurrency,
                    should_stop=sink.should_stop,
                )
            )
            if len(rollouts) < cfg.batch_size:
                where = f"rollouts: {len(rollouts)} of {cfg.batch_size} finished"
                return stop_inside(step, where, 0, start)
            rollout_seconds = time.monotonic() - step_started
            train_started = time.monotonic()

            # 3. Advantages from the rubric's rewards: one per rollout against its group's
            #    mean, or one per turn against the other moves tried in the same position.
            rewards = torch.tensor([r.reward for r in rollouts], dtype=torch.float32)
            if cfg.advantage == "tree":
                turn_advantages = tree_advantages(rollouts, cfg.rollouts_per_example)
            elif cfg.advantage == "none":
                turn_advantages = [[0.0] * len(r.turns) for r in rollouts]
            else:
                advantages = group_advantages(
                    rewards, cfg.rollouts_per_example, cfg.scale_rewards
                ).tolist()
                turn_advantages = [
                    [value] * len(r.turns) for r, value in zip(rollouts, advantages, strict=True)
                ]
            turn_reward_mean = None
            if cfg.turn_reward_weight > 0:
                per_turn = [env.turn_rewards(r) for r in rollouts]
                missing = [i for i, rewards in enumerate(per_turn) if rewards is None]
                if missing:
                    raise ValueError(
                        f"turn_reward_weight={cfg.turn_reward_weight} but env {env.name!r} "
                        f"gave no per-turn rewards for {len(missing)} of {len(rollouts)} "
                        "rollouts; set turn_reward_weight = 0 for this env"
                    )
                turn_advantages = add_turn_advantages(
                    turn_advantages,
                    turn_reward_advantages(rollouts, per_turn, cfg.rollouts_per_example),
                    cfg.turn_reward_weight,
                )
                flat_rewards = [value for rewards in per_turn for value in rewards]
                turn_reward_mean = sum(flat_rewards) / max(len(flat_rewards), 1)
            turn_advantages = scale_negative(turn_advantages, cfg.negative_advantage_scale)
            flat_advantages = torch.tensor([a for turns in turn_advantages for a in turns] or [0.0])

            # 4. Training sequences: the sampled token ids, loss only on sampled tokens.
            aggregation = "token" if cfg.loss_type == "dr_grpo" else cfg.loss_aggregation
            thinks = None
            if not cfg.train_think or cfg.kl_scope == "think":
                thinks = [
                    [think_length(t.completion_ids, pieces, tokenizer) for t in rollout.turns]
                    for rollout in rollouts
                ]
            scorer = None
            if cfg.decision_samples:
                scorer = DecisionScorer(env, rollouts, pieces, tokenizer)
            needs_decisions = cfg.decision_samples > 0 or cfg.train_scope == "decision"
            sequences = [
                sequence
                for index, (rollout, advantages) in enumerate(
                    zip(rollouts, turn_advantages, strict=True)
                )
                for sequence in training_sequences(
                    rollout,
                    advantages,
                    aggregation,
                    None if cfg.train_think else thinks[index],
                    thinks[index] if cfg.kl_scope == "think" else None,
                    decision_tokens(env, rollout, pieces, tokenizer) if needs_decisions else None,
                    index,
                    decision_only=cfg.train_scope == "decision",
                    kl_untrained=cfg.kl_scope == "untrained",
                )
            ]
            # Tokens under the policy loss (a think block kept only for the KL is not one).
            completion_tokens = sum(sum(w > 0 for w in s.weights) for s in sequences)
            normalizer = loss_normalizer(
                completion_tokens, len(sequences), cfg, sum(s.turns for s in sequences)
            )

            # 5. Old and reference logprobs (their own no-grad pass only when several updates
            #    or a KL term need them), then the masked-loss updates. A stop request is
            #    heard between micro-batches and drops the step.
            pad_id = tokenizer.pad_token_id
            scored = {}
            try:
                if cfg.num_iterations > 1 or reference is not None:
                    scored = score_sequences(
                        model, reference, sequences, cfg, pad_id, device, sink.should_stop
                    )
                updated = update_policy(
                    model,
                    optimizer,
                    scheduler,
                    sequences,
                    normalizer,
                    cfg,
                    pad_id,
                    device,
                    with_reference=reference is not None,
                    scorer=scorer,
                    should_stop=sink.should_stop,
                )
            except StepStopped as stopped:
                return stop_inside(step, stopped.where, stopped.updates, start)
            train_seconds = time.monotonic() - train_started
            step_seconds = time.monotonic() - step_started

            # 6. Log: rollout statistics under the eval names, then the optimization's.
            metrics = summary_metrics(summarize(env, rollouts, rollout_seconds))
            outcome_labels.update(r.outcome for r in rollouts if r.outcome is not None)
            for label in outcome_labels:
                metrics.setdefault(f"outcome/{label}", 0.0)
            groups = rewards.view(-1, cfg.rollouts_per_example)
            metrics.update(scored)
            metrics.update(updated)
            metrics.update(
                {
                    "advantage/zero_group_rate": float((groups.std(dim=1) == 0).float().mean()),
                    "advantage/abs_mean": float(flat_advantages.abs().mean()),
                    "advantage/zero_turn_rate": float((flat_advantages == 0).float().mean()),
                    **(
                        {"reward/turn_mean": turn_reward_mean}
                        if turn_reward_mean is not None
                        else {}
                    ),
                    # Tokens through the trainer (prompts included) per second of the step.
                    "perf/tokens_per_s": sum(len(s.input_ids) for s in sequences) / step_seconds,
                    "perf/step_seconds": step_seconds,
                    "perf/rollout_seconds": rollout_seconds,
                    "perf/train_seconds": train_seconds,
                }
            )
            if cfg.curriculum_steps:
                metrics["curriculum/groups"] = float(len(unlocked))
            sink.metric(step, metrics)
            if cfg.log_rollouts:
                sink.rollouts(
                    step, rollout_sample(rollouts, cfg.rollouts_per_example, cfg.log_rollouts)
                )
            errors = [r.error for r in rollouts if r.error]
            if errors:
                sink.log(
                    f"rl: {len(errors)} rollouts failed at step {step}: {errors[0]}", "warning"
                )
            sink.progress(step, cfg.max_steps, "rl")
            if cfg.save_every and step % cfg.save_every == 0 and step < cfg.max_steps:
                checkpoint(step, checkpoint_dir(output_dir, step))
    finally:
        loop.run_until_complete(engine.aclose())
        loop.close()

    path = checkpoint(cfg.max_steps, output_dir / "final")
    sink.log(f"rl: final checkpoint {path}")
    return path
