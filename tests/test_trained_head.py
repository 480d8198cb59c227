"""The training pass with the head at the trained targets only (`grpo.token_logprobs` with
`trained`, `sequences.trained_targets`): the same logprobs, entropy, judged-move mass and
gradient as the full pass where the loss reads them, plain and over token trees, and the
full pass for a model whose logits are more than its head."""

import random

import torch

from rlcore.train.common import load_model_and_tokenizer
from rlcore.train.grpo import PLAIN_HEAD_ARCHITECTURES, token_logprobs
from rlcore.train.sequences import (
    TrainingSequence,
    collate,
    move_set_rows,
    token_tree,
    trained_targets,
)


def game(rng, prompt, replies=3):
    """A prompt, then turns of environment tokens and short trained replies, with a judged
    move at each reply's first token."""
    ids, weights, moves = list(prompt), [0.0] * len(prompt), []
    for _ in range(replies):
        board = [rng.randrange(40, 400) for _ in range(rng.randrange(5, 15))]
        reply = [rng.randrange(40, 400) for _ in range(rng.randrange(1, 4))]
        ids += board
        weights += [0.0] * len(board)
        moves.append((len(ids) - 1, [reply[0], rng.randrange(40, 400)]))
        ids += reply
        weights += [1.0] * len(reply)
    return TrainingSequence(
        input_ids=ids,
        weights=weights,
        advantages=[rng.choice([-1.0, 1.0]) * w for w in weights],
        sampled_logprobs=None,
        move_sets=moves,
    )


def batch(seed=0, rows=10):
    rng = random.Random(seed)
    prompts = [[rng.randrange(40, 400) for _ in range(30)] for _ in range(3)]
    return [game(rng, rng.choice(prompts)) for _ in range(rows)]


def test_trained_targets_are_the_weighed_targets_of_the_collated_batch():
    chunk = batch()
    input_ids, _, weights, _ = collate(chunk, 0, "cpu")
    trained = trained_targets(chunk, input_ids.shape[1], "cpu")
    assert trained.tolist() == torch.nonzero(weights.reshape(-1) > 0).flatten().tolist()
    # A wider collation (a GPU's widths come in steps of 64) moves each row's indices along.
    wide = trained_targets(chunk, input_ids.shape[1] + 64, "cpu")
    assert (wide // (input_ids.shape[1] + 63)).tolist() == (
        trained // (input_ids.shape[1] - 1)
    ).tolist()


def passes(model, chunk, tree):
    input_ids, _, weights, advantages = collate(chunk, 0, "cpu")
    move_sets = move_set_rows(chunk, "cpu")
    trained = trained_targets(chunk, input_ids.shape[1], "cpu")
    results = []
    for only in (None, trained):
        model.zero_grad(set_to_none=True)
        logprobs, entropy, best = token_logprobs(
            model, input_ids, 0.8, True, move_sets, tree, trained=only
        )
        loss = -(logprobs * advantages * weights).sum() - best.sum() + (entropy * weights).sum()
        loss.backward()
        gradient = torch.cat([p.grad.flatten() for p in model.parameters()])
        results.append((logprobs.detach(), entropy.detach(), best.detach(), gradient))
    return weights > 0, results


def test_the_head_at_the_trained_targets_matches_the_full_pass_plain_and_as_a_tree():
    model, _ = load_model_and_tokenizer("tiny-master", torch.device("cpu"))
    assert type(model).__name__ in PLAIN_HEAD_ARCHITECTURES
    chunk = batch()
    for tree in (None, token_tree(chunk, "cpu")):
        mask, ((lp, ent, best, grad), (lp_t, ent_t, best_t, grad_t)) = passes(model, chunk, tree)
        assert 0 < mask.sum() < 0.3 * mask.numel()
        torch.testing.assert_close(lp_t[mask], lp[mask], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent_t[mask], ent[mask], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(best_t, best, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grad_t, grad, rtol=1e-4, atol=1e-5)
        assert grad.abs().sum() > 0
        # Elsewhere nothing is computed: zeros, where the full pass has real values.
        assert not lp_t[~mask].any() and not ent_t[~mask].any()
        assert lp[~mask].abs().sum() > 0


class Scaled(torch.nn.Module):
    """A model whose logits are more than its head (here halved): not in the plain list."""

    def __init__(self, model):
        super().__init__()
        self.inner = model

    def forward(self, **kwargs):
        out = self.inner(**kwargs)
        out.logits = out.logits / 2
        return out


def test_a_model_whose_logits_are_more_than_its_head_keeps_the_full_pass():
    model, _ = load_model_and_tokenizer("tiny-master", torch.device("cpu"))
    chunk = batch(seed=1)
    mask, ((lp, _, best, _), (lp_t, _, best_t, _)) = passes(Scaled(model), chunk, None)
    torch.testing.assert_close(lp_t, lp)  # every target, the trained ones and the rest
    torch.testing.assert_close(best_t, best)
    assert lp_t[~mask].abs().sum() > 0
