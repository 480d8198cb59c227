"""Play moves on the local engine with and without its prefix store, side by side in one
process: `--games` games of tic-tac-toe played at once to their end against a person who
plays random cells, the model answering greedily as on the Play page (96 tokens a reply, 3
tries), one torch thread as `make run`'s inference worker.

    python bench/play_engine.py [--model tiny|CHECKPOINT_DIR] [--games 20] [--repeats 3]
        [--out bench/results/play_engine.json]

Each figure is the median of `--repeats` runs after one untimed run. The engine without
the store re-reads every game's whole history each move; with it a move prefills what was
said since the model's last reply (kv_cache.py). Prints a table (seconds, moves, model
replies, share of prompt tokens reused, ratio) and writes JSON; the greedy games must come
out identical both ways (checked).
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from benchlib import write_results  # noqa: E402

from rlcore.envs.tictactoe_play import PlaySession  # noqa: E402
from rlcore.policy.kv_cache import DEFAULT_MAX_BYTES  # noqa: E402
from rlcore.policy.local import LocalEngine  # noqa: E402
from rlcore.policy.tiny import ensure_tiny_model  # noqa: E402
from rlcore.types import SamplingParams  # noqa: E402

PLAY = SamplingParams(temperature=0.0, max_tokens=96)  # webapp/play/services.py PLAY_SAMPLING


async def play_games(engine: LocalEngine, games: int) -> list[list[str]]:
    """Every game to its end; returns each game's messages' texts."""

    async def game(index: int) -> list[str]:
        session = PlaySession.new("O", False, seed=index)
        person = random.Random(index)
        while not session.finished:
            session.human_move(person.choice([c for c, m in enumerate(session.board) if m == "."]))
            if session.finished:
                break
            await session.model_turn(engine, PLAY, max_attempts=3)
        return [message["content"] for message in session.messages]

    return await asyncio.gather(*(game(i) for i in range(games)))


def measure(path: str, games: int, repeats: int, store_bytes: int) -> dict:
    engine = LocalEngine(path, device="cpu", name="play", prefix_cache_bytes=store_bytes)
    transcripts = asyncio.run(play_games(engine, games))  # untimed: warm-up
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        asyncio.run(play_games(engine, games))
        seconds.append(time.perf_counter() - started)
    store = engine.prefix_cache
    replies = sum(len(t) for t in transcripts) // 2  # each model reply follows a user turn
    return {
        "prefix_store": bool(store_bytes),
        "seconds": round(statistics.median(seconds), 3),
        "runs": [round(s, 3) for s in seconds],
        "model_replies": replies,
        "reused_share": round(store.tokens_reused / store.tokens_looked_up, 3) if store else 0.0,
        "transcripts": transcripts,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="tiny or a checkpoint directory")
    parser.add_argument("--games", type=int, default=20, help="games played at once")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per figure")
    parser.add_argument("--out", default=None, help="JSON path (default bench/results/)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    path = ensure_tiny_model() if args.model == "tiny" else args.model
    rows = [measure(path, args.games, args.repeats, size) for size in (0, DEFAULT_MAX_BYTES)]
    without, with_store = rows
    identical = without["transcripts"] == with_store["transcripts"]
    print(f"{args.games} games at once of {args.model}, to their end, 1 torch thread, CPU")
    print(f"{'prefix store':<14}{'seconds':>9}{'replies':>9}{'reused':>9}{'vs off':>8}")
    for row in rows:
        ratio = without["seconds"] / row["seconds"]
        print(
            f"{'on' if row['prefix_store'] else 'off':<14}{row['seconds']:>9.2f}"
            f"{row['model_replies']:>9}{row['reused_share']:>9.0%}{ratio:>7.2f}x"
        )
    print(f"greedy games identical both ways: {identical}")
    for row in rows:
        del row["transcripts"]
    result = {
        "benchmark": "play_engine",
        "machine": {"processor": platform.processor() or platform.machine(), "threads": 1},
        "model": args.model,
        "games": args.games,
        "identical": identical,
        "rows": rows,
    }
    return write_results(result, args.out, "play_engine.json")


if __name__ == "__main__":
    main()
