"""The game page's websocket: ws/play/<id>/ joins the game's channel group.

Only the logged-in owner of the game may subscribe; anyone else is refused during the
handshake. The worker sends a `game.update` whenever the game changes, with the game's JSON as
committed; the page shows it (and re-reads the game only when a message lacks it).
"""

from __future__ import annotations

from channels.db import database_sync_to_async

from webapp.jobs.consumers import OwnedGroupConsumer
from webapp.play.live import game_group
from webapp.play.models import Game


@database_sync_to_async
def _owns(user, game_id: int) -> bool:
    return Game.objects.filter(pk=game_id, owner=user).exists()


class GameConsumer(OwnedGroupConsumer):
    url_kwarg = "game_id"

    async def may_watch(self, user, pk: int) -> bool:
        return await _owns(user, pk)

    def group_name(self, pk: int) -> str:
        return game_group(pk)

    async def game_update(self, event):
        await self.send_json(event)
