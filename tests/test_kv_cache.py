"""The local engine's KV caches: a conversation's next turn starts from the stored keys and
values of the turns before (same replies, same logprobs, a fraction of the prefill) in the
dynamic loop and in the static decoder (run eagerly here), the store forgets what the
weights no longer give and stays within its bytes, and the cache that grows in place
decodes exactly what `DynamicCache`'s copying one does."""

import asyncio

import numpy as np
import pytest
import torch

from rlcore.policy.kv_cache import PrefixCache, common_prefix
from rlcore.policy.local import LocalEngine
from rlcore.types import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
SAMPLED = SamplingParams(temperature=1.0, max_tokens=12, seed=7)


def engine(path, **options) -> LocalEngine:
    return LocalEngine(path, device="cpu", name="tiny", **options)


def history(turns: int, index: int = 0) -> list[dict]:
    """A conversation of `turns` user turns, the replies written as a model would have."""
    messages = [{"role": "system", "content": "Play tic-tac-toe. Reply with <move>N</move>."}]
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Game {index}, turn {turn}: X.O.X...."})
        if turn < turns - 1:
            messages.append({"role": "assistant", "content": f"<move>{(turn + index) % 9}</move>"})
    return messages


def run(policy, conversations, sampling=GREEDY):
    """Generate for every conversation at once; `sampling` for all, or one per conversation."""
    samplings = sampling if isinstance(sampling, list) else [sampling] * len(conversations)

    async def all_of_them():
        return await asyncio.gather(
            *(policy.generate(c, s) for c, s in zip(conversations, samplings, strict=True))
        )

    return asyncio.run(all_of_them())


def same_generations(left, right) -> None:
    for a, b in zip(left, right, strict=True):
        assert a.prompt_ids == b.prompt_ids
        assert a.completion_ids == b.completion_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


LOOPS = pytest.mark.parametrize("decode", ["dynamic", "static"])


@LOOPS
def test_later_turns_reuse_the_earlier_turns_and_answer_the_same(default_tiny_model, decode):
    cached = engine(default_tiny_model, decode=decode)
    plain = engine(default_tiny_model, decode=decode, prefix_cache_bytes=0)
    assert plain.prefix_cache is None
    for turns in (1, 2, 3):
        # Several conversations at once, of different lengths, so rows of one batch reuse
        # prefixes of different lengths (and one row may reuse nothing).
        conversations = [history(turns, index) for index in range(4)] + [history(1, 9)]
        for sampling in (GREEDY, SAMPLED):
            same_generations(
                run(cached, conversations, sampling), run(plain, conversations, sampling)
            )
    store = cached.prefix_cache
    assert store.hits > 0
    # Past the first batch every prompt starts with a stored one: most tokens are reused.
    assert store.tokens_reused > 0.5 * store.tokens_looked_up


@LOOPS
def test_a_retry_reuses_the_invalid_reply_it_follows(default_tiny_model, decode):
    policy = engine(default_tiny_model, decode=decode)
    first = run(policy, [history(1)])[0]
    retry = history(1) + [
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "Invalid move: cell taken. Try again."},
    ]
    before = policy.prefix_cache.tokens_reused
    run(policy, [retry])
    reused = policy.prefix_cache.tokens_reused - before
    # At least the first prompt comes back from the store (its reply too, where the chat
    # template renders it back to the same tokens).
    assert reused >= len(first.prompt_ids) - 1


@LOOPS
def test_changed_weights_empty_the_store(default_tiny_model, decode):
    policy = engine(default_tiny_model, decode=decode)
    run(policy, [history(2)])
    assert policy.prefix_cache.entries
    with torch.no_grad():
        next(policy.model.parameters()).add_(0.5)  # what an optimizer step does
    hits = policy.prefix_cache.hits
    after = run(policy, [history(2)])
    assert policy.prefix_cache.hits == hits  # nothing stored under the old weights was used
    fresh = engine(default_tiny_model, decode=decode, prefix_cache_bytes=0)
    fresh.model.load_state_dict(policy.model.state_dict())
    same_generations(after, run(fresh, [history(2)]))


def test_the_store_keeps_within_its_bytes_and_drops_superseded_turns():
    store = PrefixCache(max_bytes=3 * 4 * 2 * 40)  # room for three 40-token entries

    def kv(length):
        return [(torch.zeros(1, length, 1), torch.zeros(1, length, 1))]

    turn = list(range(40))
    store.add(turn, kv(40))
    store.add(turn + [5] * 8, kv(48))  # the same conversation, one turn later
    assert len(store.entries) == 1  # the earlier turn is part of the later one
    entry, reused = store.lookup(turn + [5, 5, 7])
    assert reused == 42 and len(entry.tokens) == 48  # found by its blocks, compared past them
    for start in (100, 200, 300):
        store.add(list(range(start, start + 40)), kv(40))
    assert store.bytes <= store.max_bytes
    assert store.lookup(turn + [1])[1] == 0  # the oldest went first
    assert store.lookup(list(range(300, 340)))[1] == 39  # never the prompt's last token
    assert store.lookup(list(range(300, 310)))[1] == 0  # shorter than a block: not looked for
    assert store.lookup([7] + list(range(301, 340)))[1] == 0  # differs in the first block


def test_the_growing_cache_decodes_what_the_copying_one_does(default_tiny_model):
    growing = engine(default_tiny_model, prefix_cache_bytes=0)
    copying = engine(default_tiny_model, prefix_cache_bytes=0)
    copying._plain_layers = False  # DynamicCache's own layers, concatenating every token
    # Rows finishing at different lengths make the loop drop rows from the cache on the way
    # (and, with the prefix store on, store the dropped ones).
    conversations = [history(1 + index % 3, index) for index in range(20)]
    lengths = [SamplingParams(temperature=1.0, max_tokens=2 + 3 * i, seed=i) for i in range(20)]
    for sampling in (GREEDY, lengths):
        same_generations(
            run(growing, conversations, sampling), run(copying, conversations, sampling)
        )
    stored = engine(default_tiny_model)
    same_generations(run(stored, conversations, lengths), run(copying, conversations, lengths))
    assert len(stored.prefix_cache.entries) == 20


def test_the_static_decoder_reuses_rows_stored_at_every_compaction(default_tiny_model):
    cached = engine(default_tiny_model, decode="static")
    plain = engine(default_tiny_model, decode="static", prefix_cache_bytes=0)
    # Rows finishing at different lengths leave the workspace at different compactions, each
    # batch of leavers stored from its own snapshot of the cache.
    lengths = [SamplingParams(temperature=1.0, max_tokens=2 + 3 * i, seed=i) for i in range(20)]
    first = run(cached, [history(1, index) for index in range(20)], lengths)
    assert cached._static.compactions > 0
    store = cached.prefix_cache
    assert len({id(entry.kv.snapshot) for entry in store.entries.values()}) > 1
    follow = [
        history(1, index) + [
            {"role": "assistant", "content": generation.text},
            {"role": "user", "content": "Your move was noted. Next board: X.O.X.O.."},
        ]
        for index, generation in enumerate(first)
    ]  # fmt: skip
    before = store.tokens_reused
    same_generations(run(cached, follow, lengths), run(plain, follow, lengths))
    assert store.tokens_reused - before >= sum(len(g.prompt_ids) - 1 for g in first)


def test_prefix_hashes_are_the_polynomial_of_each_blocks_prefix():
    from rlcore.policy.kv_cache import _BASE

    store, rng = PrefixCache(), np.random.default_rng(0)
    rows, expected = [], []
    for length in (0, 15, 16, 17, 100, 700, 3):
        tokens = rng.integers(0, 200_000, length).tolist()
        hashes, value = [], 0
        for count, token in enumerate(tokens, start=1):
            value = (value * _BASE + token + 1) % 2**64
            if count % PrefixCache.BLOCK == 0:
                hashes.append(value)
        assert store._rows([tokens]) == [hashes]  # alone
        rows.append(tokens)
        expected.append(hashes)
    assert store._rows(rows) == expected  # and each at its place in one concatenation
    # One token changed changes the hash of every prefix holding it and no other.
    tokens = rng.integers(0, 200_000, 64).tolist()
    changed = list(tokens)
    changed[40] += 1
    hashes, changed_hashes = store._rows([tokens, changed])
    assert [a == b for a, b in zip(hashes, changed_hashes, strict=True)] == [
        True, True, False, False,
    ]  # fmt: skip


def test_the_static_store_bounds_the_snapshots_it_holds_not_only_its_entries(default_tiny_model):
    policy = engine(default_tiny_model, decode="static")
    decoder_store = policy.prefix_cache
    lengths = [SamplingParams(temperature=0.0, max_tokens=2 + 5 * i) for i in range(8)]
    run(policy, [history(1, index) for index in range(8)], lengths)
    snapshots = policy._static._snapshots
    assert len(snapshots) > 1  # rows left at different compactions
    # Keep one entry of each snapshot, as when the other conversations went on (their
    # entries superseded) and one game of each batch ended: each pins its whole snapshot.
    kept = set()
    for key, entry in list(decoder_store.entries.items()):
        if id(entry.kv.snapshot) in kept:
            decoder_store._drop(key)
        kept.add(id(entry.kv.snapshot))
    held = sum(s.nbytes for s in snapshots)
    assert decoder_store.bytes < held / 2  # the entries' shares undercount what is held
    decoder_store.max_bytes = held
    run(policy, [history(2, index) for index in range(8, 16)], lengths)
    assert sum(s.nbytes for s in snapshots) <= decoder_store.max_bytes
    assert decoder_store.entries  # the newest stayed


def test_a_batch_of_lookups_and_additions_is_its_rows_one_by_one():
    rng = np.random.default_rng(1)
    opening = rng.integers(0, 50, 40).tolist()
    rows = [opening + rng.integers(0, 50, rng.integers(0, 40)).tolist() for _ in range(30)]
    rows += [[1, 2, 3], []]  # shorter than a block: never stored, never found
    one, many = PrefixCache(), PrefixCache()
    for row in rows[:16]:
        one.add(row, None, nbytes=10)
    many.add_many(rows[:16], [None] * 16, [10] * 16)
    assert [e.tokens for e in one.entries.values()] == [e.tokens for e in many.entries.values()]
    prompts = [row + [7] for row in rows]
    singles = [one.lookup(prompt) for prompt in prompts]
    batch = many.lookup_many(prompts)
    assert [(e and e.tokens, n) for e, n in singles] == [(e and e.tokens, n) for e, n in batch]
    assert many.hits == one.hits > 0 and many.tokens_reused == one.tokens_reused


def test_the_common_prefix_checks_what_the_hashes_promised():
    assert common_prefix([1, 2, 3], [1, 2, 3, 4]) == 3  # one holds the other
    assert common_prefix([1, 2, 3, 4], [1, 2, 5, 4], expected=3) == 2  # a collision's claim
    assert common_prefix([1, 2, 3, 4, 5], [1, 2, 3, 9, 5], expected=2) == 3
    assert common_prefix([9, 2], [1, 2], expected=1) == 0


def test_a_gpu_keeps_no_prefix_store_for_a_model_that_prefills_faster(default_tiny_model):
    from rlcore.policy.kv_cache import DEFAULT_MAX_BYTES
    from rlcore.policy.local import default_prefix_bytes

    policy = engine(default_tiny_model)
    assert default_prefix_bytes(policy.model, None) == DEFAULT_MAX_BYTES  # the dynamic loop
    assert default_prefix_bytes(policy.model, "cuda:0") == 0  # 1 M parameters on a card
