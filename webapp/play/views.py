"""The Play pages and their JSON endpoints. Each view validates, calls one service or
selector, and renders.

Pages: /play/ (a new game, your recent games), /play/games/<id>/ (the board; plain form
posts work without JavaScript, play.js makes it live), /play/history/ (win/draw/loss per
model) and /play/history/<player>/ (the finished games against one model, each a replay).
JSON: POST /play/api/games/ creates a game, GET /play/api/games/<id>/ reads it, POST
/play/api/games/<id>/move/ plays a cell and /retry/ asks a failed model again. Errors are
JSON like the jobs API: 401 without a login, 404 for a game that is not yours, 400 with
{"errors": {field: [messages]}}. A person sees only their own games.
"""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import ValidationError
from django.http import Http404, JsonResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.http import require_GET, require_POST

from webapp.jobs.api import api_view
from webapp.jobs.validation import json_body, validation_response
from webapp.play import selectors, services
from webapp.play.forms import MoveForm, NewGameForm
from webapp.play.models import Game

RECENT_GAMES = 10


def _board_rows(game: Game) -> list[list[dict]]:
    board, line = game.board, game.winning_line
    return [
        [{"cell": i, "mark": board[i], "win": i in line} for i in range(row, row + 3)]
        for row in (0, 3, 6)
    ]


def _game_context(game: Game) -> dict:
    turns: dict[int, list[dict]] = {}
    for reply in game.replies:
        turns.setdefault(reply["move_number"], []).append(reply)
    return {
        "game": game,
        "rows": _board_rows(game),
        "last_cell": game.moves[-1]["cell"] if game.moves else None,
        "turns": sorted(turns.items()),
        "live": {
            "game": game.pk,
            "api": reverse("play:api_game", args=[game.pk]),
            "move": reverse("play:api_move", args=[game.pk]),
            "ws": f"/ws/play/{game.pk}/",
            "status": game.status,
        },
    }


def _message(exc: ValidationError) -> str:
    return "; ".join(exc.messages)


# ---------------------------------------------------------------------------------------
# Pages


@login_required
def home(request):
    form = NewGameForm(request.POST or None, user=request.user)
    if request.method == "POST" and form.is_valid():
        try:
            game = services.game_create(owner=request.user, **form.create_args())
        except ValidationError as exc:
            form.add_error(None, _message(exc))
        else:
            return redirect(game)
    return render(
        request,
        "play/home.html",
        {
            "form": form,
            "games": selectors.games_for_user(request.user)[:RECENT_GAMES],
            "records": selectors.player_records(request.user),
        },
    )


@login_required
def game_detail(request, pk: int):
    game = selectors.game_for_user(request.user, pk)
    return render(request, "play/game.html", _game_context(game))


@login_required
@require_POST
def game_move(request, pk: int):
    """The board's plain form post (the page without JavaScript)."""
    game = selectors.game_for_user(request.user, pk)
    form = MoveForm(request.POST)
    if not form.is_valid():
        messages.error(request, f"Not a cell: {request.POST.get('cell')!r}; pick 0-8.")
    else:
        try:
            services.game_human_move(game=game, cell=form.cleaned_data["cell"])
        except ValidationError as exc:
            messages.error(request, _message(exc))
    return redirect(game)


@login_required
@require_POST
def game_retry(request, pk: int):
    game = selectors.game_for_user(request.user, pk)
    try:
        services.game_retry_model(game=game)
    except ValidationError as exc:
        messages.error(request, _message(exc))
    return redirect(game)


@login_required
def history(request):
    return render(request, "play/history.html", {"records": selectors.player_records(request.user)})


@login_required
def player_history(request, player: str):
    record = selectors.player_record(request.user, player)
    if record is None:
        raise Http404(f"you have no games against {player!r}")
    games = selectors.games_for_user(request.user).filter(player=player)
    finished = [
        {"game": game, "rows": _board_rows(game)}
        for game in games.filter(status=Game.Status.FINISHED)
    ]
    return render(
        request,
        "play/player_history.html",
        {
            "record": record,
            "finished": finished,
            "playing": games.exclude(status=Game.Status.FINISHED),
        },
    )


# ---------------------------------------------------------------------------------------
# JSON


@require_POST
@api_view
def api_games(request):
    """Create a game: {"player": key, "human_mark": "X"|"O", "human_starts": bool}."""
    try:
        body = json_body(request)
        human_starts = body.get("human_starts", True)
        if not isinstance(human_starts, bool):
            raise ValidationError({"human_starts": f"expected true or false, got {human_starts!r}"})
        game = services.game_create(
            owner=request.user,
            player_key=str(body.get("player", "")),
            human_mark=str(body.get("human_mark", "X")),
            human_starts=human_starts,
        )
    except ValidationError as exc:
        return validation_response(exc)
    return JsonResponse(game.to_dict(), status=201)


@require_GET
@api_view
def api_game(request, pk: int):
    return JsonResponse(selectors.game_for_user(request.user, pk).to_dict())


@require_POST
@api_view
def api_move(request, pk: int):
    """Play a cell: {"cell": 0-8}. The reply is the game after the move; the model's
    answer follows over the websocket (or by polling the game)."""
    game = selectors.game_for_user(request.user, pk)
    try:
        cell = json_body(request).get("cell")
        game = services.game_human_move(game=game, cell=cell)
    except ValidationError as exc:
        return validation_response(exc)
    return JsonResponse(game.to_dict())


@require_POST
@api_view
def api_retry(request, pk: int):
    game = selectors.game_for_user(request.user, pk)
    try:
        game = services.game_retry_model(game=game)
    except ValidationError as exc:
        return validation_response(exc)
    return JsonResponse(game.to_dict())
