"""Websocket routes of the Play app (webapp/asgi.py adds them when the app is installed)."""

from django.urls import path

from webapp.play.consumers import GameConsumer

websocket_urlpatterns = [
    path("ws/play/<int:game_id>/", GameConsumer.as_asgi()),
]
