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

import bisect
from dataclasses import dataclass

import torch

from rlcore.types import Rollout

# Training batches on a GPU are padded to a multiple of this many tokens (see `pack`):
# every new batch shape pays once for its kernels' set-up (attention plans, allocator blocks).
GPU_WIDTH_STEP = 64


@dataclass
class TrainingSequence:
    """One training sequence and, per token, what the loss does with it."""

    input_ids: list[int]
    weights: list[float]  # per token: its weight in the loss's sum (0: not trained)
    advantages: list[float]  # per token: its turn's advantage (0 where not trained)
    sampled_logprobs: list[float] | None  # at generation time, per token (0 off completions)
    turns: int = 1  # assistant turns trained in this sequence
    old_logprobs: torch.Tensor | None = None  # [len - 1], from the no-grad pass
    ref_logprobs: torch.Tensor | None = None

    @property
    def trained_tokens(self) -> int:
        return sum(weight > 0 for weight in self.weights)


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
        for turn, skipped, trained in runs:
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


@dataclass
class PackedBatch:
    """A micro-batch of training sequences laid out in rows. Packed (`shared`), a row holds
    several sequences end to end, each attending only to itself (a block-causal mask) at
    positions counted from 0, and ends with a padding block; otherwise each row is one
    sequence, right-padded. Per-target tensors ([rows, width - 1], target t predicts token
    t + 1) hold each sequence's values at its own place and 0 elsewhere: no loss ever
    crosses from one sequence into the next."""

    shared: bool
    sequences: list[TrainingSequence]
    input_ids: torch.Tensor  # [rows, width]
    position_ids: torch.Tensor  # [rows, width]
    segments: torch.Tensor  # [rows, width]: which block of its row a token belongs to
    weights: torch.Tensor  # [rows, width - 1]
    advantages: torch.Tensor  # [rows, width - 1]
    target_index: torch.Tensor  # flat target positions, sequence after sequence
    target_lengths: list[int]  # targets per sequence (its length - 1)

    def place(self, values: list) -> torch.Tensor:
        """Per-sequence target values (lists or tensors of length - 1 each) at their places
        in a [rows, width - 1] tensor on the batch's device, 0 elsewhere."""
        flat = torch.cat([torch.as_tensor(v, dtype=torch.float32).reshape(-1) for v in values])
        rows, width = self.weights.shape
        out = torch.zeros(rows * width, dtype=torch.float32, device=self.target_index.device)
        out[self.target_index] = to_device(flat, out.device)
        return out.view(rows, width)

    def spread(self, values: list[float]) -> torch.Tensor:
        """One value per sequence over all of its targets, as `place` puts them."""
        lengths = torch.tensor(self.target_lengths)
        flat = torch.repeat_interleave(torch.tensor(values, dtype=torch.float32), lengths)
        return self.place([flat])

    def take(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Each sequence's own targets out of a [rows, width - 1] tensor."""
        return list(tensor.reshape(-1)[self.target_index].split(self.target_lengths))

    def attention_mask(self, model) -> torch.Tensor:
        """Unpacked rows: the padding mask ([rows, width], 1 on tokens). Packed: the
        block-causal mask in the form the model's attention takes, boolean (True: attend)
        for SDPA, additive (0 or the dtype's minimum) otherwise."""
        if not self.shared:
            return (self.segments == 0).long()
        width = self.segments.shape[1]
        causal = torch.ones(width, width, dtype=torch.bool, device=self.segments.device).tril()
        allowed = (self.segments[:, None, :, None] == self.segments[:, None, None, :]) & causal
        if getattr(model.config, "_attn_implementation", "sdpa") == "sdpa":
            return allowed
        dtype = next(model.parameters()).dtype
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
            ~allowed, torch.finfo(dtype).min
        )


def pack(
    sequences: list[TrainingSequence],
    rows_per_batch: int,
    pad_id: int,
    device,
    share_rows: bool = False,
) -> list[PackedBatch]:
    """`sequences` in micro-batches of `rows_per_batch` rows. Each sequence is a row of its
    own, rows sorted by length so little goes to padding; with `share_rows` they are
    packed into rows as wide as the longest of them (best fit, longest first): a pass
    holds no more tokens than a padded batch of that many sequences at its widest, every
    pass has the same shape, and a step whose lengths differ takes fewer passes (on a GPU
    each pays its kernel launches; on the CPU, where a pass costs what its tokens cost,
    the block mask only adds work). On a GPU widths are rounded up to a multiple of
    GPU_WIDTH_STEP."""
    if not sequences:
        return []
    multiple = GPU_WIDTH_STEP if torch.device(device).type == "cuda" else 1

    def rounded(tokens: int) -> int:
        return -(-tokens // multiple) * multiple

    width = max(len(s.input_ids) for s in sequences)
    if not share_rows:
        rows = [[s] for s in sorted(sequences, key=lambda s: len(s.input_ids))]
    else:
        rows = []
        room: list[tuple[int, int]] = []  # (free tokens, row), sorted: best fit is a bisect
        for sequence in sorted(sequences, key=lambda s: len(s.input_ids), reverse=True):
            size = len(sequence.input_ids)
            at = bisect.bisect_left(room, (size, -1))
            if at == len(room):
                rows.append([sequence])
                bisect.insort(room, (width - size, len(rows) - 1))
            else:
                free, row = room.pop(at)
                rows[row].append(sequence)
                bisect.insort(room, (free - size, row))
    chunks = [rows[start : start + rows_per_batch] for start in range(0, len(rows), rows_per_batch)]
    return [
        _packed(
            chunk,
            share_rows,
            # Packed, every pass of the step has one shape; else each is as wide as its
            # longest sequence.
            rounded(width if share_rows else len(chunk[-1][0].input_ids)),
            pad_id,
            device,
        )
        for chunk in chunks
    ]


def _packed(
    rows: list[list[TrainingSequence]], shared: bool, width: int, pad_id: int, device
) -> PackedBatch:
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    position_ids = torch.zeros((len(rows), width), dtype=torch.long)
    segments = torch.zeros((len(rows), width), dtype=torch.long)
    weights = torch.zeros((len(rows), width - 1))
    advantages = torch.zeros((len(rows), width - 1))
    sequences, index, lengths = [], [], []
    for row, members in enumerate(rows):
        start = 0
        for segment, sequence in enumerate(members):
            size = len(sequence.input_ids)
            end = start + size
            input_ids[row, start:end] = torch.tensor(sequence.input_ids)
            position_ids[row, start:end] = torch.arange(size)
            segments[row, start:end] = segment
            weights[row, start : end - 1] = torch.tensor(sequence.weights[1:])
            advantages[row, start : end - 1] = torch.tensor(sequence.advantages[1:])
            index.append(torch.arange(row * (width - 1) + start, row * (width - 1) + end - 1))
            lengths.append(size - 1)
            sequences.append(sequence)
            start = end
        # The rest of the row is a block of its own (padding, never a target).
        position_ids[row, start:] = torch.arange(width - start)
        segments[row, start:] = len(members)
    return PackedBatch(
        shared=shared,
        sequences=sequences,
        input_ids=to_device(input_ids, device),
        position_ids=to_device(position_ids, device),
        segments=to_device(segments, device),
        weights=to_device(weights, device),
        advantages=to_device(advantages, device),
        target_index=to_device(torch.cat(index), device),
        target_lengths=lengths,
    )


def to_device(tensor: torch.Tensor, device) -> torch.Tensor:
    """`tensor` on `device`. A copy from the CPU to a GPU goes through pinned memory, so it
    is queued behind the GPU's work instead of making the host wait for that work first."""
    if tensor.device.type == "cpu" and torch.device(device).type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)
