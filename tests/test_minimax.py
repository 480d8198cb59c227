"""The tic-tac-toe search: board helpers, minimax against an independent brute force, the
oracle never losing anywhere in the game tree, and seeded tie-breaking that is uniform
over the best moves and repeatable per (seed, board)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore.envs.tictactoe_game import (
    empty_cells,
    game_over,
    game_value,
    minimax_best_moves,
    opponent_move,
    oracle_best_moves,
    other_mark,
    render_board,
    turn_seed,
    win_chance_after,
    winner,
)
from rlcore.envs.tictactoe_players import OraclePolicy
from rlcore.types import SamplingParams

# chi-square critical values at p = 0.001: a fair sampler fails once in a thousand seeds-sets
# (and the seeds here are fixed, so the test is deterministic).
CHI2_CRITICAL_0001 = {3: 16.27, 8: 26.12}


def chi_square(counts: Counter, cells: list[int]) -> float:
    total = sum(counts[cell] for cell in cells)
    expected = total / len(cells)
    return sum((counts[cell] - expected) ** 2 / expected for cell in cells)


def play(board: str, cell: int, mark: str) -> str:
    return board[:cell] + mark + board[cell + 1 :]


def brute_force_value(board: str, player: str) -> int:
    """Plain negamax with no memo and no depth scoring: an independent reference."""
    if winner(board) is not None:
        return -1
    cells = empty_cells(board)
    if not cells:
        return 0
    return max(-brute_force_value(play(board, cell, player), other_mark(player)) for cell in cells)


def reachable_positions() -> dict[str, str]:
    """Every position reachable in a game that either mark may start -> the mark to move."""
    positions: dict[str, str] = {}

    def visit(board: str, to_move: str) -> None:
        if board + to_move in positions or game_over(board):
            return
        positions[board + to_move] = to_move
        for cell in empty_cells(board):
            visit(play(board, cell, to_move), other_mark(to_move))

    visit("." * 9, "X")
    visit("." * 9, "O")
    return positions


def test_winner_finds_every_line_and_nothing_else():
    lines = [(0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6)]
    for line in lines:
        board = ["."] * 9
        for cell in line:
            board[cell] = "O"
        assert winner(board) == "O"
    assert winner("XOXXOOOXX") is None
    assert winner("." * 9) is None


def test_board_helpers_read_lists_and_strings_alike():
    board = ["X", ".", "O", ".", "X", ".", ".", ".", "O"]
    assert empty_cells(board) == [1, 3, 5, 6, 7]
    assert empty_cells("".join(board)) == [1, 3, 5, 6, 7]
    assert render_board(board) == "X1O\n3X5\n67O"


@pytest.mark.parametrize("bad_board", ["X" * 8, "XO.XO.XOZ", ["X", "O"], "x........"])
def test_bad_boards_are_rejected_with_the_value(bad_board):
    with pytest.raises(ValueError, match="9 cells") as error:
        winner(bad_board)
    assert repr(bad_board) in str(error.value)


def test_bad_mark_and_finished_board_are_rejected():
    with pytest.raises(ValueError, match="'X' or 'O', got 'Z'"):
        minimax_best_moves("." * 9, "Z")
    with pytest.raises(ValueError, match="over"):
        minimax_best_moves("XXXOO....", "O")


def test_minimax_takes_the_fastest_win_and_the_slowest_loss():
    # X wins at once on 2, but 4, 5, 7 and 8 also win, later: only 2 is "best".
    board = "XX.O..O.."
    slower_wins = [c for c in (4, 5, 7, 8) if game_value(play(board, c, "X"), "O") == -1]
    assert slower_wins == [4, 5, 7, 8]
    assert minimax_best_moves(board, "X") == [2]
    # O is lost here whatever it does, yet it blocks the row rather than lose at once.
    assert game_value("XX.O.....", "O") == -1
    assert minimax_best_moves("XX.O.....", "O") == [2]


def random_game_positions():
    """(board, mark to move) after 3 to 8 random plies, not yet over."""

    @st.composite
    def build(draw):
        order = draw(st.permutations(range(9)))
        plies = draw(st.integers(min_value=3, max_value=8))
        to_move = draw(st.sampled_from(["X", "O"]))
        board = "." * 9
        for cell in order[:plies]:
            if game_over(board):
                break
            board = play(board, cell, to_move)
            to_move = other_mark(to_move)
        return board, to_move

    return build()


@settings(max_examples=150, deadline=None)
@given(random_game_positions())
def test_minimax_value_matches_brute_force(position):
    board, to_move = position
    if game_over(board):
        return
    reference = brute_force_value(board, to_move)
    assert game_value(board, to_move) == reference
    for cell in minimax_best_moves(board, to_move):
        assert -brute_force_value(play(board, cell, to_move), other_mark(to_move)) == reference


def test_every_best_move_keeps_the_value_at_every_reachable_position():
    positions = reachable_positions()
    assert len(positions) > 5000
    for key, to_move in positions.items():
        board = key[:9]
        value = game_value(board, to_move)
        best = minimax_best_moves(board, to_move)
        assert set(oracle_best_moves(board, to_move)) <= set(best)
        for cell in best:
            child = play(board, cell, to_move)
            child_value = 1 if winner(child) == to_move else 0
            if not game_over(child):
                child_value = -game_value(child, other_mark(to_move))
            assert child_value == value, (board, to_move, cell)


@pytest.mark.parametrize("chooser", [minimax_best_moves, oracle_best_moves])
@pytest.mark.parametrize("oracle_mark", ["X", "O"])
@pytest.mark.parametrize("oracle_starts", [True, False])
def test_oracle_never_loses_anywhere_in_the_game_tree(chooser, oracle_mark, oracle_starts):
    """Oracle: every move it may pick; opponent: every reply. No line ends in a loss."""
    opponent_mark = other_mark(oracle_mark)
    seen: set[tuple[str, bool]] = set()
    endings = Counter()

    def visit(board: str, oracle_to_move: bool) -> None:
        if (board, oracle_to_move) in seen:
            return
        seen.add((board, oracle_to_move))
        if game_over(board):
            endings[winner(board)] += 1
            assert winner(board) != opponent_mark, f"oracle lost on {board}"
            return
        if oracle_to_move:
            for cell in chooser(board, oracle_mark):
                visit(play(board, cell, oracle_mark), False)
        else:
            for cell in empty_cells(board):
                visit(play(board, cell, opponent_mark), True)

    visit("." * 9, oracle_starts)
    assert endings[oracle_mark] > 0 and endings[None] > 0
    assert endings[opponent_mark] == 0


def test_opponent_tie_break_is_uniform_over_all_drawing_moves_on_an_empty_board():
    picks = Counter(opponent_move("." * 9, "X", 0.0, seed) for seed in range(2700))
    assert set(picks) == set(range(9))
    assert chi_square(picks, list(range(9))) < CHI2_CRITICAL_0001[8]


def test_opponent_tie_break_is_uniform_over_best_moves_and_never_plays_a_losing_one():
    # X in the centre: O draws only with a corner; an edge loses.
    board = "....X...."
    picks = Counter(opponent_move(board, "O", 0.0, seed) for seed in range(2000))
    assert set(picks) == {0, 2, 6, 8}
    assert chi_square(picks, [0, 2, 6, 8]) < CHI2_CRITICAL_0001[3]


def test_opponent_reply_is_fixed_by_seed_and_board():
    board = "....X...."
    for seed in range(50):
        assert opponent_move(board, "O", 0.5, seed) == opponent_move(list(board), "O", 0.5, seed)
    assert turn_seed(3, board) == turn_seed(3, list(board))
    assert turn_seed(3, board) != turn_seed(4, board)
    assert turn_seed(3, board) != turn_seed(3, "X........")


def test_random_move_prob_sets_how_often_the_opponent_blunders():
    # With p = 0.4 a random cell is played 40% of the time; half the empty cells (edges)
    # lose here, and minimax never plays them, so edges show up about 0.4 * 4/8 = 20%.
    board = "....X...."
    seeds = range(4000)
    edge_rate = sum(opponent_move(board, "O", 0.4, s) in (1, 3, 5, 7) for s in seeds) / 4000
    assert 0.17 < edge_rate < 0.23
    assert all(opponent_move(board, "O", 1.0, s) in empty_cells(board) for s in range(200))
    assert {opponent_move(board, "O", 1.0, s) for s in range(200)} >= {1, 3, 5, 7}


def test_oracle_prefers_corners_or_centre_that_trap_a_random_opponent():
    # Corners give a fallible opponent the most ways to lose; they tie exactly by symmetry.
    assert oracle_best_moves("." * 9, "X") == [0, 2, 6, 8]
    assert oracle_best_moves("X........", "O") == [4]


def random_positions(rng: random.Random, count: int, max_moves: int):
    """Up to `count` positions of games played at random for up to `max_moves` moves, each
    with the mark to move (finished games are left out)."""
    for _ in range(count):
        board, to_move = "." * 9, rng.choice("XO")
        for _ in range(rng.randrange(0, max_moves + 1)):
            if game_over(board):
                break
            board = play(board, rng.choice(empty_cells(board)), to_move)
            to_move = other_mark(to_move)
        if not game_over(board):
            yield board, to_move


def test_win_chance_after_is_what_the_oracle_maximises_and_its_exact_limits():
    # The exact chances against a uniformly random opponent of opening in each cell and
    # playing on as the oracle: a corner 99.48 %, the centre 98.96 %, an edge 98.70 %.
    first = {cell: win_chance_after("." * 9, cell, "X") for cell in range(9)}
    assert max(first.values()) == first[0] == first[8] > first[4] > first[1]
    assert float(first[0]) == pytest.approx(0.9948, abs=1e-4)
    for board, to_move in random_positions(random.Random(3), 200, max_moves=5):
        chances = {cell: win_chance_after(board, cell, to_move) for cell in empty_cells(board)}
        best = max(chances[cell] for cell in minimax_best_moves(board, to_move))
        assert {c for c in minimax_best_moves(board, to_move) if chances[c] == best} == set(
            oracle_best_moves(board, to_move)
        )
    with pytest.raises(ValueError, match="cell 0 is not empty"):
        win_chance_after("X........", 0, "O")


async def test_oracle_policy_tie_break_is_uniform_and_repeatable():
    oracle = OraclePolicy()
    sampling = SamplingParams()
    picks = Counter()
    for seed in range(1200):
        state = {"seed": seed, "board": list("." * 9), "model_mark": "X"}
        reply = await oracle.generate([], sampling, state=state)
        again = await oracle.generate([], sampling, state=dict(state))
        assert reply.text == again.text
        picks[int(reply.text.split("<move>")[1].split("</move>")[0])] += 1
    assert set(picks) == {0, 2, 6, 8}
    assert chi_square(picks, [0, 2, 6, 8]) < CHI2_CRITICAL_0001[3]


async def test_oracle_policy_always_picks_an_oracle_best_move():
    oracle = OraclePolicy(seed=5)
    rng = random.Random(11)
    for board, to_move in random_positions(rng, 300, max_moves=6):
        state = {"seed": rng.randrange(1000), "board": list(board), "model_mark": to_move}
        text = (await oracle.generate([], SamplingParams(), state=state)).text
        move = int(text.split("<move>")[1].split("</move>")[0])
        assert move in oracle_best_moves(board, to_move)
        empties = " ".join(map(str, empty_cells(board)))
        assert text == f"<think>Empty: {empties}.</think><move>{move}</move>"
