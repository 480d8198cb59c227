"""The update's pass over token trees (`sequences.tree_batches`, `sequences.forest_batches`,
`sequences.token_tree`, `grpo.pass_batches`, on the CPU): which sequences share a tree, the
trie's nodes, positions and mask, and the same logprobs, entropy, judged-move mass and
gradients as the plain pass."""

import random

import pytest
import torch

from rlcore.train.common import load_model_and_tokenizer
from rlcore.train.grpo import Learner, attention_keys_per_token, pass_batches, token_logprobs
from rlcore.train.sequences import (
    TrainingSequence,
    collate,
    forest_batches,
    move_set_rows,
    token_tree,
    trained_targets,
    tree_batches,
)

SYSTEM = list(range(10, 40))  # every row's system prompt


def sequence(ids, trained_from, move_at=None):
    weights = [0.0] * trained_from + [1.0] * (len(ids) - trained_from)
    return TrainingSequence(
        input_ids=list(ids),
        weights=weights,
        advantages=[0.5 * weight for weight in weights],
        sampled_logprobs=None,
        move_sets=[] if move_at is None else [(move_at, [5, 6, 7])],
    )


def groups(rng, count=3, size=5, board=20):
    """`count` groups of `size` rollouts: the system prompt, the group's board, then games
    that share their first moves now and then (a branching game tree), trained from the
    first reply on, with a judged move in each."""
    rows = []
    for _ in range(count):
        prompt = SYSTEM + [rng.randrange(40, 400) for _ in range(board)]
        games = [prompt]
        for _ in range(size):
            game = list(rng.choice(games))
            for _ in range(rng.randrange(1, 4)):  # a few moves of one to nine tokens each
                game += [rng.randrange(40, 400) for _ in range(rng.randrange(1, 10))]
            games.append(game)
            rows.append(sequence(game, len(prompt), move_at=len(prompt) - 1))
    rng.shuffle(rows)
    return rows


def prefixes(chunk) -> int:
    return len({tuple(s.input_ids[:n]) for s in chunk for n in range(1, len(s.input_ids) + 1)})


def test_the_trie_holds_each_prefix_once_at_its_depth_attending_its_ancestors():
    rows = groups(random.Random(0), count=2)
    rows.append(sequence(rows[0].input_ids, 40))  # a repeat
    rows.append(sequence(rows[1].input_ids[:-3], 40))  # a prefix of another row
    tree = token_tree(rows, "cpu")
    tokens, positions = tree.input_ids[0].tolist(), tree.positions[0].tolist()
    assert len(tokens) == prefixes(rows)
    width = max(len(s.input_ids) for s in rows)
    assert tree.nodes.shape == (len(rows), width - 1)
    # Each row's targets read the nodes of its own prefixes: its tokens at their positions.
    prefix_of = {}
    for row, s in enumerate(rows):
        for t in range(len(s.input_ids) - 1):
            node = int(tree.nodes[row, t])
            assert (tokens[node], positions[node]) == (s.input_ids[t], t)
            assert prefix_of.setdefault(node, tuple(s.input_ids[: t + 1])) == tuple(
                s.input_ids[: t + 1]
            )
    # Node i attends node j exactly when j's prefix is a prefix of i's.
    mask = tree.mask[0, 0]
    assert mask.shape == (len(tokens), len(tokens))
    for i, mine in prefix_of.items():
        for j, theirs in prefix_of.items():
            assert bool(mask[i, j]) == (mine[: len(theirs)] == theirs), (i, j)


def test_groups_share_a_tree_and_lone_sequences_a_plain_micro_batch():
    rng = random.Random(1)
    rows = groups(rng, count=3, size=4)
    lone = [sequence([rng.randrange(40, 400) for _ in range(30)], 5) for _ in range(5)]
    planned = tree_batches(rows + lone, 4, keys_per_token=1000.0)
    seen = [id(s) for chunk, _ in planned for s in chunk]
    assert sorted(seen) == sorted(map(id, rows + lone))  # every sequence once
    assert all(len(chunk) <= 4 for chunk, _ in planned)
    # Each group is one tree (its 50-token prompt shared), the rest plain micro-batches.
    trees = [chunk for chunk, as_tree in planned if as_tree]
    assert sorted(len({tuple(s.input_ids[:50]) for s in chunk}) for chunk in trees) == [1, 1, 1]
    assert sorted(len(chunk) for chunk in trees) == [4, 4, 4]
    assert [len(chunk) for chunk, as_tree in planned if not as_tree] == [4, 1]
    # Groups larger than a run: still trees of two or more, never a sequence alone.
    larger = groups(rng, count=2, size=7)
    assert all(as_tree and len(chunk) >= 2 for chunk, as_tree in tree_batches(larger, 4, 1000.0))


@pytest.mark.parametrize("multiple", [1, 64])
def test_the_tree_pass_matches_the_plain_pass_and_its_gradient(multiple):
    """Also laid out as on a GPU (`multiple` 64): the batch's width and the tree's nodes
    padded to a multiple of 64, padding nodes attending themselves alone, nothing reading
    them."""
    model, _ = load_model_and_tokenizer("tiny-master", torch.device("cpu"))
    rows = groups(random.Random(3))
    rows.append(sequence(rows[0].input_ids, 50, move_at=49))  # a repeated game
    input_ids, _, weights, advantages = collate(rows, 0, "cpu", multiple)
    assert input_ids.shape[1] % multiple == 0
    move_sets = move_set_rows(rows, "cpu")
    tree = token_tree(rows, "cpu", multiple)
    assert tree.nodes.shape == (len(rows), input_ids.shape[1] - 1)
    nodes = tree.input_ids.shape[1]
    assert nodes % multiple == 0 and nodes < 0.7 * sum(len(s.input_ids) for s in rows)
    if multiple > 1:
        unpadded = token_tree(rows, "cpu").input_ids.shape[1]
        assert unpadded < nodes < unpadded + multiple
        padding = torch.arange(unpadded, nodes)
        assert tree.mask[0, 0, padding].sum(-1).tolist() == [1] * len(padding)
        assert tree.mask[0, 0, :, padding].sum(0).tolist() == [1] * len(padding)
    results, trained = [], trained_targets(rows, input_ids.shape[1], "cpu")
    for shared in (None, tree):
        model.zero_grad(set_to_none=True)
        logprobs, entropy, best = token_logprobs(model, input_ids, 0.8, True, move_sets, shared)
        loss = -(logprobs * advantages * weights).sum() - best.sum() + (entropy * weights).sum()
        loss.backward()
        gradient = torch.cat([p.grad.flatten() for p in model.parameters()])
        # The trainer's pass: the head at the trained targets only, read through the nodes.
        at_trained, _, _ = token_logprobs(model, input_ids, 0.8, False, None, shared, trained)
        results.append(
            (logprobs.detach(), entropy.detach(), best.detach(), gradient, at_trained.detach())
        )
    (plain_lp, plain_ent, plain_best, plain_grad, plain_head), (lp, ent, best, grad, head) = results
    assert head.shape == lp.shape and (head[weights > 0] != 0).all()
    torch.testing.assert_close(head[weights > 0], plain_head[weights > 0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(head[weights > 0], plain_lp[weights > 0], rtol=1e-4, atol=1e-4)
    assert lp.shape == plain_lp.shape == (len(rows), input_ids.shape[1] - 1)
    real = torch.tensor([[t < len(s.input_ids) - 1 for t in range(lp.shape[1])] for s in rows])
    torch.testing.assert_close(lp[real], plain_lp[real], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ent[real], plain_ent[real], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(best, plain_best, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(grad, plain_grad, rtol=1e-3, atol=1e-3)
    assert grad.abs().sum() > 0


def test_forest_batches_cut_runs_in_token_order_and_trees_within_the_bound():
    """The GPU's passes: every sequence once; runs of `size` in token order (groups side by
    side), each a tree where its trie fits `max_nodes`, the rest plain micro-batches."""
    rng = random.Random(5)
    rows = groups(rng, count=3, size=4)
    lone = [sequence([rng.randrange(40, 400) for _ in range(30)], 5) for _ in range(5)]
    everything = rows + lone
    planned = forest_batches(everything, 8, max_nodes=10_000)
    assert sorted(id(s) for run, _ in planned for s in run) == sorted(map(id, everything))
    assert [(len(run), as_tree) for run, as_tree in planned] == [(8, True), (8, True), (1, True)]
    # In token order: the groups' rows (their prompts start with SYSTEM) come first.
    assert all(s in rows for s in planned[0][0]) and all(s in lone for s in planned[2][0])
    ordered = sorted(everything, key=lambda s: s.input_ids)
    runs = [ordered[start : start + 8] for start in range(0, len(ordered), 8)]
    for max_nodes in (10_000, 300, 100):
        planned = forest_batches(everything, 8, max_nodes)
        assert sorted(id(s) for run, _ in planned for s in run) == sorted(map(id, everything))
        assert all(len(run) <= 8 for run, _ in planned)
        # The trees: exactly the token-order runs whose trie fits the bound.
        fitting = [run for run in runs if token_tree(run, "cpu").input_ids.shape[1] <= max_nodes]
        assert [run for run, as_tree in planned if as_tree] == fitting
    # Within 100 nodes only the last run fits (one 30-token sequence); the others' sequences
    # run as plain micro-batches of similar length, no more than 8 a pass.
    planned = forest_batches(everything, 8, 100)
    assert sorted((len(run), as_tree) for run, as_tree in planned) == [
        (1, True),
        (8, False),
        (8, False),
    ]


def learner_on(device, attention="sdpa"):
    model, tokenizer = load_model_and_tokenizer("tiny-master", torch.device("cpu"))
    model.config._attn_implementation = attention
    return Learner(model, None, None, None, tokenizer.pad_token_id, torch.device(device), bool)


@pytest.mark.parametrize(
    ("device", "attention", "trees"),
    [("meta", "sdpa", True), ("cpu", "eager", True), ("cpu", "sdpa", False)],
)
def test_plain_passes_off_the_cpu_and_gpu_for_other_attention_or_without_trees(
    device, attention, trees
):
    """Trees need SDPA's boolean mask, and the compiled pass (trees=False) runs plain."""
    rows = groups(random.Random(4))
    assert any(tree is not None for _, tree in pass_batches(learner_on("cpu"), rows, 16))
    passes = pass_batches(learner_on(device, attention), rows, 16, trees)
    assert all(tree is None for _, tree in passes)
    assert sorted(len(chunk) for chunk, _ in passes) == [15]


def test_keys_per_token_of_the_tiny_model():
    model, _ = load_model_and_tokenizer("tiny-master", torch.device("cpu"))
    parameters = sum(p.numel() for p in model.parameters())
    assert attention_keys_per_token(model) == parameters / (2 * 128 * 4)
    assert 900 < attention_keys_per_token(model) < 1200
