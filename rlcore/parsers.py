"""Parsers that pull structured fields out of free model text.

`XMLParser` finds `<tag>...</tag>` fields; `ThinkParser` separates a `<think>` section from
the answer that follows it. Both are total: any string (empty, truncated, nested, binary
junk) parses to a result with missing fields set to None, never an exception, and in time
linear in its length: a reply of many opening tags and no closing one (which a lazy regex
would rescan from every opening) costs no more than any other reply of its size.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


def tag_contents(text: str | None, tag: str) -> list[str]:
    """The contents of every complete `<tag>...</tag>`, scanning left to right: each opening
    tag pairs with the first closing tag after it, and the next search starts past that
    closing tag (what `re.findall` of `<tag>(.*?)</tag>` gives, in linear time)."""
    text = text or ""
    opening, closing = f"<{tag}>", f"</{tag}>"
    found, position = [], 0
    while (start := text.find(opening, position)) != -1:
        end = text.find(closing, start + len(opening))
        if end == -1:
            break  # no closing tag after this opening, so none after any later one either
        found.append(text[start + len(opening) : end])
        position = end + len(closing)
    return found


@dataclass
class XMLParser:
    """Extracts the last complete occurrence of each named tag."""

    fields: list[str]

    def parse(self, text: str | None) -> dict[str, str | None]:
        out: dict[str, str | None] = {}
        for name in self.fields:
            found = tag_contents(text, name)
            out[name] = found[-1].strip() if found else None
        return out

    def parse_answer(self, text: str | None, tag: str) -> str | None:
        return self.parse(text).get(tag)

    def format(self, **values: str) -> str:
        return "".join(f"<{k}>{v}</{k}>" for k, v in values.items())

    def has_all(self, text: str | None) -> bool:
        return all(v is not None for v in self.parse(text).values())


@dataclass
class ThinkParser:
    """Splits `<think>reasoning</think> answer`; the answer is what follows the think block.

    If there is no think block the whole text is the answer and `think` is None.
    """

    def parse(self, text: str | None) -> tuple[str | None, str]:
        text = text or ""
        match = re.match(r"\s*<think>(.*?)</think>(.*)\Z", text, re.DOTALL)
        if match is None:
            return None, text.strip()
        return match.group(1).strip(), match.group(2).strip()

    def think(self, text: str | None) -> str | None:
        return self.parse(text)[0]

    def answer(self, text: str | None) -> str:
        return self.parse(text)[1]


def last_assistant_text(messages: list[dict]) -> str:
    """The content of the last assistant message, or '' when there is none."""
    for message in reversed(messages):
        if message.get("role") == "assistant":
            return message.get("content") or ""
    return ""


def assistant_texts(messages: list[dict]) -> list[str]:
    return [m.get("content") or "" for m in messages if m.get("role") == "assistant"]
