"""The exact result of a greedy tic-tac-toe player against the uniformly random opponent,
without the sampling noise of 1,000 games, and where it gives up win chances.

    python bench/tictactoe_exact.py --model tiny-master [--device cpu] [--max-turns 6]
        [--max-tokens 64] [--concurrency 256] [--top 12] [--out PATH]
    python bench/tictactoe_exact.py RESULTS.jsonl [RESULTS.jsonl ...] [--top 12] [--out PATH]

A greedy player is a function of the game so far. With `--model` the player is asked at
every history a game against any opponent can reach, as the env would ask it (its system
prompt, each board message, an invalid reply answered with the env's retry message, at most
`--max-turns` replies a game): all such histories level by level, each level in one batch
(~2,000 questions for a player that keeps to legal moves), so nothing is left to chance.
From result files (`python -m rlcore eval tictactoe ... -T 0 -a '{"min_random_move_prob":
1.0, "max_random_move_prob": 1.0, ...}'`, any number of files of one model) it reads the move
the games recorded at each history they met instead; a history they never met takes the
move the model made on the same board in another history, else the oracle's (`uncovered`:
the chance of reaching one; a few thousand games cover all but a fraction of a percent).
Either way it walks the whole game tree of each of the four seatings (the model's mark X or
O, first or second): at the model's turn its move, at the opponent's every empty cell with
equal chance, so the win, draw and loss rates come out exact, where 1,000 games estimate
them (within +-1.6 points, a 95 % interval). A game the player leaves without a valid move
in its turns counts as unfinished. With `--model` the perfect opponent's tree (its best
moves with equal chance, as the env's minimax breaks ties) is walked too, and the choice
rule's score (draws against optimal plus wins less twice the losses against random) printed.

At each move it also compares the model's move with the oracle's, both followed by the
oracle's play (`win_chance_after`): the chance of reaching the position times the win
chance given up there, summed, is how far the model stands from the oracle's 95.6 % and at
which moves (by ply, and the positions that cost most). A player that only keeps the game's
value, picking among such moves at random, wins 87.3 %.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections import Counter, defaultdict
from fractions import Fraction
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchlib import write_results  # noqa: E402

from rlcore.envs.tictactoe_exact import (  # noqa: E402
    OUTCOMES,
    SEATINGS,
    Walk,
    ask_moves,
    board_of,
)
from rlcore.envs.tictactoe_game import other_mark  # noqa: E402


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


def asked_moves(args) -> tuple[dict, dict, int]:
    """`--model`'s moves at every reachable history, in `read_moves`' shape, its invalid
    replies by history and the questions asked."""
    from rlcore.policy import load_policy

    policy = load_policy(args.model, device=args.device, concurrency=args.concurrency)

    async def ask():
        try:
            return await ask_moves(policy, args.max_turns, args.max_tokens)
        finally:
            await policy.aclose()

    moves, invalid, asked = asyncio.run(ask())
    return {key: Counter({cell: 1}) for key, cell in moves.items()}, invalid, asked


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="*", help="results.jsonl of greedy games vs random")
    parser.add_argument("--model", help="ask this player at every history instead")
    parser.add_argument("--device", default="cpu", help="where --model runs")
    parser.add_argument("--max-turns", type=int, default=6, help="replies a game (env max_turns)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens a reply")
    parser.add_argument("--concurrency", type=int, default=256, help="questions in one batch")
    parser.add_argument("--top", type=int, default=12, help="positions listed that cost most")
    parser.add_argument("--out", help="JSON to write (default: none)")
    args = parser.parse_args(argv)
    if bool(args.model) == bool(args.results):
        parser.error("give either --model or result files")

    if args.model:
        by_history, invalid, asked = asked_moves(args)
        by_board, games = {}, 0
    else:
        by_history, by_board, games = read_moves(args.results)
        invalid, asked = {}, 0
    walk = Walk(by_history, by_board, "random", invalid)
    rows, overall = [], Counter()
    for mark, starts in SEATINGS:
        rates = walk.outcome(mark, starts)
        overall.update({key: value / len(SEATINGS) for key, value in rates.items()})
        rows.append(
            {
                "mark": mark,
                "first": starts,
                **{key: float(rates[key]) for key in OUTCOMES},
                "uncovered": float(walk.uncovered[(mark, starts)]),
            }
        )
    share = Fraction(1, len(SEATINGS))
    by_ply: Counter = Counter()
    for item in walk.given_up:
        by_ply[item["ply"]] += float(item["cost"] * share)
    costly = sorted(walk.given_up, key=lambda item: item["cost"], reverse=True)[: args.top]

    if args.model:
        print(f"{args.model}: {asked} questions, {len(by_history)} histories")
    else:
        print(f"{games} games read, {len(by_history)} histories with a recorded move")
    print(
        f"{'seating':<10} {'win':>7} {'draw':>7} {'loss':>7} {'unfinished':>10} {'uncovered':>10}"
    )
    for row in rows:
        seat = f"{row['mark']} {'first' if row['first'] else 'second'}"
        print(
            f"{seat:<10} {row['win']:7.2%} {row['draw']:7.2%} {row['loss']:7.2%} "
            f"{row['unfinished']:10.2%} {row['uncovered']:10.2%}"
        )
    result = {key: float(overall[key]) for key in OUTCOMES}
    print(
        f"{'all':<10} {result['win']:7.2%} {result['draw']:7.2%} {result['loss']:7.2%} "
        f"{result['unfinished']:10.2%}"
    )
    against_optimal = None
    if args.model:  # every history was asked, so the perfect opponent's tree is known too
        against_optimal = Walk(by_history, {}, "optimal", invalid).rates()
        score = against_optimal["draw"] + result["win"] - 2 * result["loss"]
        print(
            f"against the optimal player: {against_optimal['draw']:.2%} drawn, "
            f"{against_optimal['loss']:.2%} lost, {against_optimal['unfinished']:.2%} "
            f"unfinished; the choice rule's score (draws vs optimal + wins - 2 x losses vs "
            f"random): {score:.4f}"
        )
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
    record = {
        "command": "python bench/tictactoe_exact.py " + " ".join(argv or sys.argv[1:]),
        "model": args.model,
        "questions": asked,
        "games_read": games,
        "exact": result,
        "exact_vs_optimal": against_optimal,
        "seatings": rows,
        "given_up": {"total": lost, "by_ply": {str(k): v for k, v in sorted(by_ply.items())}},
        "costliest": [{**item, "cost": float(item["cost"] * share)} for item in costly],
    }
    if args.out:
        write_results(record, args.out, "")
    return record


if __name__ == "__main__":
    main()
