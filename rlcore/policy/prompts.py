"""Tokenizing prompts that grow: each turn of a conversation is the previous turn's prompt
plus a little, so its ids are the previous prompt's ids plus the ids of what was added,
as long as the cut between the two falls where the tokenizer itself cuts.

A Hugging Face fast tokenizer first splits its input at every added token (`<|im_start|>`,
`<|im_end|>`, `<think>`...), then normalizes, pre-tokenizes and encodes each piece on its
own. So the end of an added token is a cut it always makes, and the ids of a text are the
ids of the text before such a cut followed by the ids of the text after it, provided (1)
no two added tokens can overlap or nest, so an occurrence found in a prefix is the one the
whole text's matcher finds; (2) no added token strips the whitespace beside it; (3) the
normalizer and the pre-tokenizer treat every piece alike (a Metaspace pre-tokenizer
prepending only to the first piece does not). `PrefixTokenizer` checks these once per
tokenizer (`prefix_reuse_problem`) and otherwise tokenizes whole texts as before.

With them, it keeps the ids of each prompt it tokenized up to the last added token in it
(usually the generation prompt's `<|im_start|>`), and tokenizes a later prompt that starts
with a kept text as that text's ids plus the ids of the rest: a 6-turn tic-tac-toe game
tokenizes each character of its conversation about once instead of once a turn.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict

# The normalizers and pre-tokenizers that treat each piece of a split text alike.
_PIECEWISE_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase"}
_PIECEWISE_PRE_TOKENIZERS = {
    "ByteLevel",
    "Split",
    "Digits",
    "Punctuation",
    "Whitespace",
    "WhitespaceSplit",
    "BertPreTokenizer",
}
# Texts that the tokenizer must split the same whole or cut at an added token; a last
# check of the tokenizer's behaviour on top of reading its configuration.
_PROBES = ("\n", "  x", "\n\nHello", " world", "é\u0301", "1234", "'s", "\t\n ")


def _component_types(component: dict | None, key: str) -> list[str]:
    """The types of a tokenizer.json normalizer or pre-tokenizer, sequences flattened."""
    if component is None:
        return []
    if component.get("type") == "Sequence":
        return [t for part in component.get(key, []) for t in _component_types(part, key)]
    return [component.get("type", "?")]


def prefix_reuse_problem(tokenizer) -> str | None:
    """Why `tokenizer`'s ids of a text cut after an added token may differ from the ids of
    the two parts joined, or None when they cannot."""
    if not getattr(tokenizer, "is_fast", False):
        return "not a fast (tokenizers) tokenizer"
    if getattr(tokenizer, "split_special_tokens", False):
        return "split_special_tokens is on"
    config = json.loads(tokenizer.backend_tokenizer.to_str())
    normalizers = set(_component_types(config.get("normalizer"), "normalizers"))
    if normalizers - _PIECEWISE_NORMALIZERS:
        return f"normalizer {sorted(normalizers - _PIECEWISE_NORMALIZERS)}"
    pre_tokenizers = set(_component_types(config.get("pre_tokenizer"), "pretokenizers"))
    if pre_tokenizers - _PIECEWISE_PRE_TOKENIZERS:
        return f"pre-tokenizer {sorted(pre_tokenizers - _PIECEWISE_PRE_TOKENIZERS)}"
    added = config.get("added_tokens") or []
    for token in added:
        if token.get("lstrip") or token.get("rstrip") or token.get("single_word"):
            return f"added token {token['content']!r} strips whitespace or is single-word"
    cuts = _cut_tokens(config)
    for first in cuts:
        for second in cuts:
            if first != second and first in second:
                return f"added token {first!r} is inside {second!r}"
            for size in range(1, len(first)):
                if second.startswith(first[-size:]):
                    return f"added tokens {first!r} and {second!r} can overlap"
    if not cuts:
        return "no added tokens to cut at"
    encode = tokenizer.backend_tokenizer.encode
    for cut in cuts:
        for probe in _PROBES:
            for head in ("", "a", " a\n"):
                joined = encode(head + cut + probe, add_special_tokens=False).ids
                parts = encode(head + cut, add_special_tokens=False).ids
                parts += encode(probe, add_special_tokens=False).ids
                if joined != parts:
                    return f"{head + cut + probe!r} tokenizes differently cut after {cut!r}"
    return None


def _cut_tokens(config: dict) -> list[str]:
    """The added tokens matched on the raw text (before normalization): the cuts."""
    normalized = config.get("normalizer") is not None
    return [
        token["content"]
        for token in config.get("added_tokens") or []
        if not (normalized and token.get("normalized"))
    ]


class PrefixTokenizer:
    """`encode(texts)`: the ids `tokenizer(texts, add_special_tokens=False)` gives, reusing
    the ids of earlier texts' beginnings (see the module docstring). It keeps at most
    `max_entries` beginnings and `max_chars` characters of them, the least recently used
    going first."""

    def __init__(self, tokenizer, max_entries: int = 8192, max_chars: int = 32_000_000):
        self.tokenizer = tokenizer
        self.max_entries = max_entries
        self.max_chars = max_chars
        self.problem = prefix_reuse_problem(tokenizer)
        self._entries: OrderedDict[str, list[int]] = OrderedDict()
        self._chars = 0
        self._tails: dict[str, list[int]] = {}
        self._cuts = None
        if self.problem is None:
            cuts = _cut_tokens(json.loads(tokenizer.backend_tokenizer.to_str()))
            self._cuts = re.compile("|".join(re.escape(t) for t in sorted(cuts, key=len)[::-1]))
        self._lock = threading.Lock()
        self.reused_chars = 0
        self.tokenized_chars = 0

    def _tokenize(self, texts: list[str]) -> list[list[int]]:
        if not texts:
            return []
        self.tokenized_chars += sum(map(len, texts))
        return [list(ids) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]

    def encode(self, texts: list[str]) -> list[list[int]]:
        if self._cuts is None:
            return self._tokenize(texts)
        with self._lock:
            return self._encode_reusing(texts)

    def _encode_reusing(self, texts: list[str]) -> list[list[int]]:
        unique = list(dict.fromkeys(texts))
        starts, heads = [], []
        for text in unique:
            start, head = self._longest_kept(text)
            starts.append(start)
            heads.append(head)
        rests = self._tokenize([text[start:] for text, start in zip(unique, starts, strict=True)])
        ids_by_text = {}
        cuts = []
        for text, head, rest in zip(unique, heads, rests, strict=True):
            ids_by_text[text] = head + rest
            cuts.append(self._last_cut(text))
        missing = list(
            {text[cut:] for text, cut in zip(unique, cuts, strict=True)} - self._tails.keys()
        )
        for tail, tail_ids in zip(missing, self._tokenize(missing), strict=True):
            self._tails[tail] = tail_ids
        for text, cut in zip(unique, cuts, strict=True):
            if cut:
                self._keep(text[:cut], ids_by_text[text], self._tails[text[cut:]])
        if len(self._tails) > self.max_entries:
            self._tails.clear()
        return [list(ids_by_text[text]) for text in texts]

    def _last_cut(self, text: str) -> int:
        """Where the last added token in `text` ends; 0 when it has none."""
        cut = 0
        for match in self._cuts.finditer(text):
            cut = match.end()
        return cut

    def _longest_kept(self, text: str) -> tuple[int, list[int]]:
        """(where the longest kept beginning of `text` ends, its ids); (0, []) if none."""
        ends = [match.end() for match in self._cuts.finditer(text)]
        for end in reversed(ends):
            ids = self._entries.get(text[:end])
            if ids is not None:
                self._entries.move_to_end(text[:end])
                self.reused_chars += end
                return end, ids
        return 0, []

    def _keep(self, head: str, ids: list[int], tail_ids: list[int]) -> None:
        """Keep `head`'s ids: `ids` (the whole text's) less the ids of the text after it.
        Where those do not end `ids` the tokenizer broke the rule it was checked for, and
        nothing is kept."""
        size = len(ids) - len(tail_ids)
        if size < 0 or ids[size:] != tail_ids or head in self._entries:
            return
        self._entries[head] = ids[:size]
        self._chars += len(head)
        while len(self._entries) > self.max_entries or self._chars > self.max_chars:
            dropped, _ = self._entries.popitem(last=False)
            self._chars -= len(dropped)
