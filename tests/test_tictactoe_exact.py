"""The exact walk of a greedy tic-tac-toe player (rlcore/envs/tictactoe_exact.py): the
oracle's known result, and a player stuck on an invalid move."""

import asyncio

from rlcore.envs import load_environment
from rlcore.envs.tictactoe_exact import SEATINGS, Walk, ask_moves, exact_rates
from rlcore.envs.tictactoe_game import win_chance_after
from rlcore.envs.tictactoe_players import OraclePolicy
from rlcore.policy.base import ConstantPolicy
from rlcore.train.select import score


def test_the_oracle_wins_its_known_share_and_never_loses():
    rates = asyncio.run(exact_rates(OraclePolicy()))
    # First: the oracle's opening move, followed by its own play, wins this often.
    first = max(win_chance_after("." * 9, cell, "X") for cell in range(9))
    walk_first = Walk({}, {})  # no recorded move: the oracle's own moves everywhere
    assert abs(float(walk_first.outcome("X", True)["win"]) - float(first)) < 1e-12
    assert abs(rates["random"]["win"] - 0.956) < 0.001
    assert rates["random"]["loss"] == 0.0 and rates["random"]["unfinished"] == 0.0
    assert rates["optimal"] == {
        "win": 0.0, "draw": 1.0, "loss": 0.0, "unfinished": 0.0, "invalid_move_rate": 0.0
    }  # fmt: skip
    # ~2,000 histories for a player that always moves legally, each asked once.
    assert 1000 < rates["questions"] < 3000


def test_a_player_stuck_on_an_occupied_cell_leaves_every_game_unfinished():
    moves, invalid, asked = asyncio.run(ask_moves(ConstantPolicy(), max_turns=6, max_tokens=64))
    rates = asyncio.run(exact_rates(ConstantPolicy()))
    assert rates["random"]["unfinished"] == 1.0 and rates["optimal"]["unfinished"] == 1.0
    # It plays 4 where it is empty, then asks again on the same board until its 6 turns are
    # spent: every history ends without a valid move.
    assert set(moves.values()) <= {4, None} and None in moves.values()
    assert asked == rates["questions"]
    # Its replies after the first are all invalid: 5 of 6 where it moved first (4 empty),
    # 6 of 6 where the opponent had taken 4 first.
    assert sum(invalid.values()) > 0
    assert 5 / 6 - 1e-9 <= rates["random"]["invalid_move_rate"] <= 1.0
    starts = [key for key in moves if key[2] == ()]
    assert {(mark, first) for mark, first, _ in starts} == {s for s in SEATINGS if s[1]}


def test_the_env_gives_its_validation_sets_exactly_in_their_metric_names():
    env = load_environment("tictactoe", max_turns=6)
    exact = asyncio.run(env.exact_validation(OraclePolicy(), max_tokens=64))
    validation = env.validation()
    assert set(exact) == {part.name for part in validation}
    for part in validation:  # every metric the choice rule weighs is there
        assert set(part.weights) <= set(exact[part.name])
    # The choice rule on the oracle: every game drawn against the perfect player, its
    # known share won against random, nothing lost, no invalid move.
    assert abs(score(exact, validation) - (1.0 + exact["random"]["outcome/win"])) < 1e-12
    assert abs(exact["random"]["outcome/win"] - 0.956) < 0.001
