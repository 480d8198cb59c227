"""From rollouts to training sequences: token ids straight from generation, and for every
token what the loss does with it.

A rollout's turns become one sequence (or several, when the chat template re-rendered the
history differently between turns) of prompt and completion tokens, the ids exactly as
the engine saw and sampled them, never re-tokenized text. `TrainingSequence.weights` is
the one per-token statement of what is trained: a token's weight in the loss's sum (0 for
prompt and environment tokens, and for a think block left out with `train_think` off),
from which the mask, the normalizer and the KL term all follow.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise

import numpy as np
import torch

from rlcore.train.common import padded_rows
from rlcore.types import Rollout

# Training batches on a GPU are padded to a multiple of this many tokens (see `collate`).
GPU_WIDTH_STEP = 64


@dataclass
class TrainingSequence:
    """One training sequence and, per token, what the loss does with it."""

    input_ids: list[int]
    weights: list[float]  # per token: its weight in the loss's sum (0: not trained)
    advantages: list[float]  # per token: its turn's advantage (0 where not trained)
    sampled_logprobs: list[float] | None  # at generation time, per token (0 off completions)
    turns: int = 1  # assistant turns trained in this sequence
    # Where each turn's completion starts in input_ids, by the turn's index in its rollout.
    turn_starts: dict[int, int] = field(default_factory=dict)
    # Judged moves (sound_mass.py): (the target index whose next token is the move, the
    # token ids of the moves the env judged best there).
    move_sets: list[tuple[int, list[int]]] = field(default_factory=list)
    old_logprobs: torch.Tensor | None = None  # [len - 1], from the no-grad pass
    ref_logprobs: torch.Tensor | None = None

    @property
    def trained_tokens(self) -> int:
        return sum(weight > 0 for weight in self.weights)

    @property
    def has_gradient(self) -> bool:
        """Whether the policy loss gets a gradient from it without a KL term: a nonzero
        advantage or a judged move (sound_mass.py)."""
        return bool(self.move_sets) or any(self.advantages)


def token_pieces(completion_ids: list[int], pieces: dict[int, str], tokenizer) -> list[str]:
    """The text of each token of a completion; `pieces` caches id -> text across calls."""
    for token in completion_ids:
        if token not in pieces:
            pieces[token] = tokenizer.decode([token])
    return [pieces[token] for token in completion_ids]


def think_length(completion_ids: list[int], pieces: dict[int, str], tokenizer) -> int:
    """How many leading tokens of a reply make up its think block, through `</think>`
    (0 when it has none). `pieces` caches each token id's text across calls."""
    text = ""
    for count, piece in enumerate(token_pieces(completion_ids, pieces, tokenizer), start=1):
        text += piece
        if "</think>" in text:
            return count
    return 0


# A run of a sequence's tokens: (the turn whose completion it is, or -1 for prompt and
# environment tokens, how many tokens).
Segment = tuple[int, int]
Assembled = tuple[list[int], list[float] | None, list[Segment]]


def _assemble(rollout: Rollout) -> list[Assembled]:
    """Each sequence's input ids and sampled logprobs, and its runs of tokens (`Segment`).

    Turn k+1 joins the current sequence when its prompt starts with that sequence (prompt
    and completion so far): only the new tokens, the env's reply and the next assistant
    header, are appended, then the completion. Otherwise turn k+1 starts a new sequence."""
    sequences: list[Assembled] = []
    for index, turn in enumerate(rollout.turns):
        if sequences and turn.prompt_ids[: len(sequences[-1][0])] == sequences[-1][0]:
            input_ids, logprobs, segments = sequences[-1]
            new_prompt = turn.prompt_ids[len(input_ids) :]
        else:
            input_ids, logprobs, segments = [], [], []
            sequences.append((input_ids, logprobs, segments))
            new_prompt = turn.prompt_ids
        input_ids.extend(new_prompt)
        input_ids.extend(turn.completion_ids)
        segments.append((-1, len(new_prompt)))
        segments.append((index, len(turn.completion_ids)))
        if logprobs is not None:
            logprobs.extend([0.0] * len(new_prompt))
            logprobs.extend(turn.logprobs or [])
            if turn.logprobs is None:
                sequences[-1] = (input_ids, None, segments)
    return sequences


def build_sequences(rollout: Rollout) -> list[tuple[list[int], list[int]]]:
    """(input_ids, loss_mask) of each sequence of a rollout: the mask is 1 exactly on the
    sampled completion tokens."""
    result = []
    for input_ids, _, segments in _assemble(rollout):
        mask: list[int] = []
        for turn, length in segments:
            mask += [int(turn >= 0)] * length
        result.append((input_ids, mask))
    return result


def training_sequences(
    rollout: Rollout,
    turn_advantages: list[float],
    aggregation: str,
    think_lengths: list[int] | None = None,
) -> list[TrainingSequence]:
    """The rollout's sequences with every completion token carrying its turn's advantage
    and its weight in the loss's sum: 1 (token aggregation), 1 / the sequence's trained
    tokens (sequence) or 1 / its turn's trained tokens (turn). With `think_lengths`, the
    first `think_lengths[t]` tokens of turn t (its think block) are not trained."""
    if len(turn_advantages) != len(rollout.turns):
        raise ValueError(
            f"{len(turn_advantages)} advantages for a rollout of {len(rollout.turns)} turns"
        )
    result = []
    for input_ids, logprobs, segments in _assemble(rollout):
        # Per completion run: its untrained think block, then its trained tokens. Lists
        # are built a run at a time: per token, this was most of a large step's scoring.
        runs = []
        sizes: dict[int, int] = {}
        for turn, length in segments:
            think = think_lengths[turn] if think_lengths and turn >= 0 else 0
            skipped = length if turn < 0 else min(length, max(think, 0))
            runs.append((turn, skipped, length - skipped))
            if length > skipped:
                sizes[turn] = sizes.get(turn, 0) + length - skipped
        weights: list[float] = []
        advantages: list[float] = []
        starts = {}
        for turn, skipped, trained in runs:
            if turn >= 0:
                starts[turn] = len(weights)
            weights += [0.0] * skipped
            advantages += [0.0] * skipped
            if trained:
                weights += [_share(aggregation, sizes, turn)] * trained
                advantages += [turn_advantages[turn]] * trained
        result.append(
            TrainingSequence(
                input_ids=input_ids,
                weights=weights,
                advantages=advantages,
                sampled_logprobs=logprobs,
                turns=len(sizes),
                turn_starts=starts,
            )
        )
    return result


def _share(aggregation: str, sizes: dict[int, int], turn: int) -> float:
    """A trained token's weight given how many trained tokens each turn has."""
    if aggregation == "sequence":
        return 1.0 / sum(sizes.values())
    if aggregation == "turn":
        return 1.0 / sizes[turn]
    return 1.0


def micro_batches(sequences: list[TrainingSequence], size: int) -> list[list[TrainingSequence]]:
    """Chunks of `size` sequences of similar length, so little compute goes to padding."""
    ordered = sorted(sequences, key=lambda s: len(s.input_ids))
    return [ordered[start : start + size] for start in range(0, len(ordered), size)]


def tree_batches(
    sequences: list[TrainingSequence], size: int, keys_per_token: float
) -> list[tuple[list[TrainingSequence], bool]]:
    """Micro-batches for passes over token trees (`token_tree`), each with whether it runs as
    one. The sequences in token order (a group's rollouts, which share their prompt, side by
    side) are cut into runs of at most `size` whose trees cost least in all, a tree of n nodes
    costing n (1 + n / keys_per_token): each node's pass through the weights, and its
    attention scores against every node (the mask is dense). A run of one sequence shares
    nothing: those are pooled into plain micro-batches of similar length (`micro_batches`)."""
    ordered, shared = token_order(sequences)
    lengths = [len(s.input_ids) for s in ordered]
    # cost[end]: the least cost of the first `end` sequences; start[end]: where its last run starts
    cost, start = [0.0] + [float("inf")] * len(ordered), [0] * (len(ordered) + 1)
    for end in range(1, len(ordered) + 1):
        nodes = 0
        for first in range(end - 1, max(end - size, 0) - 1, -1):
            # The run first..end-1: a new first sequence adds what it does not share with the
            # old first one (the sorted order's neighbours share the most).
            nodes += lengths[first] - (shared[first + 1] if first < end - 1 else 0)
            total = cost[first] + nodes * (1 + nodes / keys_per_token)
            if total < cost[end]:
                cost[end], start[end] = total, first
    runs, end = [], len(ordered)
    while end:
        runs.append(ordered[start[end] : end])
        end = start[end]
    alone = [run[0] for run in runs if len(run) == 1]
    return [(run, True) for run in reversed(runs) if len(run) > 1] + [
        (chunk, False) for chunk in micro_batches(alone, size)
    ]


def forest_batches(
    sequences: list[TrainingSequence], size: int, max_nodes: int
) -> list[tuple[list[TrainingSequence], bool]]:
    """Micro-batches for passes on a GPU, each with whether it runs as a token tree: there a
    pass costs about its kernel launches and its tokens, and attention over a dense mask of a
    few thousand nodes is cheap. The sequences in token order (a group's rollouts, which
    share their prompt, side by side) are cut into runs of `size`; a run whose trie holds at
    most `max_nodes` nodes is one tree (what it shares computed once, sequences that share
    nothing packed side by side, no padding), the others' sequences run in plain
    micro-batches of similar length (`micro_batches`), so there are never many more passes
    than plain micro-batches would make."""
    ordered, shared = token_order(sequences)
    planned, plain = [], []
    for start in range(0, len(ordered), size):
        run = ordered[start : start + size]
        # A run's first sequence is all new nodes; each next one adds what it does not share.
        nodes = sum(len(s.input_ids) for s in run) - sum(shared[start + 1 : start + len(run)])
        if nodes <= max_nodes:
            planned.append((run, True))
        else:
            plain += run
    return planned + [(chunk, False) for chunk in micro_batches(plain, size)]


def token_order(sequences: list[TrainingSequence]) -> tuple[list[TrainingSequence], list[int]]:
    """The sequences sorted by their tokens (those sharing prefixes side by side), and how
    many leading tokens each shares with the one before it (0 for the first)."""
    ordered = sorted(sequences, key=lambda s: s.input_ids)
    shared = [0] + [
        common_length(np.asarray(a.input_ids), np.asarray(b.input_ids))
        for a, b in pairwise(ordered)
    ]
    return ordered, shared


def common_length(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading tokens two id arrays share."""
    length = min(len(a), len(b))
    differ = np.flatnonzero(a[:length] != b[:length])
    return int(differ[0]) if len(differ) else length


@dataclass
class TokenTree:
    """A micro-batch's sequences as one trie of their tokens (`token_tree`): every prefix
    they share is one node, run once, at its depth's position, attending to itself and its
    ancestors (its prefix), so its keys, values and logits are the ones each sequence through
    it would compute alone."""

    input_ids: torch.Tensor  # [1, nodes]: each node's token
    positions: torch.Tensor  # [1, nodes]: its depth (its token's position in the sequences)
    mask: torch.Tensor  # [1, 1, nodes, nodes]: True where node i attends node j
    nodes: torch.Tensor  # [rows, width - 1]: the node whose logits predict each target


def width_step(device) -> int:
    """The multiple a training batch's width (and a token tree's nodes) is padded to on
    `device`: on a GPU every new batch shape pays once for its kernels' set-up (attention
    plans, allocator blocks), and widths in steps of GPU_WIDTH_STEP repeat from step to
    step; elsewhere 1."""
    return GPU_WIDTH_STEP if torch.device(device).type == "cuda" else 1


def token_tree(chunk: list[TrainingSequence], device, multiple: int | None = None) -> TokenTree:
    """The chunk's sequences as one trie (`TokenTree`), its targets as wide as `collate`
    makes them. Inserted in token order, the nodes come depth first: a node's subtree is the
    run of nodes after it, up to where the last sequence through it ends its new nodes
    (`ends`), so node i attends node j exactly when j <= i < ends[j]. A row's targets past
    its end read node 0 (their weight is 0). The nodes and the targets' width are padded to
    a multiple of `multiple` (None: `width_step(device)`), each padding node attending
    itself alone; the mask is built on `device` from `ends`, so only the nodes' three rows
    are copied there."""
    multiple = width_step(device) if multiple is None else multiple
    total = sum(len(s.input_ids) for s in chunk)
    width = -(-max(len(s.input_ids) for s in chunk) // multiple) * multiple
    tokens, depths, ends = (np.zeros(total, np.int64) for _ in range(3))
    nodes = np.zeros((len(chunk), width - 1), np.int64)
    count, previous, previous_path = 0, np.empty(0, np.int64), np.empty(0, np.int64)
    for row in sorted(range(len(chunk)), key=lambda row: chunk[row].input_ids):
        ids = np.asarray(chunk[row].input_ids, np.int64)
        shared = common_length(previous, ids)
        new = len(ids) - shared
        path = np.concatenate([previous_path[:shared], np.arange(count, count + new)])
        tokens[count : count + new] = ids[shared:]
        depths[count : count + new] = np.arange(shared, len(ids))
        count += new
        ends[path] = count
        nodes[row, : len(ids) - 1] = path[:-1]
        previous, previous_path = ids, path
    if count % multiple:
        padded_count = -(-count // multiple) * multiple
        tokens, depths = (np.pad(a[:count], (0, padded_count - count)) for a in (tokens, depths))
        ends = np.concatenate([ends[:count], np.arange(count, padded_count) + 1])
        count = padded_count
    table = to_device(
        torch.from_numpy(np.stack([tokens[:count], depths[:count], ends[:count]])), device
    )
    index = torch.arange(count, device=table.device)
    mask = (index[:, None] >= index[None, :]) & (index[:, None] < table[2][None, :])
    return TokenTree(
        table[0][None], table[1][None], mask[None, None], to_device(torch.from_numpy(nodes), device)
    )


def collate(
    chunk: list[TrainingSequence], pad_id: int, device, multiple: int | None = None
) -> tuple[torch.Tensor, ...]:
    """Right-padded input ids, attention mask (the trainer's causal passes need none:
    `grpo.token_logprobs`), and the per-target weights and advantages (the first token is
    never predicted, so they start at the second), the width padded to a multiple of
    `multiple` (None: `width_step(device)`). Built in two host arrays (ids with mask,
    weights with advantages), so two copies reach the device."""
    multiple = width_step(device) if multiple is None else multiple
    lengths = np.array([len(s.input_ids) for s in chunk])
    width = -(-int(lengths.max()) // multiple) * multiple
    tokens = np.stack(
        [
            padded_rows([s.input_ids for s in chunk], width, np.int64, pad_id),
            np.arange(width)[None] < lengths[:, None],
        ]
    )
    targets = np.stack(
        [
            padded_rows([s.weights for s in chunk], width - 1, np.float32, 0.0, skip=1),
            padded_rows([s.advantages for s in chunk], width - 1, np.float32, 0.0, skip=1),
        ]
    )
    input_ids, attention_mask = to_device(torch.from_numpy(tokens), device)
    weights, advantages = to_device(torch.from_numpy(targets), device)
    return input_ids, attention_mask, weights, advantages


def trained_targets(chunk: list[TrainingSequence], width: int, device) -> torch.Tensor:
    """The targets the loss reads (weight > 0) of a micro-batch collated `width` tokens wide,
    as flat indices into its [rows, width - 1] targets, in row-major order: where the
    training pass needs the vocabulary's logits (`grpo.token_logprobs`). Built on the host
    from the sequences' weights, so the pass never asks the device which targets they are."""
    found = [
        np.flatnonzero(np.asarray(s.weights[1:]) > 0) + row * (width - 1)
        for row, s in enumerate(chunk)
    ]
    return to_device(torch.from_numpy(np.concatenate(found).astype(np.int64)), device)


def target_rows(values: list[list[float]], width: int, device) -> torch.Tensor:
    """Per-token values of each sequence aligned with the targets, right-padded with 0."""
    rows = padded_rows(values, width, np.float32, 0.0, skip=1)
    return to_device(torch.from_numpy(rows), device)


def padded(tensors: list[torch.Tensor], width: int, device) -> torch.Tensor:
    rows = [torch.nn.functional.pad(t, (0, width - t.numel())) for t in tensors]
    return to_device(torch.stack(rows), device)


def to_device(tensor: torch.Tensor, device) -> torch.Tensor:
    """`tensor` on `device`. A copy from the CPU to a GPU goes through pinned memory, so it
    is queued behind the GPU's work instead of making the host wait for that work first."""
    if tensor.device.type == "cpu" and torch.device(device).type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def move_set_rows(chunk: list[TrainingSequence], device) -> tuple[torch.Tensor, ...] | None:
    """A micro-batch's judged moves (`TrainingSequence.move_sets`) as tensors: the row and
    target index of each, and its best moves' token ids right-padded with -1; None when
    the chunk has none."""
    found = [[row, at, *ids] for row, s in enumerate(chunk) for at, ids in s.move_sets]
    if not found:
        return None
    # One host array, one copy: row, target index, then the ids padded with -1.
    table = to_device(
        torch.from_numpy(padded_rows(found, max(map(len, found)), np.int64, -1)), device
    )
    return table[:, 0], table[:, 1], table[:, 2:]
