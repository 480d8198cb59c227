"""Keys and values for the local engine: a cache that grows in place for the dynamic loop
(`GrowingLayer`), and a store of recent prompts and replies (`PrefixCache`, used by the
dynamic loop and the static decoder), kept between generations, so a request whose prompt
begins with one of them prefills only the rest.

A conversation re-sends everything said so far at every turn: the next move of a game, a
retry after an invalid reply, a tool result. Without this cache every turn pays the whole
history again (a tic-tac-toe game's prompt grows from ~170 to ~450 tokens, and the prefill
of 20 such prompts is most of a Play move's compute on a CPU). The engine looks up the
longest stored prefix of each prompt, starts that row's KV cache from it, and after the
batch stores each row's prompt and reply (all but the last sampled token, which was never
fed back).

A key or value at position j depends only on the tokens up to j and the weights, so any
stored prefix of a prompt is exact up to float rounding (the batch it was computed in pads
differently). Entries belong to one version of the weights: an in-place change of any
parameter (an optimizer step, `load_state_dict`) bumps torch's version counter and empties
the cache. Bounded by bytes; least recently used first out; an entry that is a prefix of a
newer one (the previous turn of the same conversation) is dropped when the newer one comes.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

# The prefix hash's base (odd, so invertible modulo 2**64) and its inverse.
_BASE = 0x100000001B3
_INVERSE = pow(_BASE, -1, 2**64)

# The default bound: the tiny model keeps ~4 KB a token, so this holds ~130 games of ~500
# tokens; a 0.5 B model in bf16 ~12 KB a token.
DEFAULT_MAX_BYTES = 512 * 2**20


@dataclass
class PrefixEntry:
    tokens: list[int]
    # Where the keys and values are: for the dynamic loop, per layer (keys, values) [kv heads,
    # n, head dim]; the static decoder stores its own handle (static_decode._Stored).
    kv: Any
    nbytes: int
    hashes: list[int]  # of its blocks' prefixes (PrefixCache._rows)


def weights_version(model) -> tuple:
    """Changes whenever a parameter is replaced or changed in place."""
    return tuple((p.data_ptr(), p._version) for p in model.parameters())


def common_prefix(a: list[int], b: list[int], expected: int = 0) -> int:
    """How many first tokens `a` and `b` share; `expected`, a length the caller believes
    they share (their blocks' hashes matched), is checked, not trusted. Mostly one of the
    two holds all of the other (a conversation one turn on): one comparison of lists."""
    length = min(len(a), len(b))
    if a[:length] == b[:length]:
        return length
    shared = expected if a[:expected] == b[:expected] else 0
    while a[shared] == b[shared]:
        shared += 1
    return shared


class PrefixCache:
    """`lookup` the longest stored prefix of a prompt, `add` a row's tokens with their keys
    and values. Not thread-safe: the engine calls it from its one generation thread.
    `hits`, `tokens_reused` and `tokens_looked_up` count what it saved.

    Entries are found through the hashes of their prefixes at every BLOCK tokens, so a
    lookup costs a few dictionary reads whatever the number of entries (a scan of every
    entry cost seconds a step at 256 games); the entry found is then compared token by
    token, so a hash collision costs reuse, never correctness, and reuse may run past the
    block. The hash of a prefix is polynomial in its tokens modulo 2**64, all of a
    prompt's prefixes computed in a few numpy operations (a chain of Python tuple hashes
    took ~40 us a prompt, most of the store's cost at 1,024 games a step), and the engine
    hands over a whole batch's prompts at once (`lookup_many`, `add_many`): one pass of
    those operations over all of them.
    """

    BLOCK = 16

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES):
        self.max_bytes = max_bytes
        self.entries: OrderedDict[int, PrefixEntry] = OrderedDict()
        self.index: dict[int, int] = {}  # prefix hash -> the newest entry holding that prefix
        self.bytes = 0
        self.version: tuple | None = None
        self._next_key = 0
        self.hits = self.tokens_reused = self.tokens_looked_up = 0
        self._powers = np.ones(1, dtype=np.uint64)  # _BASE ** i
        self._inverse_powers = np.ones(1, dtype=np.uint64)  # _BASE ** -i

    def check_weights(self, model) -> None:
        """Empty the cache if the weights changed since its entries were computed."""
        version = weights_version(model)
        if version != self.version:
            self.clear()
            self.version = version

    def clear(self) -> None:
        self.entries.clear()
        self.index.clear()
        self.bytes = 0

    def _grow_powers(self, length: int) -> None:
        if len(self._powers) > length:
            return
        size = max(length + 1, 2 * len(self._powers))
        with np.errstate(over="ignore"):  # arithmetic modulo 2**64 is the point
            self._powers, self._inverse_powers = (
                np.cumprod(np.full(size, base, dtype=np.uint64), dtype=np.uint64)
                for base in (_BASE, _INVERSE)
            )
        one = np.ones(1, dtype=np.uint64)
        self._powers = np.concatenate((one, self._powers[:-1]))  # BASE ** i from i = 0
        self._inverse_powers = np.concatenate((one, self._inverse_powers[:-1]))

    def _rows(self, rows: list) -> list[list[int]]:
        """For each row of token ids, the hashes of its whole blocks' prefixes: for each
        whole block i the hash of row[:n], n = BLOCK * (i + 1), the sum over k < n of
        (token k + 1) * BASE ** (n - 1 - k) modulo 2**64. All rows at once, over their
        concatenation: with C the cumulative sum of (token + 1) * BASE ** -g over the
        concatenation's positions g, a row starting at s has BASE ** (s + n - 1) *
        (C[s + n - 1] - C[s - 1]). (Row by row, the numpy calls' own overhead was a third of
        the store's cost at 1,024 rows a round.)"""
        lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
        total = int(lengths.sum())
        flat = np.fromiter(chain.from_iterable(rows), dtype=np.int64, count=total)
        starts = np.cumsum(lengths) - lengths
        blocks = lengths // self.BLOCK
        count = int(blocks.sum())
        if not count:
            return [[] for _ in rows]
        self._grow_powers(total)
        owner_start = np.repeat(starts, blocks)
        within = np.arange(count) - np.repeat(np.cumsum(blocks) - blocks, blocks)
        last = owner_start + (within + 1) * self.BLOCK - 1  # each block's last token
        with np.errstate(over="ignore"):  # arithmetic modulo 2**64 is the point
            sums = np.cumsum(
                (flat.astype(np.uint64) + np.uint64(1)) * self._inverse_powers[:total],
                dtype=np.uint64,
            )
            before = np.where(owner_start > 0, sums[np.maximum(owner_start - 1, 0)], 0)
            hashes = ((sums[last] - before.astype(np.uint64)) * self._powers[last]).tolist()
        offsets = (np.cumsum(blocks) - blocks).tolist()
        return [
            hashes[offset : offset + size]
            for offset, size in zip(offsets, blocks.tolist(), strict=True)
        ]

    def _longest(self, tokens: list[int], hashes: list[int]) -> tuple[int | None, int]:
        """The stored entry sharing the longest prefix with `tokens` (whose block hashes are
        `hashes`), and its length."""
        for blocks in range(len(hashes), 0, -1):
            key = self.index.get(hashes[blocks - 1])
            if key in self.entries:
                return key, common_prefix(self.entries[key].tokens, tokens, blocks * self.BLOCK)
        return None, 0

    def lookup(self, prompt_ids: list[int]) -> tuple[PrefixEntry | None, int]:
        """The entry sharing the longest prefix with `prompt_ids`, and how many tokens of it
        to reuse: at most all but the prompt's last token (whose logits start the reply)."""
        return self.lookup_many([prompt_ids])[0]

    def lookup_many(self, prompts: list[list[int]]) -> list[tuple[PrefixEntry | None, int]]:
        """`lookup` of each prompt, in order, their hashes computed together."""
        found = []
        for tokens, hashes in zip(prompts, self._rows(prompts), strict=True):
            self.tokens_looked_up += len(tokens)
            key, shared = self._longest(tokens, hashes)
            shared = min(shared, len(tokens) - 1)
            if key is None or shared < 1:
                found.append((None, 0))
                continue
            self.entries.move_to_end(key)
            self.hits += 1
            self.tokens_reused += shared
            found.append((self.entries[key], shared))
        return found

    def add(self, tokens: list[int], kv: Any, nbytes: int | None = None) -> None:
        """Store `tokens` with their keys and values `kv`: per layer (keys, values), whose
        size is counted, or any handle with its size given as `nbytes`."""
        self.add_many([tokens], [kv], None if nbytes is None else [nbytes])

    def add_many(self, rows: list[list[int]], kvs: list, nbytes: list[int] | None = None) -> None:
        """`add` of each row with its `kvs` entry (and `nbytes`), in order, their hashes
        computed together."""
        if nbytes is None:
            nbytes = [sum(k.nbytes + v.nbytes for k, v in kv) for kv in kvs]
        for tokens, row_hashes, kv, size in zip(rows, self._rows(rows), kvs, nbytes, strict=True):
            if not row_hashes or size > self.max_bytes:
                continue  # shorter than a block: nothing a lookup could find
            tokens = list(tokens)  # the store's own
            earlier, shared = self._longest(tokens, row_hashes)
            if earlier is not None and shared == len(self.entries[earlier].tokens):
                self._drop(earlier)  # the same conversation, one turn earlier
            key = self._next_key
            self._next_key += 1
            self.entries[key] = PrefixEntry(tokens, kv, size, row_hashes)
            self.index.update(dict.fromkeys(row_hashes, key))
            self.bytes += size
            while self.bytes > self.max_bytes:
                self.drop_oldest()

    def drop_oldest(self) -> None:
        """Drop the least recently used entry."""
        self._drop(next(iter(self.entries)))

    def _drop(self, key: int) -> None:
        entry = self.entries.pop(key)
        self.bytes -= entry.nbytes
        for chained in entry.hashes:
            if self.index.get(chained) == key:
                del self.index[chained]


class GrowingLayer(DynamicLayer):
    """A `DynamicLayer` that writes each token's keys and values into spare room, growing
    the buffer by half when it is full, where `DynamicLayer` copies the whole cache at every
    token (`torch.cat`): at 20 rows of ~350 tokens that copy was most of a CPU decode step."""

    GROWTH = 1.5
    MIN_ROOM = 64

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._key_buffer = self._value_buffer = None
        self._length = 0

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self._length, self._length + key_states.shape[-2]
        if self._key_buffer is None or end > self._key_buffer.shape[-2]:
            self._grow(key_states, value_states, max(end + self.MIN_ROOM, int(end * self.GROWTH)))
        self._key_buffer[:, :, start:end] = key_states
        self._value_buffer[:, :, start:end] = value_states
        self._length = end
        self.keys = self._key_buffer[:, :, :end]
        self.values = self._value_buffer[:, :, :end]
        return self.keys, self.values

    def _grow(self, key_states, value_states, capacity: int) -> None:
        rows, heads, _, dim = key_states.shape
        keys = key_states.new_empty((rows, heads, capacity, dim))
        values = value_states.new_empty((rows, heads, capacity, value_states.shape[-1]))
        if self._key_buffer is not None:
            keys[:, :, : self._length] = self._key_buffer[:, :, : self._length]
            values[:, :, : self._length] = self._value_buffer[:, :, : self._length]
        self._key_buffer, self._value_buffer = keys, values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.get_seq_length() > 0:
            self._key_buffer = self._key_buffer[indices]
            self._value_buffer = self._value_buffer[indices]
            self.keys = self._key_buffer[:, :, : self._length]
            self.values = self._value_buffer[:, :, : self._length]


def growing_cache(config, prefix: list[tuple[torch.Tensor, torch.Tensor]] | None = None):
    """A `DynamicCache` for `config` of `GrowingLayer`s (the model's layers must all be plain
    ones: see `plain_layers`), started from `prefix`'s keys and values when given."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer() for _ in cache.layers]
    for layer, (keys, values) in zip(cache.layers, prefix or [], strict=False):
        layer.update(keys, values)
    return cache


def plain_layers(config) -> bool:
    """Whether every layer keeps plain keys and values (no sliding window, no recurrent
    state): only those grow in place and can start from a stored prefix."""
    layers = DynamicCache(config=config).layers
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)
