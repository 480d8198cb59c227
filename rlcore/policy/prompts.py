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
from array import array
from collections import OrderedDict

from rlcore.policy.tiny import CHAT_TEMPLATE

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
# How far from a text's end the search for kept beginnings starts; earlier if none is there.
SEARCH_WINDOW = 4096
_NO_IDS = array("q")
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


def _keeps_stock(tokenizer, base_methods: tuple[str, ...], backend_methods: tuple[str, ...]):
    """Whether `tokenizer` is a transformers fast tokenizer (of this transformers' layout)
    whose class keeps the named methods of `PreTrainedTokenizerBase` and of
    `TokenizersBackend` as they are; False for anything else, another layout included."""
    try:
        from transformers import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return False
    kind = type(tokenizer)
    return (
        isinstance(tokenizer, TokenizersBackend)
        and all(getattr(kind, m) is getattr(PreTrainedTokenizerBase, m) for m in base_methods)
        and all(getattr(kind, m) is getattr(TokenizersBackend, m) for m in backend_methods)
    )


def plain_fast_encode(tokenizer) -> bool:
    """Whether `tokenizer(texts, add_special_tokens=False)` is exactly its backend's
    `encode_batch` (as long as `_backend_as_called` holds): the stock call and encoding,
    no added token split."""
    return (
        _keeps_stock(tokenizer, ("__call__",), ("_encode_plus",))
        and not getattr(tokenizer, "split_special_tokens", True)
        and hasattr(tokenizer.backend_tokenizer, "encode_batch_fast")
    )


def plain_fast_decode(tokenizer) -> bool:
    """Whether `tokenizer.decode(ids, skip_special_tokens=True)` is exactly its backend's
    decode: the stock decode, no clean-up of spaces afterwards."""
    return _keeps_stock(tokenizer, ("decode",), ("_decode",)) and not getattr(
        tokenizer, "clean_up_tokenization_spaces", True
    )


def _backend_as_called(backend) -> bool:
    """Whether the backend is set as transformers' call would set it before encoding: no
    truncation, no padding, added tokens kept whole (a call asking for truncation or
    padding leaves them set until the next call)."""
    return (
        backend.truncation is None and backend.padding is None and not backend.encode_special_tokens
    )


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
        self._entries: OrderedDict[str, array] = OrderedDict()
        self._chars = 0
        self._tails: dict[str, list[int]] = {}
        self._cuts = None
        if self.problem is None:
            cuts = _cut_tokens(json.loads(tokenizer.backend_tokenizer.to_str()))
            self._cuts = re.compile("|".join(re.escape(t) for t in sorted(cuts, key=len)[::-1]))
        self._lock = threading.Lock()
        self.reused_chars = 0
        self.tokenized_chars = 0
        self._plain_backend = plain_fast_encode(tokenizer)

    def _tokenize(self, texts: list[str]) -> list[list[int]]:
        if not texts:
            return []
        self.tokenized_chars += sum(map(len, texts))
        if self._plain_backend and _backend_as_called(self.tokenizer.backend_tokenizer):
            # What the call below does, less transformers' per-text conversion of each
            # encoding into a dict of lists (about half a large batch's tokenizing time).
            encodings = self.tokenizer.backend_tokenizer.encode_batch_fast(
                texts, add_special_tokens=False
            )
            return [encoding.ids for encoding in encodings]
        return [list(ids) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]

    def encode(self, texts: list[str]) -> list[list[int]]:
        if self._cuts is None:
            return self._tokenize(texts)
        with self._lock:
            return self._encode_reusing(texts)

    def _encode_reusing(self, texts: list[str]) -> list[list[int]]:
        unique = list(dict.fromkeys(texts))
        found = [self._longest_kept(text) for text in unique]
        rests = self._tokenize(
            [text[start:] for text, (start, _, _) in zip(unique, found, strict=True)]
        )
        ids_by_text = {
            text: head.tolist() + rest
            for text, (_, head, _), rest in zip(unique, found, rests, strict=True)
        }
        tails = {text: text[cut:] for text, (_, _, cut) in zip(unique, found, strict=True) if cut}
        missing = list(set(tails.values()) - self._tails.keys())
        for tail, tail_ids in zip(missing, self._tokenize(missing), strict=True):
            self._tails[tail] = tail_ids
        for text, tail in tails.items():
            self._keep(text[: len(text) - len(tail)], ids_by_text[text], self._tails[tail])
        if len(self._tails) > self.max_entries:
            self._tails.clear()
        # A text given twice gets its own copy of the ids the second time.
        result, given = [], set()
        for text in texts:
            result.append(list(ids_by_text[text]) if text in given else ids_by_text[text])
            given.add(text)
        return result

    def _cut_ends(self, text: str, start: int = 0) -> list[int]:
        """Where the added tokens in `text` from `start` on end. Added tokens never overlap
        (checked), so one found from any start is one the tokenizer finds."""
        return [match.end() for match in self._cuts.finditer(text, start)]

    def _longest_kept(self, text: str) -> tuple[int, array, int]:
        """(where the longest kept beginning of `text` ends, its ids, where the last added
        token in `text` ends); 0, no ids and 0 where there is none. The end of the text
        is searched first: an earlier turn's prompt is most of a conversation."""
        window = max(0, len(text) - SEARCH_WINDOW)
        ends = self._cut_ends(text, window)
        found = self._lookup(text, ends)
        if found is None and window:
            # An added token reaching into the window from before it ends before the first
            # found in the window, never after.
            first = ends[0] if ends else len(text) + 1
            earlier = [end for end in self._cut_ends(text) if end < first]
            found = self._lookup(text, earlier)
            ends = ends or earlier
        start, ids = found or (0, _NO_IDS)
        return start, ids, ends[-1] if ends else 0

    def _lookup(self, text: str, ends: list[int]) -> tuple[int, array] | None:
        for end in reversed(ends):
            ids = self._entries.get(text[:end])
            if ids is not None:
                self._entries.move_to_end(text[:end])
                self.reused_chars += end
                return end, ids
        return None

    def _keep(self, head: str, ids: list[int], tail_ids: list[int]) -> None:
        """Keep `head`'s ids: `ids` (the whole text's) less the ids of the text after it.
        Where those do not end `ids` the tokenizer broke the rule it was checked for, and
        nothing is kept. Kept as arrays: compact, and nothing for the garbage collector
        to walk through."""
        size = len(ids) - len(tail_ids)
        if size < 0 or ids[size:] != tail_ids or head in self._entries:
            return
        self._entries[head] = array("q", ids[:size])
        self._chars += len(head)
        while len(self._entries) > self.max_entries or self._chars > self.max_chars:
            dropped, _ = self._entries.popitem(last=False)
            self._chars -= len(dropped)


# ---------------------------------------------------------------------------------------
# Rendering


def message_local_problem(chat_template) -> str | None:
    """Why `chat_template` may render a message differently depending on the others, or
    None when it cannot: its one loop over `messages` reads nothing but the message at
    hand (no `loop`, no other message, no `namespace` carried between iterations, no
    `break`), and nothing outside the loop reads `messages`. Then a conversation renders
    as a head (the tools block) + one piece per message + the generation prompt."""
    if not isinstance(chat_template, str):
        return f"the chat template is a {type(chat_template).__name__}, not one template"
    try:
        from jinja2 import nodes
        from transformers.utils.chat_template_utils import _compile_jinja_template

        environment = _compile_jinja_template(chat_template).environment
        tree = environment.parse(chat_template)
    except Exception as exc:  # an unparseable template renders whole, as before
        return f"cannot parse the template: {type(exc).__name__}: {exc}"
    if any(isinstance(n, nodes.NSRef) for n in tree.find_all(nodes.NSRef)):
        return "it assigns namespace attributes"
    for call in tree.find_all(nodes.Call):
        if isinstance(call.node, nodes.Name) and call.node.name == "namespace":
            return "it uses namespace()"
    loops = [
        n
        for n in tree.body
        if isinstance(n, nodes.For) and isinstance(n.iter, nodes.Name) and n.iter.name == "messages"
    ]
    if len(loops) != 1:
        return f"{len(loops)} top-level loops over messages (one accepted)"
    (loop,) = loops
    if loop.else_ or loop.test is not None or loop.recursive:
        return "its loop over messages has an else, a filter or recursion"
    after = False
    for node in tree.body:
        if node is loop:
            after = True
            continue
        if not isinstance(node, nodes.Macro | nodes.Output | nodes.If | nodes.Assign):
            return f"a top-level {type(node).__name__} block"
        names = {n.name for n in node.find_all(nodes.Name)}
        if "messages" in names:
            return "it reads messages outside its loop over them"
        if "add_generation_prompt" in names and not after:
            return "it reads add_generation_prompt before its loop over messages"
    return _loop_body_problem(loop.body, nested=False)


def _loop_body_problem(body, *, nested: bool) -> str | None:
    """What in the messages loop's `body` reaches beyond the message at hand; `nested`:
    inside an inner loop, whose own `loop`, `break` and `continue` are its business."""
    from jinja2 import nodes

    for node in body:
        if isinstance(node, nodes.For):
            for part in (node.target, node.iter, node.test):
                problem = part is not None and _loop_body_problem([part], nested=nested)
                if problem:
                    return problem
            problem = _loop_body_problem(node.body + node.else_, nested=True)
            if problem:
                return problem
            continue
        if not nested and isinstance(node, nodes.Break | nodes.Continue):
            return "its loop over messages breaks or continues"
        if isinstance(node, nodes.Name):
            if node.name in ("messages", "add_generation_prompt", "self"):
                return f"its loop over messages reads {node.name!r}"
            if node.name == "loop" and not nested:
                return "its loop over messages reads `loop`"
        problem = _loop_body_problem(list(node.iter_child_nodes()), nested=nested)
        if problem:
            return problem
    return None


def _message_key(message) -> tuple | None:
    """A hashable stand-in for a message of plain string fields, else None."""
    if type(message) is not dict:
        return None
    items = tuple(message.items())
    for _, value in items:
        if type(value) is not str:
            return None
    return items


def render_builtin_chatml(messages) -> str | None:
    """The built-in template's (tiny.CHAT_TEMPLATE) text of `messages` with a generation
    prompt, without Jinja, where every message is plain (a dict of a string role and a
    string content, nothing else): each renders as `<|im_start|>ROLE\nCONTENT<|im_end|>\n`
    (no tools block, no tool calls). None where a message is not plain, or there are none
    (apply_chat_template refuses an empty conversation)."""
    if not messages:
        return None
    parts = []
    for message in messages:
        if type(message) is not dict or len(message) != 2:
            return None
        role, content = message.get("role"), message.get("content")
        if type(role) is not str or type(content) is not str:
            return None
        parts.append(f"<|im_start|>{role}\n{content}<|im_end|>\n")
    parts.append("<|im_start|>assistant\n")
    return "".join(parts)


class PromptRenderer:
    """`render(messages, tools)`: the chat template's text of `messages` with a generation
    prompt, as `tokenizer.apply_chat_template` gives it, rendering only the messages added
    since an earlier call's conversation where the template is message-local
    (`message_local_problem`): the text of that conversation, kept without its generation
    prompt, plus the rendering of the new messages less the template's head. Messages with
    other than string fields (tool calls, content parts) are rendered whole each time.
    Keeps at most `max_entries` conversations and `max_chars` characters of them. With the
    built-in template, plain conversations without tools skip Jinja altogether
    (`render_builtin_chatml`: ~90 us a prompt through apply_chat_template, most of a large
    batch's host time)."""

    # How many trailing messages a conversation may have gained since its last rendering:
    # a turn adds a reply and the env's answer (and perhaps a tool result or two).
    MAX_NEW_MESSAGES = 4

    def __init__(self, tokenizer, max_entries: int = 8192, max_chars: int = 32_000_000):
        self.tokenizer = tokenizer
        self.max_entries = max_entries
        self.max_chars = max_chars
        self.problem = message_local_problem(getattr(tokenizer, "chat_template", None))
        self.builtin = getattr(tokenizer, "chat_template", None) == CHAT_TEMPLATE
        self._texts: OrderedDict[tuple, str] = OrderedDict()
        self._chars = 0
        # Per tools (as JSON): (head, generation prompt), or None where probing found the
        # template does not render as head + pieces + generation prompt.
        self._frames: dict[str, tuple[str, str] | None] = {}
        self._lock = threading.Lock()
        self.reused_messages = 0
        self.builtin_rendered = 0

    def _apply(self, messages, tools, generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=generation_prompt, tokenize=False
        )

    def render(self, messages: list, tools: list[dict] | None = None) -> str:
        if self.builtin and not tools:
            text = render_builtin_chatml(messages)
            if text is not None:
                self.builtin_rendered += 1
                return text
        if self.problem is not None:
            return self._apply(messages, tools)
        keys = [_message_key(message) for message in messages]
        if None in keys:
            return self._apply(messages, tools)
        tools_key = json.dumps(tools, sort_keys=True) if tools else ""
        frame = self._frame(tools, tools_key)
        if frame is None:
            return self._apply(messages, tools)
        head, generation_prompt = frame
        prefix, start = None, len(messages)
        with self._lock:
            for start in range(
                len(messages) - 1, max(0, len(messages) - 1 - self.MAX_NEW_MESSAGES), -1
            ):
                prefix = self._texts.get((tools_key, *keys[:start]))
                if prefix is not None:
                    self._texts.move_to_end((tools_key, *keys[:start]))
                    break
        if prefix is None:
            text = self._apply(messages, tools)
        else:
            self.reused_messages += start
            text = prefix + self._apply(messages[start:], tools)[len(head) :]
        if text.endswith(generation_prompt):
            self._keep((tools_key, *keys), text[: len(text) - len(generation_prompt)])
        return text

    def _frame(self, tools, tools_key: str) -> tuple[str, str] | None:
        """(head, generation prompt) of the template with these tools, found by rendering
        probe conversations and checking they are head + pieces + generation prompt."""
        if tools_key in self._frames:
            return self._frames[tools_key]
        probes = [
            {"role": "system", "content": "s"},
            {"role": "user", "content": "u\n"},
            {"role": "assistant", "content": " a"},
            {"role": "user", "content": ""},
        ]
        frame = None
        try:
            alone = [self._apply([m], tools, False) for m in probes]
            whole = self._apply(probes, tools, False)
            with_prompt = self._apply(probes, tools, True)
            head_size = (sum(map(len, alone)) - len(whole)) // (len(probes) - 1)
            head = alone[0][:head_size]
            pieces = [text[head_size:] for text in alone]
            if (
                all(text.startswith(head) for text in alone)
                and whole == head + "".join(pieces)
                and with_prompt.startswith(whole)
            ):
                frame = (head, with_prompt[len(whole) :])
        except Exception:  # the template refuses the probes: render whole, as before
            frame = None
        self._frames[tools_key] = frame
        return frame

    def _keep(self, key: tuple, text: str) -> None:
        with self._lock:
            if key in self._texts:
                return
            self._texts[key] = text
            self._chars += len(text)
            while len(self._texts) > self.max_entries or self._chars > self.max_chars:
                _, dropped = self._texts.popitem(last=False)
                self._chars -= len(dropped)
