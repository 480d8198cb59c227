"""The game page's websocket: ws/play/<id>/ joins the game's channel group.

Only the logged-in owner of the game may subscribe; anyone else is refused during the
handshake. The worker sends a `game.update` whenever the game changes; the page treats
it as a notification and re-reads the game's JSON.
"""

from __future__ import annotations

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from webapp.play.live import game_group
from webapp.play.models import Game

# Application close codes (4000-4999), the same the job page uses.
CLOSE_UNAUTHENTICATED = 4401
CLOSE_FORBIDDEN = 4403


@database_sync_to_async
def _owns(user, game_id: int) -> bool:
    return Game.objects.filter(pk=game_id, owner=user).exists()


class GameConsumer(AsyncJsonWebsocketConsumer):
    async def connect(self):
        user = self.scope.get("user")
        self.group = None
        if user is None or not user.is_authenticated:
            await self.close(code=CLOSE_UNAUTHENTICATED)
            return
        game_id = int(self.scope["url_route"]["kwargs"]["game_id"])
        if not await _owns(user, game_id):
            await self.close(code=CLOSE_FORBIDDEN)
            return
        self.group = game_group(game_id)
        await self.channel_layer.group_add(self.group, self.channel_name)
        await self.accept()
        await self.send_json({"type": "hello", "game": game_id})

    async def disconnect(self, code):
        if self.group:
            await self.channel_layer.group_discard(self.group, self.channel_name)

    async def receive_json(self, content, **kwargs):
        if isinstance(content, dict) and content.get("type") == "ping":
            await self.send_json({"type": "pong"})

    async def game_update(self, event):
        await self.send_json(event)
