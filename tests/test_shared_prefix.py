"""The update's pass with a group's shared opening run once (`sequences.shared_prefix`,
`grpo.shared_prefix_logits`, on the CPU): which opening is chosen, and the same logprobs,
entropy, judged-move mass and gradients as the full pass wherever a weight or a judged move
reads them."""

import random

import torch

from rlcore.train.common import load_model_and_tokenizer
from rlcore.train.grpo import openings_once, token_logprobs
from rlcore.train.sequences import TrainingSequence, collate, move_set_rows, shared_prefix

SYSTEM = list(range(10, 40))  # every row's system prompt


def sequence(opening, rest, trained_from, move_at=None):
    ids = opening + rest
    weights = [0.0] * trained_from + [1.0] * (len(ids) - trained_from)
    return TrainingSequence(
        input_ids=ids,
        weights=weights,
        advantages=[0.5 * weight for weight in weights],
        sampled_logprobs=None,
        move_sets=[] if move_at is None else [(move_at, [5, 6, 7])],
    )


def groups(rng, count=3, size=5, board=20):
    """`count` groups of `size` rollouts: the system prompt, the group's board, then replies
    that differ from the first token on, trained from the second."""
    rows = []
    for _ in range(count):
        prompt = SYSTEM + [rng.randrange(40, 400) for _ in range(board)]
        for _ in range(size):
            rest = [rng.randrange(40, 400) for _ in range(rng.randrange(8, 40))]
            rows.append(sequence(prompt, rest, len(prompt) + 1, move_at=len(prompt) + 2))
    rng.shuffle(rows)
    return rows


def test_the_groups_prompt_is_run_once_per_group():
    rows = groups(random.Random(0))
    prefix = shared_prefix(rows, "cpu")
    # The board's end (50 tokens: 3 groups of 5 skip 12 x 50), not the system prompt's
    # (30 tokens shared by all 15: 14 x 30) nor the first reply token (rows differ there).
    assert prefix.length == len(SYSTEM) + 20
    openings = [tuple(rows[int(head)].input_ids[: prefix.length]) for head in prefix.heads]
    assert len(set(openings)) == 3
    for row, group in zip(rows, prefix.groups.tolist(), strict=True):
        assert tuple(row.input_ids[: prefix.length]) == openings[group]
    assert openings_once([rows], torch.device("cpu"))[0].length == prefix.length
    assert openings_once([rows], torch.device("meta")) == [None]  # GPUs keep the full pass


def test_the_opening_stops_before_anything_trained_or_judged():
    rng = random.Random(1)
    prompt = SYSTEM + [rng.randrange(40, 400) for _ in range(20)]
    rows = [sequence(prompt, [rng.randrange(40, 400) for _ in range(9)], 50) for _ in range(4)]
    assert shared_prefix(rows, "cpu").length == 50
    rows[2].weights[44] = 1.0  # a weighted token inside the prompt
    assert shared_prefix(rows, "cpu").length == 44
    rows[3].move_sets = [(40, [5])]  # a judged move whose next token is token 41
    assert shared_prefix(rows, "cpu").length == 41


def test_nothing_shared_means_no_opening():
    rng = random.Random(2)
    distinct = [
        sequence([rng.randrange(40, 400) for _ in range(30)], [7, 8, 9], 30) for _ in range(4)
    ]
    assert shared_prefix(distinct, "cpu") is None
    one_token = [sequence([3], [rng.randrange(40, 400) for _ in range(5)], 1) for _ in range(4)]
    assert shared_prefix(one_token, "cpu") is None


def test_the_split_pass_matches_the_full_pass_and_its_gradient():
    model, _ = load_model_and_tokenizer("tiny-master", torch.device("cpu"))
    rows = groups(random.Random(3))
    # A row that ends right after the opening's next token: its rest is one token.
    rows.append(sequence(rows[0].input_ids[:52], [], 51))
    input_ids, _, weights, advantages = collate(rows, 0, "cpu")
    move_sets = move_set_rows(rows, "cpu")
    prefix = shared_prefix(rows, "cpu")
    assert prefix is not None and len(prefix.heads) == 3
    results = []
    for opening in (None, prefix):
        model.zero_grad(set_to_none=True)
        logprobs, entropy, best = token_logprobs(model, input_ids, 0.8, True, move_sets, opening)
        loss = -(logprobs * advantages * weights).sum() - best.sum() + (entropy * weights).sum()
        loss.backward()
        gradient = torch.cat([p.grad.flatten() for p in model.parameters()])
        results.append((logprobs.detach(), entropy.detach(), best.detach(), gradient))
    (full_lp, full_ent, full_best, full_grad), (lp, ent, best, grad) = results
    assert lp.shape == full_lp.shape == (len(rows), input_ids.shape[1] - 1)
    read = slice(prefix.length - 1, None)  # the positions a weight or judged move can read
    torch.testing.assert_close(lp[:, read], full_lp[:, read], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ent[:, read], full_ent[:, read], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(best, full_best, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(grad, full_grad, rtol=1e-3, atol=1e-3)
    assert not lp[:, : prefix.length - 1].any()  # the opening's own positions: 0
    assert (weights[:, : prefix.length - 1] == 0).all()


def test_a_batch_whose_rows_end_with_the_opening():
    model, _ = load_model_and_tokenizer("tiny-master", torch.device("cpu"))
    prompt = SYSTEM + [50, 51, 52]
    rows = [sequence(prompt, [60 + n], len(prompt)) for n in range(3)]
    input_ids, _, weights, _ = collate(rows, 0, "cpu")
    prefix = shared_prefix(rows, "cpu")
    assert prefix.length == input_ids.shape[1] - 1  # nothing runs after the opening
    with torch.no_grad():
        split, _, _ = token_logprobs(model, input_ids, 1.0, prefix=prefix)
        full, _, _ = token_logprobs(model, input_ids, 1.0)
    torch.testing.assert_close(split[:, -1], full[:, -1], rtol=1e-5, atol=1e-5)
