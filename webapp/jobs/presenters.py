"""Shaping stored data for pages: conversations with the reasoning set apart, an env's
facts and drawings of a rollout (declared by the env: `Environment.facts`,
`Environment.state_views`), an eval summary as tables.

Pure functions of plain data; no queries.
"""

from __future__ import annotations

import json
import re

from rlcore.envs import Environment, Fact

THINK = re.compile(r"<think>(.*?)(?:</think>|$)", re.DOTALL)
TAG = re.compile(r"<(?!think\b)([a-z_]+)>(.*?)</\1>", re.DOTALL)


def split_think(content: str | None) -> tuple[str, str]:
    """(reasoning, the rest) of one reply; an unclosed <think> runs to the end."""
    content = content or ""
    thoughts = [m.group(1).strip() for m in THINK.finditer(content)]
    rest = THINK.sub("", content).strip()
    return "\n\n".join(thoughts), rest


def present_messages(messages: list[dict], prompt_len: int = 0) -> list[dict]:
    """Messages with role, reasoning, visible text, parsed tags and tool calls apart."""
    shown = []
    for index, message in enumerate(messages):
        role = message.get("role", "?")
        content = message.get("content")
        if not isinstance(content, str):
            content = json.dumps(content, ensure_ascii=False) if content is not None else ""
        think, text = split_think(content) if role == "assistant" else ("", content)
        shown.append(
            {
                "index": index,
                "role": role,
                "in_prompt": index < prompt_len,
                "think": think,
                "text": text,
                "parsed": TAG.findall(text) if role == "assistant" else [],
                "tool_calls": [
                    {
                        "name": call.get("function", {}).get("name", ""),
                        "arguments": call.get("function", {}).get("arguments", ""),
                    }
                    for call in message.get("tool_calls") or []
                ],
                "name": message.get("name", ""),
            }
        )
    return shown


def fact_text(fact: Fact, value) -> str:
    """One fact's value as the inspector shows it; "–" where the rollout has none."""
    if value is None:
        return "–"
    if fact.type == "float" and isinstance(value, int | float):
        return f"{value:.3f}"
    return str(value)


def fact_rows(facts: list[Fact], values: dict) -> list[dict]:
    """[{name, label, text}] for each declared fact, in declaration order."""
    values = values if isinstance(values, dict) else {}
    return [
        {"name": fact.name, "label": fact.label, "text": fact_text(fact, values.get(fact.name))}
        for fact in facts
    ]


def state_views(env_class: type[Environment] | None, state: dict) -> list[dict]:
    """The env's drawings of a final state (`Environment.state_views`) shaped for the
    generic template: each grid cell with its tone and whether it is highlighted. Views of
    a kind the page does not know are left out; an unknown env draws nothing (the page
    still shows the state's JSON)."""
    if env_class is None:
        return []
    shown = []
    for view in env_class.state_views(state if isinstance(state, dict) else {}):
        if not isinstance(view, dict):
            continue
        common = {
            "kind": view.get("kind"),
            "title": str(view.get("title", "")),
            "muted": bool(view.get("muted")),
            "notes": [
                {
                    "name": str(note.get("name", "")),
                    "ok": bool(note.get("ok")),
                    "text": note.get("text", ""),
                }
                for note in view.get("notes") or []
                if isinstance(note, dict)
            ],
        }
        if view.get("kind") == "grid":
            shown.append({**common, "rows": _grid_rows(view)})
        elif view.get("kind") == "text":
            shown.append({**common, "text": str(view.get("text", ""))})
    return shown


def _grid_rows(view: dict) -> list[list[dict]]:
    highlight = {
        tuple(cell) for cell in view.get("highlight") or [] if isinstance(cell, list | tuple)
    }
    tones = view.get("tones") if isinstance(view.get("tones"), dict) else {}
    return [
        [
            {"text": str(text), "tone": tones.get(text), "highlight": (r, c) in highlight}
            for c, text in enumerate(row)
        ]
        for r, row in enumerate(view.get("rows") or [])
        if isinstance(row, list)
    ]


def summary_tables(summary: dict | None) -> dict | None:
    """An eval summary (rlcore.evaluate.summarize) as rows for the summary tables."""
    if not summary or "reward" not in summary or "functions" not in summary:
        return None
    return {
        "reward": summary["reward"],
        "functions": [
            {"name": name, **stats} for name, stats in summary.get("functions", {}).items()
        ],
        "outcomes": [
            {
                "label": label,
                "count": stats["count"],
                "rate": stats["rate"],
                "low": stats["ci95"][0],
                "high": stats["ci95"][1],
            }
            for label, stats in summary.get("outcomes", {}).items()
        ],
        "breakdowns": [
            {
                "key": key,
                "rows": [
                    {
                        "value": value,
                        "count": stats["count"],
                        "reward_mean": stats["reward_mean"],
                        "outcomes": [
                            (label, rate["rate"]) for label, rate in stats["outcomes"].items()
                        ],
                    }
                    for value, stats in by_value.items()
                ],
            }
            for key, by_value in summary.get("breakdowns", {}).items()
        ],
        "env_metrics": sorted(summary.get("env_metrics", {}).items()),
        "num_rollouts": summary.get("num_rollouts"),
        "errors": summary.get("errors"),
        "cancelled": summary.get("cancelled", False),
    }
