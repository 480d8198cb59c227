"""What the Play page does: start a game, play the person's move, ask for the model's.

The model's move never runs in a request: `game_create` (when the model starts) and
`game_human_move` (when the game goes on) enqueue `workers.play_tasks.play_model_move`
on the `inference` queue once the transaction commits; the worker computes the move and
records it with `game_record_model_turn`, or the failure with `game_record_model_failure`.
Every change is made under a row lock and checked against the session in the database,
so a late or repeated task can never play twice or play over the person's move.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from rlcore.envs import load_environment
from rlcore.envs.tictactoe_play import PlaySession
from rlcore.types import SamplingParams
from webapp.jobs.models import ModelEntry
from webapp.jobs.selectors import models_for_user
from webapp.play.live import notify_game
from webapp.play.models import Game

PLAY_ENV = "tictactoe"
# The env's built-in players offered even when the user has not registered them.
BUILTIN_PLAYERS = ("oracle", "random")
# Play is greedy unless the model's own generation defaults say otherwise: a person
# playing wants the model's best move, not a sample.
# 96 tokens hold the longest well-formed reply ("<think>Empty: ... Win: ... Block: ...
# </think><move>N</move>", ~80 characters of the tiny model's tokenizer); a rambling
# model is cut there rather than keeping a person waiting.
PLAY_SAMPLING = {"temperature": 0.0, "top_p": 1.0, "max_tokens": 96}
MAX_ATTEMPTS = 3


@dataclass(frozen=True)
class Player:
    """Someone a person can play against: a registered model or a built-in player."""

    key: str
    name: str
    kind: str
    policy: dict
    sampling: dict
    model: ModelEntry | None = field(default=None, compare=False)


def _builtin_names() -> set[str]:
    return set(load_environment(PLAY_ENV).builtin_policies())


def player_for_model(model: ModelEntry) -> Player:
    sampling = dict(PLAY_SAMPLING)
    sampling |= {k: v for k, v in (model.generation or {}).items() if k in PLAY_SAMPLING}
    policy = {"kind": model.kind, **model.policy_args()}
    return Player(
        key=f"model-{model.pk}",
        name=model.name,
        kind=model.kind,
        policy=policy,
        sampling=sampling,
        model=model,
    )


def players_for_user(user) -> list[Player]:
    """The user's models that can play tic-tac-toe, then the built-in players the user
    has not registered under a name of their own."""
    offered = _builtin_names()
    players, registered = [], set()
    for model in models_for_user(user).order_by("name"):
        if model.kind == ModelEntry.Kind.BUILTIN:
            if model.location not in offered:
                continue  # another environment's player
            registered.add(model.location)
        players.append(player_for_model(model))
    for name in BUILTIN_PLAYERS:
        if name not in registered:
            players.append(
                Player(
                    key=f"builtin-{name}",
                    name=f"{name} (built-in)",
                    kind=ModelEntry.Kind.BUILTIN,
                    policy={"kind": ModelEntry.Kind.BUILTIN, "model": name},
                    sampling=dict(PLAY_SAMPLING),
                )
            )
    return players


def player_lookup(*, user, key: str) -> Player:
    for player in players_for_user(user):
        if player.key == key:
            return player
    accepted = ", ".join(p.key for p in players_for_user(user))
    raise ValidationError({"player": f"no player {key!r} among yours; accepted: {accepted}"})


def _state_from(game: Game, session: PlaySession) -> None:
    """Copy the session into the row, with the status and outcome that follow from it."""
    game.session = session.to_dict()
    if session.finished:
        game.status = Game.Status.FINISHED
        game.outcome = session.outcome
        game.finished = game.finished or timezone.now()
    elif session.to_move == "model":
        game.status = Game.Status.MODEL_TURN
    else:
        game.status = Game.Status.HUMAN_TURN


def _request_model_move(game: Game) -> None:
    """Queue the model's move for after the commit (a worker never sees a rolled-back row)."""
    from workers.play_tasks import play_model_move

    game.task_id = str(uuid.uuid4())
    game_id, task_id = game.pk, game.task_id
    transaction.on_commit(
        lambda: play_model_move.apply_async(args=[game_id], queue="inference", task_id=task_id)
    )


def _notify_on_commit(game: Game) -> None:
    game_id, status, moves, data = game.pk, game.status, len(game.moves), game.to_dict()
    transaction.on_commit(lambda: notify_game(game_id, status=status, moves=moves, data=data))


def game_create(
    *, owner, player_key: str, human_mark: str, human_starts: bool, seed: int | None = None
) -> Game:
    """A new game against `player_key`; the model's first move is queued if it starts."""
    player = player_lookup(user=owner, key=player_key)
    if human_mark not in ("X", "O"):
        raise ValidationError({"human_mark": f"play X or O, got {human_mark!r}"})
    model_mark = "O" if human_mark == "X" else "X"
    session = PlaySession.new(model_mark, not human_starts, seed=seed)
    with transaction.atomic():
        game = Game(
            owner=owner,
            model=player.model,
            player=player.key,
            player_name=player.name,
            policy=player.policy,
            sampling=player.sampling,
            max_attempts=MAX_ATTEMPTS,
            model_mark=model_mark,
            model_starts=not human_starts,
        )
        _state_from(game, session)
        game.save()
        if game.status == Game.Status.MODEL_TURN:
            _request_model_move(game)
            game.save(update_fields=["task_id"])
    return game


def game_human_move(*, game: Game, cell) -> Game:
    """Play the person's mark on `cell`; ValidationError({"cell": why}) when it may not be
    played now (taken, off the board, not their turn, game over)."""
    with transaction.atomic():
        locked = Game.objects.select_for_update().get(pk=game.pk)
        if locked.status == Game.Status.MODEL_TURN:
            raise ValidationError(
                {"cell": f"wait for {locked.player_name}: it is still thinking about its move"}
            )
        session = locked.play_session()
        try:
            session.human_move(cell)
        except ValueError as exc:
            raise ValidationError({"cell": str(exc)}) from None
        _state_from(locked, session)
        locked.error = ""
        if locked.status == Game.Status.MODEL_TURN:
            _request_model_move(locked)
        locked.save()
        _notify_on_commit(locked)
    return locked


def game_retry_model(*, game: Game) -> Game:
    """Ask the model again after its worker could not (endpoint down, model missing)."""
    with transaction.atomic():
        locked = Game.objects.select_for_update().get(pk=game.pk)
        if locked.status != Game.Status.MODEL_FAILED:
            raise ValidationError(
                f"game {locked.pk} is {locked.get_status_display()}; only a game whose model "
                "could not be asked can be retried"
            )
        locked.status = Game.Status.MODEL_TURN
        locked.error = ""
        _request_model_move(locked)
        locked.save()
        _notify_on_commit(locked)
    return locked


def game_sampling(game: Game) -> SamplingParams:
    return SamplingParams(**{k: v for k, v in game.sampling.items() if k in PLAY_SAMPLING})


def game_record_model_turn(
    *, game_id: int, moves_before: int, session: PlaySession, replies: list[dict]
) -> Game | None:
    """Store the model's turn, computed on a session that had `moves_before` moves; None
    (nothing stored) when the game has moved on since, e.g. a task delivered twice."""
    with transaction.atomic():
        locked = Game.objects.select_for_update().filter(pk=game_id).first()
        if locked is None:
            return None
        current = locked.play_session()
        if len(current.moves) != moves_before or current.to_move != "model":
            return None
        _state_from(locked, session)
        locked.replies = [*locked.replies, *replies]
        locked.error = ""
        locked.save()
        _notify_on_commit(locked)
    return locked


def game_record_model_failure(*, game_id: int, moves_before: int, error: str) -> Game | None:
    """Mark the game as waiting on a model that could not be asked, with the reason."""
    with transaction.atomic():
        locked = Game.objects.select_for_update().filter(pk=game_id).first()
        if locked is None or len(locked.moves) != moves_before:
            return None
        if locked.status != Game.Status.MODEL_TURN:
            return None
        locked.status = Game.Status.MODEL_FAILED
        locked.error = error
        locked.save()
        _notify_on_commit(locked)
    return locked
