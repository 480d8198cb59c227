"""The exact result of a greedy tic-tac-toe player against the uniformly random opponent,
without the sampling noise of 1,000 games, and where it gives up win chances.

    python bench/tictactoe_exact.py RESULTS.jsonl [RESULTS.jsonl ...] [--top 12]
        [--out bench/results/tictactoe_exact_<name>.json]

A greedy player is a function of the game so far: the eval's games (`python -m rlcore eval
tictactoe ... -T 0 -a '{"min_random_move_prob": 1.0, "max_random_move_prob": 1.0, ...}'`,
any number of result files of one model) record its move at every history they met. This
walks the whole game tree of each of the four seatings (the model's mark X or O, first or
second): at the model's turn its recorded move, at the opponent's every empty cell with
equal chance; so the win, draw and loss rates come out exact, where 1,000 games estimate
them (within +-1.6 points, a 95 % interval). A history the games never met takes the move
the model made on the same board in another history, else the oracle's (`uncovered`: the
chance of reaching one; a few thousand games cover all but a fraction of a percent).

At each move it also compares the model's move with the oracle's, both followed by the
oracle's play (`win_chance_after`): the chance of reaching the position times the win
chance given up there, summed, is how far the model stands from the oracle's 95.6 % and at
which moves (by ply, and the positions that cost most). A player that only keeps the game's
value, picking among such moves at random, wins 87.3 %.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter, defaultdict
from fractions import Fraction
from pathlib import Path

from rlcore.envs.tictactoe_game import (
    empty_cells,
    minimax_best_moves,
    oracle_best_moves,
    other_mark,
    sound_moves,
    win_chance_after,
    winner,
)

ROOT = Path(__file__).resolve().parent.parent
SEATINGS = [(mark, starts) for mark in ("X", "O") for starts in (True, False)]


def board_of(history: tuple[int, ...], first: str) -> str:
    cells = ["."] * 9
    for ply, cell in enumerate(history):
        cells[cell] = first if ply % 2 == 0 else other_mark(first)
    return "".join(cells)


def read_moves(paths: list[str]) -> tuple[dict, dict, int]:
    """The model's recorded moves: by seating and history, and by mark and board."""
    by_history: dict[tuple, Counter] = defaultdict(Counter)
    by_board: dict[tuple, Counter] = defaultdict(Counter)
    games = 0
    for path in paths:
        for line in Path(path).read_text().splitlines():
            state = json.loads(line)["state"]
            mark, starts = state["model_mark"], state["model_starts"]
            first = mark if starts else other_mark(mark)
            history: tuple[int, ...] = ()
            for move in state["moves"]:
                if move["player"] == "model":
                    by_history[(mark, starts, history)][move["cell"]] += 1
                    by_board[(mark, board_of(history, first))][move["cell"]] += 1
                history += (move["cell"],)
            games += 1
    return by_history, by_board, games


class Walk:
    """The game tree of one model's recorded moves; rates and win chance given up."""

    def __init__(self, by_history: dict, by_board: dict):
        self.by_history, self.by_board = by_history, by_board
        self.uncovered: Counter = Counter()
        self.given_up: list[dict] = []

    def outcome(self, mark: str, starts: bool, history=(), reach=Fraction(1)) -> Counter:
        first = mark if starts else other_mark(mark)
        board = board_of(history, first)
        won_by = winner(board)
        if won_by is not None or "." not in board:
            result = "draw" if won_by is None else "win" if won_by == mark else "loss"
            return Counter({result: Fraction(1)})
        if (first if len(history) % 2 == 0 else other_mark(first)) != mark:
            cells = empty_cells(board)
            total: Counter = Counter()
            for cell in cells:
                for key, value in self.outcome(
                    mark, starts, history + (cell,), reach / len(cells)
                ).items():
                    total[key] += value / len(cells)
            return total
        seen = self.by_history.get((mark, starts, history)) or self.by_board.get((mark, board))
        if seen:
            cell = seen.most_common(1)[0][0]
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
        return self.outcome(mark, starts, history + (cell,), reach)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", help="results.jsonl of greedy games vs random")
    parser.add_argument("--top", type=int, default=12, help="positions listed that cost most")
    parser.add_argument("--out", help="JSON to write (default: none)")
    args = parser.parse_args()

    by_history, by_board, games = read_moves(args.results)
    walk = Walk(by_history, by_board)
    rows, overall = [], Counter()
    for mark, starts in SEATINGS:
        rates = walk.outcome(mark, starts)
        overall.update({key: value / len(SEATINGS) for key, value in rates.items()})
        rows.append(
            {
                "mark": mark,
                "first": starts,
                **{key: float(rates[key]) for key in ("win", "draw", "loss")},
                "uncovered": float(walk.uncovered[(mark, starts)]),
            }
        )
    share = Fraction(1, len(SEATINGS))
    by_ply: Counter = Counter()
    for item in walk.given_up:
        by_ply[item["ply"]] += float(item["cost"] * share)
    costly = sorted(walk.given_up, key=lambda item: item["cost"], reverse=True)[: args.top]

    print(f"{games} games read, {len(by_history)} histories with a recorded move")
    print(f"{'seating':<10} {'win':>7} {'draw':>7} {'loss':>7} {'uncovered':>10}")
    for row in rows:
        seat = f"{row['mark']} {'first' if row['first'] else 'second'}"
        print(
            f"{seat:<10} {row['win']:7.2%} {row['draw']:7.2%} {row['loss']:7.2%} "
            f"{row['uncovered']:10.2%}"
        )
    result = {key: float(overall[key]) for key in ("win", "draw", "loss")}
    print(f"{'all':<10} {result['win']:7.2%} {result['draw']:7.2%} {result['loss']:7.2%}")
    lost = sum(by_ply.values())
    print(
        f"win chance given up against the oracle's moves: {lost:.2%} (by ply: "
        + ", ".join(f"{ply}: {cost:.2%}" for ply, cost in sorted(by_ply.items()))
        + ")"
    )
    for item in costly:
        print(
            f"  {float(item['cost'] * share):.3%}  ply {item['ply']} {item['board']} "
            f"{item['mark']} played {item['played']} (oracle {item['oracle']}, "
            f"{'sound' if item['sound'] else 'unsound'}): -{item['gap']:.3f} at reach "
            f"{item['reach']:.4f}"
        )
    if args.out:
        record = {
            "command": "python bench/tictactoe_exact.py " + " ".join(args.results),
            "games_read": games,
            "exact": result,
            "seatings": rows,
            "given_up": {"total": lost, "by_ply": {str(k): v for k, v in sorted(by_ply.items())}},
            "costliest": [{**item, "cost": float(item["cost"] * share)} for item in costly],
        }
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
