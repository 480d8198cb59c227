"""Live notifications for the Play page: one Channels group per game.

A message only says that the game changed (its status and how many moves it has); the
page then reads the game from the database, which stays the source of truth, and polls
as well whenever its socket is down.
"""

from __future__ import annotations

import logging

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer

log = logging.getLogger(__name__)


def game_group(game_id: int) -> str:
    return f"play-{game_id}"


def notify_game(game_id: int, *, status: str, moves: int) -> bool:
    """Tell the game's page (if open) that the game is now `status` with `moves` moves."""
    layer = get_channel_layer()
    if layer is None:
        return False
    message = {"type": "game.update", "game": game_id, "status": status, "moves": moves}
    try:
        async_to_sync(layer.group_send)(game_group(game_id), message)
    except Exception as exc:  # the page polls and re-reads the game anyway
        log.warning("could not notify game %s: %s", game_id, exc)
        return False
    return True
