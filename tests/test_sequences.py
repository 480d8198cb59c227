"""Training sequences built a run of tokens at a time are the sequences defined token by
token: same ids, weights, advantages and logprobs, on random multi-turn rollouts whose
turns sometimes extend the sequence so far and sometimes do not."""

import random

import pytest

from rlcore.train.sequences import build_sequences, training_sequences
from rlcore.types import Rollout, Turn


def token_by_token(rollout, turn_advantages, aggregation, think_lengths=None):
    """The definition, one token at a time: (ids, weights, advantages, logprobs, turns)."""
    sequences = []
    for index, turn in enumerate(rollout.turns):
        if sequences and turn.prompt_ids[: len(sequences[-1]["ids"])] == sequences[-1]["ids"]:
            current = sequences[-1]
            new_prompt = turn.prompt_ids[len(current["ids"]) :]
        else:
            current = {"ids": [], "turn": [], "offset": [], "logprobs": []}
            sequences.append(current)
            new_prompt = turn.prompt_ids
        current["ids"] += new_prompt + turn.completion_ids
        current["turn"] += [-1] * len(new_prompt) + [index] * len(turn.completion_ids)
        current["offset"] += [-1] * len(new_prompt) + list(range(len(turn.completion_ids)))
        if current["logprobs"] is not None:
            current["logprobs"] += [0.0] * len(new_prompt) + (turn.logprobs or [])
            if turn.logprobs is None:
                current["logprobs"] = None
    result = []
    for current in sequences:
        trained = [
            t >= 0 and offset >= (think_lengths[t] if think_lengths else 0)
            for t, offset in zip(current["turn"], current["offset"], strict=True)
        ]
        sizes = {}
        for t, keep in zip(current["turn"], trained, strict=True):
            if keep:
                sizes[t] = sizes.get(t, 0) + 1

        def share(t, sizes=sizes):
            if aggregation == "sequence":
                return 1.0 / sum(sizes.values())
            return 1.0 / sizes[t] if aggregation == "turn" else 1.0

        pairs = list(zip(current["turn"], trained, strict=True))
        result.append(
            (
                current["ids"],
                [share(t) if keep else 0.0 for t, keep in pairs],
                [turn_advantages[t] if keep else 0.0 for t, keep in pairs],
                current["logprobs"],
                len(sizes),
                [int(t >= 0) for t in current["turn"]],
            )
        )
    return result


def random_rollout(rng: random.Random) -> Rollout:
    turns, history = [], []
    for _ in range(rng.randint(1, 6)):
        if rng.random() < 0.3:  # re-rendered history: a prompt that does not extend it
            history = [rng.randrange(50) for _ in range(rng.randint(0, 5))]
        prompt = history + [rng.randrange(50) for _ in range(rng.randint(0, 6))]
        completion = [rng.randrange(50) for _ in range(rng.randint(0, 8))]
        logprobs = None if rng.random() < 0.1 else [-rng.random() for _ in completion]
        turns.append(Turn(prompt_ids=prompt, completion_ids=completion, logprobs=logprobs))
        history = prompt + completion
    return Rollout(example_id=0, seed=0, group=0, messages=[], prompt_len=0, turns=turns)


@pytest.mark.parametrize("aggregation", ["token", "sequence", "turn"])
@pytest.mark.parametrize("with_think", [False, True])
def test_sequences_are_the_token_by_token_definition(aggregation, with_think):
    rng = random.Random(f"{aggregation}{with_think}")
    for _ in range(300):
        rollout = random_rollout(rng)
        advantages = [rng.choice([0.0, 0.5, -1.0]) for _ in rollout.turns]
        think = [rng.randint(0, 10) for _ in rollout.turns] if with_think else None
        built = training_sequences(rollout, advantages, aggregation, think_lengths=think)
        expected = token_by_token(rollout, advantages, aggregation, think)
        assert [
            (s.input_ids, s.weights, s.advantages, s.sampled_logprobs, s.turns) for s in built
        ] == [e[:5] for e in expected]
        assert build_sequences(rollout) == [(e[0], e[5]) for e in expected]


@pytest.mark.parametrize("seed", range(3))
def test_collate_is_the_row_by_row_padding_bit_for_bit(seed):
    """The micro-batch tensors from two host arrays are the ones built a tensor per row and
    padded: ids, mask, weights and advantages (targets start at the second token)."""
    import torch

    from rlcore.train.sequences import TrainingSequence, collate, target_rows

    rng = random.Random(seed)
    chunk = []
    for _ in range(rng.randint(1, 12)):
        n = rng.randint(1, 40)
        chunk.append(
            TrainingSequence(
                input_ids=[rng.randint(0, 500) for _ in range(n)],
                weights=[rng.choice([0.0, 1 / rng.randint(1, 9)]) for _ in range(n)],
                advantages=[rng.uniform(-3, 3) for _ in range(n)],
                sampled_logprobs=None,
            )
        )
    input_ids, mask, weights, advantages = collate(chunk, 7, "cpu")
    width = max(len(s.input_ids) for s in chunk)
    expected_ids = torch.tensor([s.input_ids + [7] * (width - len(s.input_ids)) for s in chunk])
    expected_mask = torch.tensor([[1] * len(s.input_ids) + [0] * (width - len(s.input_ids))
                                  for s in chunk])  # fmt: skip

    def rows(values):
        return torch.stack(
            [
                torch.nn.functional.pad(
                    torch.tensor(v[1:], dtype=torch.float32), (0, width - len(v))
                )
                for v in values
            ]
        )

    assert input_ids.dtype == mask.dtype == torch.long
    assert torch.equal(input_ids, expected_ids) and torch.equal(mask, expected_mask)
    assert weights.dtype == advantages.dtype == torch.float32
    assert torch.equal(weights, rows([s.weights for s in chunk]))
    assert torch.equal(advantages, rows([s.advantages for s in chunk]))
    assert torch.equal(target_rows([s.advantages for s in chunk], width - 1, "cpu"), advantages)
