"""Reading games: a user reaches only their own, and the per-player win/draw/loss counts."""

from __future__ import annotations

from django.db.models import Count, Max, Q, QuerySet
from django.shortcuts import get_object_or_404

from webapp.play.models import Game


def games_for_user(user) -> QuerySet[Game]:
    return Game.objects.filter(owner=user).select_related("model")


def game_for_user(user, game_id: int) -> Game:
    """The game if it is `user`'s; 404 otherwise, whether or not it exists."""
    return get_object_or_404(games_for_user(user), pk=game_id)


def player_records(user) -> list[dict]:
    """One row per player `user` has played against, most recently played first: games,
    and win/draw/loss/forfeit counts from the model's view."""
    outcome = Game.Outcome
    rows = (
        Game.objects.filter(owner=user)
        .values("player")
        .annotate(
            name=Max("player_name"),
            games=Count("id"),
            win=Count("id", filter=Q(outcome=outcome.WIN)),
            draw=Count("id", filter=Q(outcome=outcome.DRAW)),
            loss=Count("id", filter=Q(outcome=outcome.LOSS)),
            forfeit=Count("id", filter=Q(outcome=outcome.UNFINISHED)),
            last_played=Max("created"),
        )
        .order_by("-last_played")
    )
    return [
        {
            **row,
            "in_progress": row["games"] - row["win"] - row["draw"] - row["loss"] - row["forfeit"],
        }
        for row in rows
    ]


def player_record(user, player: str) -> dict | None:
    return next((row for row in player_records(user) if row["player"] == player), None)
