"""Shaping stored data for pages: conversations with the reasoning set apart, the
tic-tac-toe board move by move, an eval summary as tables, metric charts' panels.

Pure functions of plain data; no queries.
"""

from __future__ import annotations

import json
import re

from rlcore.envs.tictactoe import move_values

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


VALUE_NAMES = {1: "a win", 0: "the draw", -1: "a loss"}


def move_verdict(board: list[str], cell: int, mark: str) -> dict | None:
    """Whether playing `mark` on `cell` keeps the game-theoretic value of `board` (the env's
    solver: `move_values`), as {"sound", "text"}; None where the position is not a legal
    one to judge (a stored state from elsewhere, say)."""
    try:
        values = move_values(board, mark)
        before, after = max(values.values()), values[cell]
    except (ValueError, KeyError):
        return None
    if after == before:
        if before < 0:
            return {"sound": True, "text": "sound: already lost, no move saves it"}
        return {"sound": True, "text": f"sound: keeps {VALUE_NAMES[before]}"}
    return {"sound": False, "text": f"unsound: {VALUE_NAMES[before]} became {VALUE_NAMES[after]}"}


def _think_verdicts(state: dict) -> list[bool] | None:
    """Whether the think block of each of the model's played moves read the board right,
    in move order: the env records one entry per reply in `think_correct` and
    `move_sound` (None there for an invalid reply, which played nothing). None when the
    state holds no such record or the two records disagree in length."""
    thinks, sound = state.get("think_correct"), state.get("move_sound")
    if not isinstance(thinks, list) or not isinstance(sound, list) or len(thinks) != len(sound):
        return None
    return [bool(think) for think, played in zip(thinks, sound, strict=True) if played is not None]


def board_frames(state: dict) -> list[dict]:
    """The tic-tac-toe board after each move in `state["moves"]` (empty if not a board game);
    moves of a random opening (the env's `opening_moves`, played before the model took
    over) are flagged so the page does not show them as the model's choices, and each of
    the model's own moves carries the solver's verdict (`move_verdict`) and, where the env
    recorded it, whether the reply's think block read the board right (`think_correct`)."""
    moves = state.get("moves")
    if not isinstance(moves, list):
        return []
    thinks = _think_verdicts(state)
    model_moves = 0
    board = ["."] * 9
    frames = []
    for number, move in enumerate(moves, start=1):
        if not isinstance(move, dict) or not isinstance(move.get("cell"), int):
            continue
        cell = move["cell"]
        verdict = think = None
        if move.get("player") == "model" and not move.get("opening") and 0 <= cell < 9:
            verdict = move_verdict(list(board), cell, move.get("mark", ""))
            if thinks is not None and model_moves < len(thinks):
                think = thinks[model_moves]
            model_moves += 1
        if 0 <= cell < 9:
            board[cell] = move.get("mark", "?")
        frames.append(
            {
                "number": number,
                "player": move.get("player", ""),
                "mark": move.get("mark", ""),
                "cell": cell,
                "opening": bool(move.get("opening")),
                "verdict": verdict,
                "think": think,
                "rows": [
                    [{"mark": board[i], "last": i == cell} for i in range(r, r + 3)]
                    for r in (0, 3, 6)
                ],
            }
        )
    return frames


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
