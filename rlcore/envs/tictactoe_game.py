"""Tic-tac-toe itself: the board, the rules and the solver, with no prompts and no players.

A board is 9 cells, 'X', 'O' or '.', numbered 0-8 row by row. Here are the rules
(`winner`, `empty_cells`, `game_over`, `result_for`), the exhaustive solver (`game_value`,
`move_values`, `sound_moves`, `minimax_best_moves`, `oracle_best_moves`), the seeded
opponent (`opponent_move`: a random cell with probability `random_move_prob`, else a
minimax best move chosen uniformly, both drawn from a seed made of the game's seed and
the board), reading a model's move off its reply (`parse_move`), and what a think block
reads off a board (`think_text`). The environment (tictactoe.py), the built-in players
(tictactoe_players.py) and the Play page's game (tictactoe_play.py) are built on these.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Sequence
from fractions import Fraction
from functools import cache, lru_cache
from typing import Any

from rlcore.parsers import ThinkParser, XMLParser

EMPTY = "."
MARKS = ("X", "O")
LINES = (
    (0, 1, 2),
    (3, 4, 5),
    (6, 7, 8),
    (0, 3, 6),
    (1, 4, 7),
    (2, 5, 8),
    (0, 4, 8),
    (2, 4, 6),
)
# A win pays 1; the draw and loss rewards are env params (an unfinished game pays the loss
# reward), these their defaults.
# What a think block reads off the board (`think_text`).
REASONING_FORMATS = ("empty", "threats", "none")
MOVE_FORMAT_HINT = "reply with <move>N</move>, N in 0-8"
# The longest move tag content read as a number ("+04" and "008" still are).
MAX_MOVE_CHARS = 4

# ---------------------------------------------------------------------------------------
# Board helpers


def board_string(board: Sequence[str] | str) -> str:
    """The board as a 9-character string, or ValueError naming what was wrong."""
    text = board if isinstance(board, str) else "".join(board)
    if text in _BOARDS:  # checked before: a game asks of its board many times a turn
        return text
    # Stripping the three cell marks leaves nothing exactly when every cell is one of them.
    if len(text) != 9 or text.strip("XO" + EMPTY):
        raise ValueError(f"a board is 9 cells, each 'X', 'O' or '{EMPTY}'; got {board!r}")
    _BOARDS.add(text)  # at most 3^9 strings, so the set stays small
    return text


_BOARDS: set[str] = set()


def check_mark(mark: str) -> str:
    if mark not in MARKS:
        raise ValueError(f"a mark is 'X' or 'O', got {mark!r}")
    return mark


def other_mark(mark: str) -> str:
    return "O" if check_mark(mark) == "X" else "X"


def winner(board: Sequence[str] | str) -> str | None:
    """'X' or 'O' if that mark has three in a row, else None."""
    return _winner(board_string(board))


@cache
def _winner(text: str) -> str | None:
    for a, b, c in LINES:
        if text[a] != EMPTY and text[a] == text[b] == text[c]:
            return text[a]
    return None


def empty_cells(board: Sequence[str] | str) -> list[int]:
    return list(_empty_cells(board_string(board)))


@cache
def _empty_cells(text: str) -> tuple[int, ...]:
    return tuple(i for i, cell in enumerate(text) if cell == EMPTY)


def game_over(board: Sequence[str] | str) -> bool:
    text = board_string(board)
    return _winner(text) is not None or EMPTY not in text


def render_board(board: Sequence[str] | str) -> str:
    """Three rows of three characters, the form every prompt shows: 'X', 'O', or the
    cell's number where it is empty ("X1O" / "3X5" / "678"). Numbering the empty cells in
    place means a model reads the legal moves off the board instead of counting positions."""
    return _render_board(board_string(board))


@cache
def _render_board(text: str) -> str:
    cells = [str(i) if mark == EMPTY else mark for i, mark in enumerate(text)]
    return "\n".join("".join(cells[row : row + 3]) for row in (0, 3, 6))


@cache
def _position_score(board: str, player: str) -> int:
    """Minimax score of `board` for `player` to move: positive wins, 0 draws, negative
    losses; a win counts 1 + the cells still empty when it lands, so sooner is bigger."""
    if winner(board) is not None:
        # Only the player who just moved can have completed a line.
        return -(1 + board.count(EMPTY))
    scores = _move_scores(board, player)
    return max(score for _, score in scores) if scores else 0


@cache
def _move_scores(board: str, player: str) -> tuple[tuple[int, int], ...]:
    """(cell, score for `player`) for every empty cell, searched exhaustively."""
    opponent = "O" if player == "X" else "X"
    scores = []
    for cell, mark in enumerate(board):
        if mark == EMPTY:
            child = board[:cell] + player + board[cell + 1 :]
            scores.append((cell, -_position_score(child, opponent)))
    return tuple(scores)


def game_value(board: Sequence[str] | str, player: str) -> int:
    """The game-theoretic value for `player` to move under perfect play: 1, 0 or -1."""
    score = _position_score(board_string(board), check_mark(player))
    return (score > 0) - (score < 0)


def move_values(board: Sequence[str] | str, player: str) -> dict[int, int]:
    """For every empty cell, the game-theoretic value (1, 0 or -1) for `player` after
    playing there; the position's own `game_value` is the best of them."""
    text = board_string(board)
    check_mark(player)
    if game_over(text):
        raise ValueError(f"no moves: the game on board {text!r} is over")
    return {cell: (score > 0) - (score < 0) for cell, score in _move_scores(text, player)}


def sound_moves(board: Sequence[str] | str, player: str) -> list[int]:
    """Every cell whose move keeps the game-theoretic value for `player` (`game_value`):
    from a won position the moves that still win, from a drawn one those that still draw,
    from a lost one every move. A player who only ever makes sound moves never loses a
    game it could draw and never draws one it could win; unlike `minimax_best_moves`,
    slower wins and every drawing move count."""
    return list(_sound_moves(board_string(board), check_mark(player)))


@cache
def _sound_moves(text: str, player: str) -> tuple[int, ...]:
    values = move_values(text, player)
    best = max(values.values())
    return tuple(cell for cell, value in values.items() if value == best)


def minimax_best_moves(board: Sequence[str] | str, player: str) -> list[int]:
    """Every cell with the best minimax score for `player`, in board order.

    Scores favour sooner wins and later losses, so from a won position only the fastest
    wins are listed and from a lost one only the moves that hold out longest. Callers pick
    among the list at random; taking the first would make a predictable player.
    """
    text = board_string(board)
    check_mark(player)
    if game_over(text):
        raise ValueError(f"no moves: the game on board {text!r} is over")
    scores = _move_scores(text, player)
    best = max(score for _, score in scores)
    return [cell for cell, score in scores if score == best]


@cache
def _win_chance(board: str, player: str, to_move: str) -> Fraction:
    """Chance that `player`, always choosing among `oracle_best_moves`, beats an opponent
    who plays uniformly at random; exact fractions so symmetric moves tie exactly."""
    won_by = winner(board)
    if won_by is not None or EMPTY not in board:
        return Fraction(int(won_by == player))
    next_to_move = "O" if to_move == "X" else "X"
    if to_move == player:
        return max(_safe_move_chances(board, player).values())
    chances = [
        _win_chance(board[:cell] + to_move + board[cell + 1 :], player, next_to_move)
        for cell in empty_cells(board)
    ]
    return sum(chances, Fraction(0)) / len(chances)


@cache
def _safe_move_chances(board: str, player: str) -> dict[int, Fraction]:
    opponent = "O" if player == "X" else "X"
    return {
        cell: _win_chance(board[:cell] + player + board[cell + 1 :], player, opponent)
        for cell in minimax_best_moves(board, player)
    }


def win_chance_after(board: Sequence[str] | str, cell: int, player: str) -> Fraction:
    """The exact chance that `player`, moving at `cell` now and as the oracle from then on,
    beats an opponent who plays uniformly at random (the value the oracle maximises over
    its minimax best moves; here for any legal move, an unsound one included)."""
    text = board_string(board)
    if cell not in empty_cells(text):
        raise ValueError(f"cell {cell} is not empty on board {text!r}")
    after = text[:cell] + check_mark(player) + text[cell + 1 :]
    return _win_chance(after, player, other_mark(player))


def oracle_best_moves(board: Sequence[str] | str, player: str) -> list[int]:
    """The oracle's candidates: among `minimax_best_moves` (so it never loses and wins as
    fast as it can), those that give an opponent playing at random the most chances to
    go wrong. Exact ties (symmetric cells, say) all stay in, to be picked at random."""
    return list(_oracle_best_moves(board_string(board), check_mark(player)))


@cache
def _oracle_best_moves(text: str, player: str) -> tuple[int, ...]:
    chances = _safe_move_chances(text, player)
    best = max(chances.values())
    return tuple(cell for cell, chance in chances.items() if chance == best)


def stable_seed(*parts: Any) -> int:
    """A 63-bit seed from the parts' text (sha256, unlike hash(), is the same every run)."""
    digest = hashlib.sha256(":".join(str(part) for part in parts).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def turn_seed(seed: int, board: Sequence[str] | str) -> int:
    """The opponent's seed on `board` in the game of example seed `seed`."""
    return stable_seed(seed, board_string(board))


def opponent_move(board: Sequence[str] | str, mark: str, random_move_prob: float, seed: int) -> int:
    """The opponent's reply: a random empty cell with probability `random_move_prob`, else
    a minimax best move chosen uniformly; fully determined by (seed, board)."""
    text = board_string(board)
    rng = random.Random(turn_seed(seed, text))
    if rng.random() < random_move_prob:
        return rng.choice(empty_cells(text))
    return rng.choice(minimax_best_moves(text, mark))


# ---------------------------------------------------------------------------------------
# Reading a reply and playing a move

think_parser = ThinkParser()
_move_parser = XMLParser(["move"])


def parse_move(text: str | None, board: Sequence[str] | str) -> tuple[int | None, str | None]:
    """(cell, None) for a valid move on `board`, else (None, what was wrong).

    The move is the last `<move>` tag after the optional think block, so a move merely
    mentioned while thinking does not count.
    """
    # A policy's replies repeat (the same move in the same words): short ones are
    # remembered, at most 4,096 of them, so a long reply costs no memory kept.
    short = text is None or len(text) <= REMEMBERED_REPLY_CHARS
    read = _remembered_move if short else _read_move
    cell, error = read(text)
    if error is not None:
        return None, error
    if board_string(board)[cell] != EMPTY:
        return None, f"cell {cell} is taken"
    return cell, None


def _read_move(text: str | None) -> tuple[int | None, str | None]:
    """The cell 0-8 a reply's last move tag names, whatever the board, or what was wrong."""
    _, answer = think_parser.parse(text)
    raw = _move_parser.parse_answer(answer, "move")
    if raw is None or not re.fullmatch(r"[+-]?[0-9]+", raw):
        return None, MOVE_FORMAT_HINT
    if len(raw) > MAX_MOVE_CHARS:
        # Never int(raw): int() refuses more than 4300 digits. A cell number is one digit;
        # a tag this long is not a move, however many of its digits are leading zeros.
        return None, f"the move {raw[:8]}... is {len(raw)} characters long; {MOVE_FORMAT_HINT}"
    cell = int(raw)
    if not 0 <= cell <= 8:
        return None, f"cell {cell} is not in 0-8"
    return cell, None


REMEMBERED_REPLY_CHARS = 256
_remembered_move = lru_cache(maxsize=4096)(_read_move)


def result_for(board: Sequence[str] | str, model_mark: str) -> str | None:
    """'win', 'loss' or 'draw' from the model's view once the game is over, else None."""
    text = board_string(board)
    won_by = _winner(text)
    if won_by is not None:
        return "win" if won_by == model_mark else "loss"
    return "draw" if EMPTY not in text else None


def random_opening(board: list[str], model_mark: str, rounds: int, rng: random.Random) -> list[int]:
    """Play up to `rounds` random (model move, opponent reply) pairs on `board` in place and
    return their cells in order. Only pairs after which the game goes on are drawn, so the
    model always has a live position to move in; it stops early when none is left."""
    opponent_mark = other_mark(model_mark)
    cells: list[int] = []
    for _ in range(rounds):
        pairs = []
        for mine in empty_cells(board):
            after = board[:mine] + [model_mark] + board[mine + 1 :]
            if game_over(after):
                continue
            for theirs in empty_cells(after):
                final = after[:theirs] + [opponent_mark] + after[theirs + 1 :]
                if not game_over(final):
                    pairs.append((mine, theirs))
        if not pairs:
            break
        mine, theirs = rng.choice(pairs)
        board[mine], board[theirs] = model_mark, opponent_mark
        cells.extend((mine, theirs))
    return cells


def play_move(board: list[str], moves: list[dict], cell: int, mark: str, player: str) -> None:
    """Put `mark` on `cell` of `board` and record the move, by `player`, in `moves`."""
    board[cell] = mark
    moves.append({"player": player, "mark": mark, "cell": cell})


# ---------------------------------------------------------------------------------------
# What a think block reads off the board


def winning_cells(board: Sequence[str] | str, mark: str) -> list[int]:
    """The empty cells that would complete a line of `mark` (a win for it on the spot)."""
    return list(_winning_cells(board_string(board), check_mark(mark)))


@cache
def _winning_cells(text: str, mark: str) -> tuple[int, ...]:
    cells = set()
    for line in LINES:
        marks = [text[i] for i in line]
        if marks.count(mark) == 2 and marks.count(EMPTY) == 1:
            cells.add(line[marks.index(EMPTY)])
    return tuple(sorted(cells))


def missed_tactic(board: Sequence[str] | str, cell: int, mark: str) -> tuple[str, list[int]] | None:
    """What `mark` playing `cell` on `board` left on the spot: ("win", cells) when it could
    have completed a line at `cells` and played elsewhere, ("block", cells) when it could not
    win at once, the opponent could at `cells`, and it blocked none of them; None for a move
    that took the win, blocked, or had neither to do."""
    own = winning_cells(board, mark)
    if own:
        return None if cell in own else ("win", own)
    theirs = winning_cells(board, other_mark(mark))
    return ("block", theirs) if theirs and cell not in theirs else None


def think_text(board: Sequence[str] | str, mark: str, reasoning: str = "empty") -> str:
    """What the built-in players think before moving as `mark`, in `reasoning` format:
    'Empty: 0 4 8.' and, for 'threats', 'Win: 2. Block: none.' (the cells where `mark`
    completes a line, then those where the opponent would); for 'none' nothing (the reply
    is `<think></think><move>N</move>`). Facts about the board only, never the choice: the
    env counts a model's think block right when it equals this."""
    if reasoning not in REASONING_FORMATS:
        raise ValueError(f"reasoning must be one of {REASONING_FORMATS}, got {reasoning!r}")
    if reasoning == "none":
        return ""
    text = f"Empty: {_cell_list(empty_cells(board))}."
    if reasoning == "threats":
        wins = _cell_list(winning_cells(board, mark))
        blocks = _cell_list(winning_cells(board, other_mark(mark)))
        text += f" Win: {wins}. Block: {blocks}."
    return text


def _cell_list(cells: list[int]) -> str:
    return " ".join(map(str, cells)) or "none"
