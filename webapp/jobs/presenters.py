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
        elif view.get("kind") == "images":
            shown.append({**common, "images": _images(view)})
    return shown


def _images(view: dict) -> list[dict]:
    """An images view's pictures (the browser env's screenshots): each a path relative to
    the job's folder, which the page serves through `rollout_image`, and a caption."""
    images = view.get("images") if isinstance(view.get("images"), list) else []
    return [
        {"path": str(image.get("path", "")), "caption": str(image.get("caption", ""))}
        for image in images
        if isinstance(image, dict)
    ]


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


def audit_report(result: dict | None) -> dict | None:
    """An audit job's result (rlcore.audit.AuditReport as data) as the audit page's
    tables; None before it finished."""
    audit = (result or {}).get("audit")
    if not isinstance(audit, dict):
        return None
    return {
        "oracle_mean": audit.get("oracle_mean"),
        "floor": audit.get("floor"),
        "num_examples": audit.get("num_examples"),
        "seed": audit.get("seed"),
        "exploits": audit.get("exploits") or [],
        "variants": audit.get("variants") or [],
        "throughput": audit.get("throughput") or {},
        "warnings": audit.get("warnings") or [],
        "text": (result or {}).get("report", ""),
    }


def delta_report(delta: dict | None) -> dict | None:
    """A held-out delta's report (rlcore.delta.DeltaReport as data) with the answer to
    "did training help?" from the reward's row; None before it finished."""
    if not isinstance(delta, dict) or not delta.get("metrics"):
        return None
    reward = delta["metrics"][0]
    return {**delta, "reward": reward, "answer": did_training_help(reward["verdict"])}


def did_training_help(verdict: str) -> str:
    """The answer the reward's verdict gives (as `python -m rlcore delta` prints it)."""
    return {"higher": "yes", "lower": "no, it hurt"}.get(verdict, "not beyond noise")


def held_out_check(rewards: list[dict], delta) -> dict:
    """Whether an RL job's train reward (`rewards`: its reward/mean points) rose, the
    mean of its last quarter of steps above that of its first, and what `delta`, the
    newest finished held-out delta on one of its checkpoints (or None), says. A warning
    when the train reward rose and held-out did not."""
    quarter = max(1, len(rewards) // 4)
    rose = len(rewards) >= 2 and (
        sum(p["value"] for p in rewards[-quarter:]) / quarter
        > sum(p["value"] for p in rewards[:quarter]) / quarter
    )
    report = delta_report((delta.result or {}).get("delta")) if delta else None
    verdict = report["reward"]["verdict"] if report else None
    return {
        "train_rose": rose,
        "delta": delta,
        "report": report,
        "warn": rose and report is not None and verdict != "higher",
    }
