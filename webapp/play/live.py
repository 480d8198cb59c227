"""Live notifications for the Play page: one Channels group per game.

A message carries the game as the API serves it (`Game.to_dict()`), read from the row the
worker has just committed, so the page shows the model's move without asking again. The
database stays the source of truth: a page that missed a message (its socket was down, a
channel message was lost) polls the game's JSON.
"""

from __future__ import annotations

import logging

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer

log = logging.getLogger(__name__)


def game_group(game_id: int) -> str:
    return f"play-{game_id}"


def notify_game(game_id: int, *, status: str, moves: int, data: dict | None = None) -> bool:
    """Tell the game's page (if open) that the game is now `status` with `moves` moves;
    `data`, the game's JSON, goes along where the caller has it."""
    layer = get_channel_layer()
    if layer is None:
        return False
    message = {"type": "game.update", "game": game_id, "status": status, "moves": moves}
    if data is not None:
        message["data"] = data
    try:
        async_to_sync(layer.group_send)(game_group(game_id), message)
    except Exception as exc:  # the page polls and re-reads the game anyway
        log.warning("could not notify game %s: %s", game_id, exc)
        return False
    return True
