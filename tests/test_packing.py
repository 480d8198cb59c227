"""Training micro-batches pack several sequences into each row: every sequence must come out
as it would alone (its logprobs, its share of the loss and of the gradient), whatever the
sequences packed beside it, and the packing must use few rows."""

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlcore.train.config import LossConfig
from rlcore.train.grpo import packed_logprobs, policy_loss, token_logprobs
from rlcore.train.sequences import TrainingSequence, pack

PAD = 0


def random_sequences(count: int, seed: int = 0, vocabulary: int = 200) -> list[TrainingSequence]:
    """Sequences of 3-40 tokens, the second half of each trained with an advantage of +-1."""
    draw = random.Random(seed)
    sequences = []
    for index in range(count):
        length = draw.randint(3, 40)
        ids = [draw.randrange(3, vocabulary) for _ in range(length)]
        weights = [float(position >= length // 2) for position in range(length)]
        sign = 1.0 if index % 2 else -1.0
        logprobs = [-draw.random() for _ in range(length)]
        sequences.append(TrainingSequence(ids, weights, [sign * w for w in weights], logprobs))
    return sequences


def alone(model, sequence: TrainingSequence) -> torch.Tensor:
    """The sequence's logprobs run on its own: no padding, no neighbour."""
    ids = torch.tensor([sequence.input_ids])
    logprobs, _ = token_logprobs(model, ids, torch.ones_like(ids), 1.0)
    return logprobs[0]


@pytest.fixture(scope="module")
def model(tiny_model):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model).eval()


def test_rows_hold_several_sequences_and_never_overflow():
    sequences = random_sequences(60)
    batches = pack(sequences, rows_per_batch=4, pad_id=PAD, device="cpu", share_rows=True)
    width = max(len(s.input_ids) for s in sequences)
    total = sum(len(s.input_ids) for s in sequences)
    rows = sum(batch.input_ids.shape[0] for batch in batches)
    assert all(batch.input_ids.shape[1] == width for batch in batches)  # one shape
    assert all(batch.input_ids.shape[0] <= 4 for batch in batches)
    assert rows <= -(-total // width) + 2  # best fit: within two rows of the bound
    assert rows < 0.6 * len(sequences)  # a padded batch uses a row per sequence
    packed = [s for batch in batches for s in batch.sequences]
    assert sorted(map(id, packed)) == sorted(map(id, sequences))  # each one, once
    for batch in batches:
        used = (batch.segments == batch.segments[:, -1:]).logical_not().sum(-1)
        assert (used <= width).all()


def test_packed_logprobs_are_each_sequences_own(model):
    sequences = random_sequences(24, seed=1)
    (batch,) = pack(sequences, rows_per_batch=24, pad_id=PAD, device="cpu", share_rows=True)
    assert batch.input_ids.shape[0] < len(sequences)
    with torch.no_grad():
        packed, entropy = packed_logprobs(model, batch, 1.0, with_entropy=True)
        for sequence, own in zip(batch.sequences, batch.take(packed), strict=True):
            torch.testing.assert_close(own, alone(model, sequence), atol=2e-5, rtol=1e-5)
    assert entropy.shape == packed.shape
    # Targets between sequences (the first token of the next, predicted from the end of
    # the last) and the padding block carry no weight and no advantage.
    trained = sum(sum(w > 0 for w in s.weights[1:]) for s in sequences)
    assert int((batch.weights > 0).sum()) == trained
    assert float(batch.advantages.abs().sum()) == trained


def test_eager_attention_takes_the_additive_mask_and_agrees(tiny_model, model):
    eager = AutoModelForCausalLM.from_pretrained(tiny_model, attn_implementation="eager").eval()
    sequences = random_sequences(10, seed=2)
    (batch,) = pack(sequences, rows_per_batch=10, pad_id=PAD, device="cpu", share_rows=True)
    assert batch.attention_mask(eager).dtype == torch.float32
    assert batch.attention_mask(model).dtype == torch.bool
    with torch.no_grad():
        sdpa, _ = packed_logprobs(model, batch, 1.0)
        additive, _ = packed_logprobs(eager, batch, 1.0)
    weights = batch.weights > 0
    torch.testing.assert_close(additive[weights], sdpa[weights], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("share_rows", [True, False])
@pytest.mark.parametrize("rows_per_batch", [1, 3, 100])
def test_the_packed_loss_and_gradient_are_the_sum_over_sequences_alone(
    model, rows_per_batch, share_rows
):
    sequences = random_sequences(16, seed=3)
    loss_config = LossConfig(beta=0.0)
    normalizer = 50.0

    def gradient(losses) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        total = sum(losses)
        total.backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()]), float(total.detach())

    packed_grad, packed_loss = gradient(
        policy_loss(
            logprobs,
            logprobs.detach(),
            None,
            batch.advantages,
            batch.weights,
            loss_config,
            normalizer,
        )[0]
        for batch in pack(sequences, rows_per_batch, PAD, "cpu", share_rows)
        for logprobs in [packed_logprobs(model, batch, 1.0)[0]]
    )
    one_by_one = []
    for sequence in sequences:
        logprobs = alone(model, sequence)[None]
        weights = torch.tensor([sequence.weights[1:]])
        advantages = torch.tensor([sequence.advantages[1:]])
        one_by_one.append(
            policy_loss(
                logprobs, logprobs.detach(), None, advantages, weights, loss_config, normalizer
            )[0]
        )
    own_grad, own_loss = gradient(one_by_one)
    assert packed_loss == pytest.approx(own_loss, abs=1e-5)
    assert packed_grad.abs().max() > 0
    torch.testing.assert_close(packed_grad, own_grad, atol=1e-6, rtol=1e-4)


def test_on_the_cpu_each_sequence_is_a_row_of_its_own_sorted_by_length():
    sequences = random_sequences(10, seed=5)
    batches = pack(sequences, rows_per_batch=4, pad_id=PAD, device="cpu")
    assert [b.input_ids.shape[0] for b in batches] == [4, 4, 2]
    lengths = [len(s.input_ids) for b in batches for s in b.sequences]
    assert lengths == sorted(len(s.input_ids) for s in sequences)
    for batch in batches:  # as wide as its longest, a padding mask, no position ids
        assert batch.input_ids.shape[1] == len(batch.sequences[-1].input_ids)
        mask = batch.attention_mask(None)
        assert mask.shape == batch.input_ids.shape
        assert mask.sum(-1).tolist() == [len(s.input_ids) for s in batch.sequences]


def test_place_and_take_are_inverse():
    sequences = random_sequences(9, seed=4)
    (batch,) = pack(sequences, rows_per_batch=9, pad_id=PAD, device="cpu", share_rows=True)
    values = [torch.randn(len(s.input_ids) - 1) for s in batch.sequences]
    placed = batch.place(values)
    for value, back in zip(values, batch.take(placed), strict=True):
        assert torch.equal(value, back)
    assert int((placed != 0).sum()) == sum(v.numel() for v in values)
    flags = [float(index % 2) for index in range(len(batch.sequences))]
    for flag, back in zip(flags, batch.take(batch.spread(flags)), strict=True):
        assert back.numel() > 0 and (back == flag).all()
