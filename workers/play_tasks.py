"""The Play page's worker side: compute the model's move in a game, on the `inference` queue.

`play_model_move(game_id)` loads the PlaySession from the Game row, loads the policy, lets
it play its turn as the environment would (invalid replies retried and counted, a forfeit
after the game's max attempts), and stores the result with every reply the model gave,
then tells the page through the game's channel group. A model that cannot be asked (an
endpoint down, a checkpoint gone) marks the game so the page can say why and offer a retry.

Loading a local model takes seconds and a game asks it for a move every few, so each
worker process keeps the last few local models it loaded, keyed by their path. Built-in
players are made fresh (they cost nothing) and so are endpoint clients. With
INFERENCE_ENGINE=vllm (GPU nodes) a local model is served by `vllm serve` instead, the
last few servers kept running (workers/engines.py), and reached as an endpoint.

Every move of a worker process runs on one event loop of its own (a daemon thread), so
with a thread pool (`-P threads`, as `make run` starts the inference worker) the moves of
games played at once reach a local model together and are generated as one batch: twenty
games cost about what one does, instead of queueing behind each other.
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict

from celery.utils.log import get_task_logger
from django.db import close_old_connections

from rlcore.envs import load_environment
from rlcore.envs.tictactoe_game import parse_move
from rlcore.parsers import ThinkParser
from rlcore.policy import Policy, load_policy
from rlcore.policy.openai_client import OpenAIPolicy
from webapp.jobs.models import ApiKey
from webapp.play import services
from webapp.play.models import Game
from workers.celery import app
from workers.engines import play_engine, play_servers
from workers.sink import json_safe, text_safe

logger = get_task_logger(__name__)

LOCAL_MODELS_KEPT = 3
LOCAL_KINDS = ("tiny", "hf", "checkpoint")

_local_models: OrderedDict[str, Policy] = OrderedDict()
_local_lock = threading.Lock()
_think_parser = ThinkParser()
_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def play_loop() -> asyncio.AbstractEventLoop:
    """The event loop every move of this process runs on (started on first use)."""
    global _loop
    with _loop_lock:
        if _loop is None or _loop.is_closed():
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="play-loop", daemon=True).start()
        return _loop


def policy_for(policy: dict) -> Policy:
    """The policy a game's `policy` field names; local models come from the cache."""
    model = policy["model"]
    if policy.get("kind") == "openai":
        api_key_env = policy.get("api_key_env") or ""
        # A key only goes to the endpoint staff declared it for, whatever the game row says.
        ApiKey.check_use(base_url=policy.get("base_url"), env_var=api_key_env)
        # One quick retry: a person is waiting, and can ask again from the page.
        return load_policy(
            model, base_url=policy.get("base_url"), api_key_env=api_key_env, max_retries=1
        )
    if policy.get("kind") not in LOCAL_KINDS:
        return load_policy(model, env=load_environment(services.PLAY_ENV))
    engine, why = play_engine()
    if engine == "vllm":
        return play_servers.policy(model)
    if why:
        logger.warning("play: INFERENCE_ENGINE=vllm, moves run on the local engine: %s", why)
    with _local_lock:
        if model in _local_models:
            _local_models.move_to_end(model)
            return _local_models[model]
        loaded = load_policy(model)
        _local_models[model] = loaded
        while len(_local_models) > LOCAL_MODELS_KEPT:
            evicted, _ = _local_models.popitem(last=False)
            logger.info("play: dropped %s from the model cache", evicted)
        return loaded


def replies_from(new_messages: list[dict], board: list[str], *, move_number: int) -> list[dict]:
    """Each reply the model gave in one turn, numbered, with its reasoning and what was
    wrong with it; `board` is the board the turn started from (invalid replies leave it
    as it is, so every reply of the turn is judged against it)."""
    replies = []
    for message in new_messages:
        if message.get("role") != "assistant":
            continue
        text = text_safe(message.get("content") or "")
        cell, error = parse_move(text, board)
        replies.append(
            {
                "move_number": move_number,
                "attempt": len(replies) + 1,
                "text": text,
                "think": _think_parser.think(text),
                "move": cell,
                "valid": error is None,
                "error": error,
            }
        )
    return replies


async def _model_turn(session, policy: Policy, game: Game) -> dict:
    try:
        return await session.model_turn(
            policy, services.game_sampling(game), max_attempts=game.max_attempts
        )
    finally:
        # An endpoint client's connections belong to this task's event loop.
        close = getattr(policy, "aclose", None)
        if close is not None and isinstance(policy, OpenAIPolicy):
            await close()


@app.task(name="workers.play_tasks.play_model_move")
def play_model_move(game_id: int) -> str:
    """Play the model's turn in game `game_id`; returns what happened."""
    close_old_connections()
    game = Game.objects.filter(pk=game_id).first()
    if game is None:
        logger.warning("play: game %s does not exist (deleted before its move)", game_id)
        return "missing"
    session = game.play_session()
    if game.status != Game.Status.MODEL_TURN or session.to_move != "model":
        return "skipped"  # delivered twice, or the game moved on
    moves_before = len(session.moves)
    messages_before = len(session.messages)
    board_before = list(session.board)
    try:
        policy = policy_for(game.policy)
        asyncio.run_coroutine_threadsafe(_model_turn(session, policy, game), play_loop()).result()
    except Exception as exc:
        logger.exception("play: game %s: the model could not move", game_id)
        services.game_record_model_failure(
            game_id=game_id,
            moves_before=moves_before,
            error=text_safe(f"{type(exc).__name__}: {exc}"),
        )
        return "failed"
    replies = replies_from(
        session.messages[messages_before:], board_before, move_number=moves_before + 1
    )
    # The session's JSON goes into PostgreSQL, which refuses NUL characters in text.
    clean = type(session).from_dict(json_safe(session.to_dict()))
    stored = services.game_record_model_turn(
        game_id=game_id, moves_before=moves_before, session=clean, replies=replies
    )
    return "stale" if stored is None else stored.status
