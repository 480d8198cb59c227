"""The exact result of a greedy tic-tac-toe player against the uniformly random opponent
and against the perfect one: no games sampled, the whole game tree walked.

A greedy player is a function of the game so far. `ask_moves` asks it at every history a
game against any opponent can reach, as `TicTacToeEnv` asks (its system prompt, each board
message, an invalid reply answered with the env's retry message, at most `max_turns` replies
a game), level by level, each level in one batch: ~2,000 questions for a player that keeps
to legal moves. `Walk` then walks the tree of each of the four seatings (the player's mark X
or O, first or second): at the player's turn its move, at the opponent's every empty cell
with equal chance (the random opponent) or every minimax best move with equal chance (the
perfect one, as the env breaks its ties), so the rates come out exact where 1,000 games
estimate them within +-1.6 points. A game the player leaves without a valid move in its
turns counts as unfinished. On the way it sums, at each of the player's moves, the chance of
reaching the position times the win chance its move gives up against the oracle's
(`win_chance_after`): how far it stands from the oracle's 95.6 % and where.
`exact_rates` does both for a policy. `bench/tictactoe_exact.py` prints it all.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from fractions import Fraction

from rlcore.envs.tictactoe import board_message, system_prompt
from rlcore.envs.tictactoe_game import (
    empty_cells,
    game_over,
    minimax_best_moves,
    oracle_best_moves,
    other_mark,
    parse_move,
    result_for,
    sound_moves,
    win_chance_after,
    winner,
)
from rlcore.types import SamplingParams

SEATINGS = [(mark, starts) for mark in ("X", "O") for starts in (True, False)]
OUTCOMES = ("win", "draw", "loss", "unfinished")


def board_of(history: tuple[int, ...], first: str) -> str:
    cells = ["."] * 9
    for ply, cell in enumerate(history):
        cells[cell] = first if ply % 2 == 0 else other_mark(first)
    return "".join(cells)


def _view(mark: str, starts: bool, history: tuple[int, ...]) -> dict:
    """The env state a board-reading built-in player (the oracle, random) needs."""
    first = mark if starts else other_mark(mark)
    return {"seed": 0, "board": list(board_of(history, first)), "model_mark": mark}


async def ask_moves(policy, max_turns: int, max_tokens: int) -> tuple[dict, dict, int]:
    """The player's greedy move at every history a game can reach, asked as the env asks
    (`TicTacToeEnv.env_response`): by (mark, starts, history), None where it gave no valid
    move in the turns left; the invalid replies it gave at each history before its move (or
    before its turns ran out); and the number of questions asked."""
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    level = []  # (mark, starts, history, messages, turns used, invalid replies at history)
    for mark, starts in SEATINGS:
        system = {"role": "system", "content": system_prompt(mark)}
        openings = [()] if starts else [(cell,) for cell in range(9)]
        for history in openings:
            board = board_of(history, mark if starts else other_mark(mark))
            opponent = history[-1] if history else None
            user = {"role": "user", "content": board_message(board, opponent_cell=opponent)}
            level.append((mark, starts, history, [system, user], 0, 0))
    moves: dict[tuple, int | None] = {}
    invalid: dict[tuple, int] = {}
    asked = 0
    while level:
        replies = await asyncio.gather(
            *(policy.generate(node[3], sampling, state=_view(*node[:3])) for node in level)
        )
        asked += len(level)
        following = []
        for node, reply in zip(level, replies, strict=True):
            mark, starts, history, messages, turns, wrong = node
            key = (mark, starts, history)
            board = list(board_of(history, mark if starts else other_mark(mark)))
            messages = [*messages, {"role": "assistant", "content": reply.text}]
            turns += 1
            cell, error = parse_move(reply.text, board)
            if error is not None:
                if turns >= max_turns:
                    moves[key], invalid[key] = None, wrong + 1
                    continue
                retry = {"role": "user", "content": board_message(board, error=error)}
                following.append((*key, [*messages, retry], turns, wrong + 1))
                continue
            moves[key], invalid[key] = cell, wrong
            board[cell] = mark
            if game_over(board):
                continue
            for answer in empty_cells(board):
                after = list(board)
                after[answer] = other_mark(mark)
                if game_over(after):
                    continue
                if turns >= max_turns:  # the next history's game ends unfinished
                    moves[(mark, starts, history + (cell, answer))] = None
                    continue
                content = board_message(after, opponent_cell=answer, result=result_for(after, mark))
                following.append(
                    (mark, starts, history + (cell, answer),
                     [*messages, {"role": "user", "content": content}], turns, 0)
                )  # fmt: skip
        level = following
    return moves, invalid, asked


class Walk:
    """The game tree of one model's recorded moves; rates and win chance given up."""

    def __init__(self, by_history: dict, by_board: dict, opponent: str = "random", invalid=None):
        self.by_history, self.by_board = by_history, by_board
        self.opponent = opponent  # "random": every empty cell; "optimal": its best moves
        self.invalid = invalid or {}  # invalid replies at a history before its move
        self.uncovered: Counter = Counter()
        self.given_up: list[dict] = []

    def outcome(
        self, mark: str, starts: bool, history=(), reach=Fraction(1), wrong=0, replies=0
    ) -> Counter:
        """The chance of each outcome from `history` on, and the expected invalid-move rate
        of the game (`invalid_move_rate`: the env's invalid replies over replies), given
        the `wrong` invalid replies of the `replies` made on the way."""
        first = mark if starts else other_mark(mark)
        board = board_of(history, first)
        won_by = winner(board)
        if won_by is not None or "." not in board:
            result = "draw" if won_by is None else "win" if won_by == mark else "loss"
            return Counter({result: Fraction(1), "invalid_move_rate": _rate(wrong, replies)})
        if (first if len(history) % 2 == 0 else other_mark(first)) != mark:
            if self.opponent == "random":
                cells = empty_cells(board)
            else:
                cells = minimax_best_moves(board, other_mark(mark))
            total: Counter = Counter()
            for cell in cells:
                for key, value in self.outcome(
                    mark, starts, history + (cell,), reach / len(cells), wrong, replies
                ).items():
                    total[key] += value / len(cells)
            return total
        seen = self.by_history.get((mark, starts, history)) or self.by_board.get((mark, board))
        if seen:
            cell = seen.most_common(1)[0][0]
            mistakes = self.invalid.get((mark, starts, history), 0)
            wrong, replies = wrong + mistakes, replies + mistakes
            if cell is None:  # no valid move in the turns it had
                return Counter(
                    {"unfinished": Fraction(1), "invalid_move_rate": _rate(wrong, replies)}
                )
            best = max(win_chance_after(board, c, mark) for c in minimax_best_moves(board, mark))
            gap = best - win_chance_after(board, cell, mark)
            if gap > 0:
                self.given_up.append(
                    {
                        "cost": reach * gap,
                        "ply": len(history),
                        "board": board,
                        "mark": mark,
                        "played": cell,
                        "oracle": oracle_best_moves(board, mark),
                        "sound": cell in sound_moves(board, mark),
                        "gap": float(gap),
                        "reach": float(reach),
                    }
                )
        else:
            self.uncovered[(mark, starts)] += reach
            cell = oracle_best_moves(board, mark)[0]
        return self.outcome(mark, starts, history + (cell,), reach, wrong, replies + 1)

    def rates(self) -> dict[str, float]:
        """`OUTCOMES` and `invalid_move_rate`, the mean over the four seatings."""
        total: Counter = Counter()
        for mark, starts in SEATINGS:
            for key, value in self.outcome(mark, starts).items():
                total[key] += float(value) / len(SEATINGS)
        return {key: total[key] for key in (*OUTCOMES, "invalid_move_rate")}


def _rate(wrong: int, replies: int) -> Fraction:
    return Fraction(wrong, replies) if replies else Fraction(0)


async def exact_rates(policy, max_turns: int = 6, max_tokens: int = 64) -> dict:
    """`policy`'s exact rates against the random and the perfect opponent, each a dict of
    `OUTCOMES` and `invalid_move_rate` (the mean over the four seatings), and the questions
    asked."""
    moves, invalid, asked = await ask_moves(policy, max_turns, max_tokens)
    by_history = {key: Counter({cell: 1}) for key, cell in moves.items()}
    rates = {"questions": asked}
    for opponent in ("random", "optimal"):
        rates[opponent] = Walk(by_history, {}, opponent, invalid).rates()
    return rates
