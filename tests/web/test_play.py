"""The Play page: who can be played, moves checked by the server, the model's move made
by the real Celery worker on the inference queue and announced on the game's websocket,
invalid replies retried and forfeited, failures recorded, and the per-model history."""

import time

import pytest
from asgiref.sync import async_to_sync
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.db import connection
from django.test import Client

from rlcore.envs.tictactoe_play import PlaySession
from tests.lab_fixtures import refused
from webapp.asgi import application
from webapp.jobs import services as job_services
from webapp.play import services
from webapp.play.live import notify_game
from webapp.play.models import Game
from workers.play_tasks import play_model_move

API = "/play/api/games/"


def create(client, **body):
    return client.post(API, body, content_type="application/json")


def move(client, game_id, cell):
    return client.post(f"{API}{game_id}/move/", {"cell": cell}, content_type="application/json")


def wait_for_game(game_id, statuses, timeout=120.0) -> Game:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        game = Game.objects.get(pk=game_id)
        if game.status in statuses:
            return game
        time.sleep(0.1)
    raise AssertionError(f"game {game_id} still {game.status} after {timeout}s: {game.error}")


def board_from(moves) -> list[str]:
    board = ["."] * 9
    for m in moves:
        board[m["cell"]] = m["mark"]
    return board


# ---------------------------------------------------------------------------------------
# Players, creating games, checking moves (no worker: nothing is committed, so nothing
# is enqueued)


@pytest.mark.django_db
def test_players_are_your_models_and_the_builtins_you_have_not_registered(alice, oracle, tiny, bob):
    const = job_services.model_create(owner=alice, name="c", kind="builtin", location="constant")
    job_services.model_create(owner=bob, name="bobs", kind="tiny")
    keys = {p.key: p for p in services.players_for_user(alice)}
    # The oracle is registered as "oracle" already, so only "random" is added.
    assert set(keys) == {
        f"model-{oracle.pk}", f"model-{tiny.pk}", f"model-{const.pk}", "builtin-random"
    }  # fmt: skip
    assert keys[f"model-{oracle.pk}"].model == oracle
    assert keys[f"model-{tiny.pk}"].sampling["temperature"] == 0.0
    assert keys["builtin-random"].policy == {"kind": "builtin", "model": "random"}
    assert not any(p.name == "bobs" for p in keys.values())


@pytest.mark.django_db
def test_generation_defaults_of_the_model_win_over_greedy_play(alice):
    entry = job_services.model_create(
        owner=alice, name="warm", kind="tiny", generation={"temperature": 0.7, "max_tokens": 16}
    )
    player = services.player_lookup(user=alice, key=f"model-{entry.pk}")
    assert player.sampling == {"temperature": 0.7, "top_p": 1.0, "max_tokens": 16}


@pytest.mark.django_db
def test_creating_a_game_through_the_api(alice_client, alice):
    response = create(alice_client, player="builtin-oracle", human_mark="O", human_starts=True)
    assert response.status_code == 201, response.content
    data = response.json()
    assert data["model_mark"] == "X" and data["human_mark"] == "O" and not data["model_starts"]
    assert data["status"] == "human_turn" and data["board"] == ["."] * 9
    game = Game.objects.get(pk=data["id"])
    assert game.owner == alice and game.player == "builtin-oracle" and game.model is None
    assert game.session["messages"][0]["role"] == "system"


@pytest.mark.django_db
def test_a_game_where_the_model_starts_is_waiting_for_the_model(alice_client, oracle):
    data = create(
        alice_client, player=f"model-{oracle.pk}", human_mark="O", human_starts=False
    ).json()
    game = Game.objects.get(pk=data["id"])
    assert game.status == "model_turn" and game.task_id and game.model == oracle
    assert "is thinking" in data["status_text"]


@pytest.mark.django_db
def test_bad_create_requests_name_the_field(alice_client):
    response = create(alice_client, player="model-999999", human_mark="X")
    assert response.status_code == 400
    assert "no player 'model-999999'" in response.json()["errors"]["player"][0]
    response = create(alice_client, player="builtin-random", human_mark="Z")
    assert response.json()["errors"]["human_mark"] == ["play X or O, got 'Z'"]
    response = create(alice_client, player="builtin-random", human_starts="yes")
    assert "expected true or false" in response.json()["errors"]["human_starts"][0]


@pytest.mark.django_db
def test_the_server_refuses_taken_cells_off_board_cells_and_moves_out_of_turn(alice_client):
    game_id = create(alice_client, player="builtin-random", human_mark="X").json()["id"]
    response = move(alice_client, game_id, 4)
    assert response.status_code == 200 and response.json()["board"][4] == "X"
    assert response.json()["status"] == "model_turn"
    # The model has not answered (no worker here): it is not the person's turn.
    response = move(alice_client, game_id, 0)
    assert response.status_code == 400
    assert "still thinking" in response.json()["errors"]["cell"][0]
    # Once it is the person's turn again, a taken cell or a cell off the board is refused.
    game = Game.objects.get(pk=game_id)
    session = game.play_session()
    session.moves.append({"player": "model", "mark": "O", "cell": 0})
    session.board[0] = "O"
    services._state_from(game, session)
    game.save()
    response = move(alice_client, game_id, 4)
    assert response.status_code == 400
    assert response.json()["errors"]["cell"] == [
        "cell 4 is taken by X; empty: [1, 2, 3, 5, 6, 7, 8]"
    ]
    assert move(alice_client, game_id, 9).json()["errors"]["cell"][0].startswith("cell must be")
    assert move(alice_client, game_id, None).status_code == 400
    assert Game.objects.get(pk=game_id).moves == [
        {"player": "opponent", "mark": "X", "cell": 4},
        {"player": "model", "mark": "O", "cell": 0},
    ]


@pytest.mark.django_db
def test_the_plain_form_post_shows_the_error_on_the_page(alice_client):
    game_id = create(alice_client, player="builtin-random", human_mark="X").json()["id"]
    alice_client.post(f"/play/games/{game_id}/move/", {"cell": "4"})
    response = alice_client.post(f"/play/games/{game_id}/move/", {"cell": "4"}, follow=True)
    assert response.status_code == 200
    assert "still thinking" in response.content.decode()
    page = alice_client.get(f"/play/games/{game_id}/").content.decode()
    assert 'data-testid="cell-4"' in page and 'data-mark="X"' in page


@pytest.mark.django_db
def test_the_new_game_form_creates_a_game_and_opens_its_board(alice_client, oracle):
    page = alice_client.get("/play/").content.decode()
    assert "oracle (built-in player)" in page and "random (built-in)" in page
    response = alice_client.post(
        "/play/", {"player": f"model-{oracle.pk}", "human_mark": "X", "starts": "human"}
    )
    game = Game.objects.get()
    assert response.status_code == 302 and response.url == f"/play/games/{game.pk}/"
    assert game.model_mark == "O" and game.status == "human_turn"
    response = alice_client.post(
        "/play/", {"player": "nobody", "human_mark": "X", "starts": "human"}
    )
    assert response.status_code == 200 and "Select a valid choice" in response.content.decode()


@pytest.mark.django_db
def test_only_the_owner_reaches_a_game(alice_client, bob_client):
    game_id = create(alice_client, player="builtin-random", human_mark="X").json()["id"]
    for url in (f"/play/games/{game_id}/", f"{API}{game_id}/"):
        assert alice_client.get(url).status_code == 200
        assert bob_client.get(url).status_code == 404
    assert move(bob_client, game_id, 0).status_code == 404
    assert Client().get(f"{API}{game_id}/").status_code == 401
    assert Client().get(f"/play/games/{game_id}/").status_code == 302  # to the login page
    assert bob_client.get("/play/history/builtin-random/").status_code == 404


@pytest.mark.django_db(transaction=True)
def test_the_task_plays_the_models_turn_once(alice):
    """The worker's task, run in-process: one valid oracle move with its reasoning; a
    second delivery of the same task changes nothing."""
    # Made by hand rather than by game_create, so that no task is queued for a worker.
    game = Game(owner=alice, player="builtin-oracle", player_name="oracle (built-in)",
                policy={"kind": "builtin", "model": "oracle"}, sampling=services.PLAY_SAMPLING,
                model_mark="X", model_starts=True)  # fmt: skip
    services._state_from(game, PlaySession.new("X", True, seed=3))
    game.save()
    game_id = game.pk
    assert play_model_move(game_id) == "human_turn"
    game = Game.objects.get(pk=game_id)
    assert len(game.moves) == 1 and game.moves[0]["player"] == "model"
    [reply] = game.replies
    assert reply["valid"] and reply["move"] == game.moves[0]["cell"] and reply["move_number"] == 1
    assert reply["think"].startswith("Empty: 0 1 2 3 4 5 6 7 8.")
    assert play_model_move(game_id) == "skipped"
    assert Game.objects.get(pk=game_id).moves == game.moves
    # A result computed on a board that has moved on is not stored.
    assert (
        services.game_record_model_turn(
            game_id=game_id, moves_before=0, session=game.play_session(), replies=[]
        )
        is None
    )


# ---------------------------------------------------------------------------------------
# The websocket


@database_sync_to_async
def _game_and_cookies():
    from django.contrib.auth import get_user_model

    User = get_user_model()
    alice = User.objects.create_user("alice", password="pw")
    bob = User.objects.create_user("bob", password="pw")
    game = services.game_create(
        owner=alice, player_key="builtin-random", human_mark="X", human_starts=True
    )
    cookies = {}
    for user in (alice, bob):
        client = Client()
        client.force_login(user)
        cookies[user.username] = f"sessionid={client.cookies['sessionid'].value}".encode()
    return game, cookies


def _socket(game_id: int, cookie: bytes | None) -> WebsocketCommunicator:
    headers = [(b"origin", b"http://localhost"), (b"host", b"localhost")]
    if cookie:
        headers.append((b"cookie", cookie))
    return WebsocketCommunicator(application, f"/ws/play/{game_id}/", headers=headers)


@pytest.mark.django_db(transaction=True)
async def test_only_the_owner_may_open_the_games_socket_and_it_hears_updates():
    game, cookies = await _game_and_cookies()
    assert await refused(_socket(game.pk, None)) == 4401
    assert await refused(_socket(game.pk, cookies["bob"])) == 4403
    owner = _socket(game.pk, cookies["alice"])
    connected, _ = await owner.connect()
    assert connected
    assert await owner.receive_json_from(timeout=5) == {"type": "hello", "game": game.pk}
    await database_sync_to_async(notify_game)(game.pk, status="human_turn", moves=2)
    message = await owner.receive_json_from(timeout=5)
    assert message == {"type": "game.update", "game": game.pk, "status": "human_turn", "moves": 2}
    data = await database_sync_to_async(lambda: Game.objects.get(pk=game.pk).to_dict())()
    await database_sync_to_async(notify_game)(game.pk, status="human_turn", moves=2, data=data)
    message = await owner.receive_json_from(timeout=5)
    assert message["data"] == data and message["data"]["id"] == game.pk
    await owner.disconnect()


# ---------------------------------------------------------------------------------------
# With the real worker


def _listen(game_id: int):
    """A plain channel in the game's group on the real Redis layer."""
    from channels.layers import get_channel_layer

    layer = get_channel_layer()
    channel = async_to_sync(layer.new_channel)()
    async_to_sync(layer.group_add)(f"play-{game_id}", channel)
    return layer, channel


@pytest.mark.django_db(transaction=True)
@pytest.mark.worker
def test_a_whole_game_against_the_oracle_on_the_worker(alice_client, oracle, celery_worker):
    game_id = create(
        alice_client, player=f"model-{oracle.pk}", human_mark="O", human_starts=False
    ).json()["id"]
    layer, channel = _listen(game_id)
    for turn in range(5):
        game = wait_for_game(game_id, ("human_turn", "finished"), timeout=60)
        if turn == 0:
            # The worker announced its move on the game's group.
            message = async_to_sync(layer.receive)(channel)
            assert message["type"] == "game.update" and message["game"] == game_id
            # ...with the game as committed: the page need not read it again.
            assert message["data"]["moves"] == game.moves
            assert message["data"]["status"] == game.status
        if game.status == "finished":
            break
        data = alice_client.get(f"{API}{game_id}/").json()
        assert data["status"] == "human_turn" and data["board"] == board_from(data["moves"])
        cell = data["board"].index(".")
        assert move(alice_client, game_id, cell).status_code == 200
    game = Game.objects.get(pk=game_id)
    assert game.status == "finished" and game.finished
    assert game.outcome in ("win", "draw"), game.moves  # the oracle never loses
    assert game.board == board_from(game.moves) and game.session["board"] == game.board
    model_moves = [m for m in game.moves if m["player"] == "model"]
    assert [r["move"] for r in game.replies] == [m["cell"] for m in model_moves]
    assert all(r["valid"] and r["think"].startswith("Empty:") for r in game.replies)
    assert game.result_text in ("oracle won.", "Draw.")
    assert celery_worker["log"].read_text().count("workers.play_tasks.play_model_move") >= 2


@pytest.mark.django_db(transaction=True)
@pytest.mark.worker
def test_a_whole_game_against_the_shipped_player_on_the_worker(alice_client, alice, celery_worker):
    master = job_services.model_create(
        owner=alice, name="tiny-master", kind="tiny", location="tiny-master"
    )
    game_id = create(
        alice_client, player=f"model-{master.pk}", human_mark="X", human_starts=True
    ).json()["id"]
    for _ in range(5):
        data = alice_client.get(f"{API}{game_id}/").json()
        if data["status"] == "finished":
            break
        assert move(alice_client, game_id, data["board"].index(".")).status_code == 200
        wait_for_game(game_id, ("human_turn", "finished"), timeout=120)
    game = Game.objects.get(pk=game_id)
    assert game.status == "finished" and game.outcome in ("win", "draw", "loss"), game.error
    # The trained player answers in the env's format, its think block empty as in the games
    # it learnt from (recipes/tictactoe_tiny/synth.toml), and plays legal moves (the
    # untrained tiny model forfeits: the test below).
    valid = [r for r in game.replies if r["valid"]]
    assert len(valid) >= 2 and all(r["text"].startswith("<think></think><move>") for r in valid)
    assert [m["cell"] for m in game.moves if m["player"] == "model"] == [r["move"] for r in valid]


@pytest.mark.django_db(transaction=True)
@pytest.mark.worker
def test_the_tiny_model_forfeits_after_three_invalid_replies(alice_client, alice, celery_worker):
    tiny = job_services.model_create(
        owner=alice, name="tiny", kind="tiny", generation={"max_tokens": 12}
    )
    game_id = create(
        alice_client, player=f"model-{tiny.pk}", human_mark="X", human_starts=True
    ).json()["id"]
    assert move(alice_client, game_id, 4).status_code == 200
    game = wait_for_game(game_id, ("finished", "model_failed"), timeout=120)
    assert game.status == "finished", game.error
    assert game.outcome == "unfinished" and game.session["forfeited"] is True
    assert game.session["invalid_moves"] == 3 and game.invalid_replies == 3
    assert [r["attempt"] for r in game.replies] == [1, 2, 3]
    assert all(not r["valid"] and r["error"] and r["move_number"] == 2 for r in game.replies)
    assert "forfeited after 3 invalid replies" in game.result_text
    page = alice_client.get(f"/play/games/{game_id}/").content.decode()
    assert page.count('class="reply invalid"') == 3 and "raw reply" in page


@pytest.mark.django_db(transaction=True)
@pytest.mark.worker
def test_an_endpoint_that_does_not_answer_is_recorded_and_can_be_retried(
    alice_client, alice, celery_worker
):
    entry = job_services.model_create(
        owner=alice, name="down", kind="openai", location="nobody", base_url="http://127.0.0.1:9/v1"
    )
    game_id = create(
        alice_client, player=f"model-{entry.pk}", human_mark="O", human_starts=False
    ).json()["id"]
    game = wait_for_game(game_id, ("model_failed",), timeout=60)
    assert "127.0.0.1:9" in game.error and game.moves == []
    assert "could not be asked" in alice_client.get(f"{API}{game_id}/").json()["status_text"]
    response = alice_client.post(f"{API}{game_id}/retry/")
    assert response.status_code == 200 and response.json()["status"] == "model_turn"
    game = wait_for_game(game_id, ("model_failed",), timeout=60)
    assert game.error
    assert (
        alice_client.post(
            f"{API}{game_id}/move/", {"cell": 0}, content_type="application/json"
        ).status_code
        == 400
    )


# ---------------------------------------------------------------------------------------
# History


@pytest.mark.django_db
def test_the_history_counts_outcomes_from_the_models_view(alice, alice_client, oracle):
    def finished(outcome, player=f"model-{oracle.pk}", name="oracle"):
        return Game.objects.create(
            owner=alice, player=player, player_name=name, model_mark="X", model_starts=True,
            session={"board": list("XXXOO...."), "moves": []}, status="finished", outcome=outcome,
        )  # fmt: skip

    games = [
        finished("win"),
        finished("win"),
        finished("draw"),
        finished("loss"),
        finished("unfinished"),
    ]
    finished("draw", player="builtin-random", name="random (built-in)")
    Game.objects.create(owner=alice, player=f"model-{oracle.pk}", player_name="oracle",
                        model_mark="X", model_starts=True, session={}, status="human_turn")  # fmt: skip
    page = alice_client.get("/play/history/").content.decode()
    assert f'data-player="model-{oracle.pk}"' in page and 'data-player="builtin-random"' in page
    response = alice_client.get(f"/play/history/model-{oracle.pk}/")
    record = response.context["record"]
    assert (record["games"], record["win"], record["draw"], record["loss"], record["forfeit"]) == (
        6,
        2,
        1,
        1,
        1,
    )
    assert record["in_progress"] == 1
    listed = [item["game"].pk for item in response.context["finished"]]
    assert sorted(listed) == sorted(g.pk for g in games)
    body = response.content.decode()
    assert all(f'href="/play/games/{g.pk}/"' in body for g in games)


@pytest.mark.django_db(transaction=True)
def test_moves_of_games_played_at_once_are_generated_together(alice, default_tiny_model):
    """The inference worker runs its tasks in threads on one event loop, so a local
    model gets the moves of concurrent games in one batch; one after another, each move
    is a batch of its own (the control)."""
    from concurrent.futures import ThreadPoolExecutor

    from workers import play_tasks

    def games(count: int) -> list[int]:
        ids = []
        for index in range(count):
            game = Game(owner=alice, player="tiny", player_name="tiny",
                        policy={"kind": "tiny", "model": default_tiny_model},
                        sampling=services.PLAY_SAMPLING | {"max_tokens": 8},
                        model_mark="X", model_starts=True)  # fmt: skip
            services._state_from(game, PlaySession.new("X", True, seed=index))
            game.save()
            ids.append(game.pk)
        return ids

    engine = play_tasks.policy_for({"kind": "tiny", "model": default_tiny_model})
    batches, served = engine.batches_run, engine.requests_served
    for game_id in games(4):
        play_model_move(game_id)
    alone = (engine.batches_run - batches, engine.requests_served - served)
    assert alone[0] == alone[1] >= 4  # one batch per reply

    batches, served = engine.batches_run, engine.requests_served

    def task(game_id: int) -> str:  # as Celery runs it: the thread's connection closed after
        try:
            return play_model_move(game_id)
        finally:
            connection.close()

    with ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(task, games(8)))
    assert all(outcome in ("human_turn", "finished") for outcome in outcomes), outcomes
    together = (engine.batches_run - batches, engine.requests_served - served)
    assert together[1] >= 8 and together[0] < together[1] / 2, together
