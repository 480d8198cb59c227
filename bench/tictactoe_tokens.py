"""Tokens per tic-tac-toe game: the built-in tiny model's character-level tokenizer against
byte-level BPE merges learned on teacher games (issue 15's "tokenizer with merges" lever).

The merges are learned with Hugging Face `tokenizers` on `--train-games` games of the
random-valid teacher (the games the mastery benchmark's SFT starts from) and counted on
`--games` held-out ones. The pre-tokenizer is the tiny model's, Qwen2's split regex, which
transformers rebuilds from any `qwen2` checkpoint's vocab and merges: merges stay inside its
pieces, so every digit stays a token of its own. Prints a table and writes
bench/results/tictactoe_tokens.json.

    python bench/tictactoe_tokens.py
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchlib import write_results  # noqa: E402
from tokenizers import (  # noqa: E402
    AddedToken,
    Regex,
    Tokenizer,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)

from rlcore.envs.registry import load_environment  # noqa: E402
from rlcore.envs.tictactoe_players import RandomValidPolicy  # noqa: E402
from rlcore.policy.tiny import (  # noqa: E402
    QWEN2_SPLIT_PATTERN,
    SPECIAL_TOKENS,
    TAG_TOKENS,
    build_tiny_tokenizer,
)
from rlcore.rollout import run_rollouts  # noqa: E402
from rlcore.types import SamplingParams  # noqa: E402


def teacher_games(env, count: int, seed: int):
    return asyncio.run(
        run_rollouts(
            env, RandomValidPolicy(), env.examples(count, seed=seed), sampling=SamplingParams()
        )
    )


def merged_tokenizer(corpus: list[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE with the tiny tokenizer's normalizer, split and tags, merges learned
    on `corpus` up to `vocab_size` entries."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
    )
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAG_TOKENS])
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer)
    return tokenizer


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train-games", type=int, default=1000)
    parser.add_argument("--games", type=int, default=200, help="held-out games counted")
    parser.add_argument("--vocab-sizes", default="512,1024,4096")
    parser.add_argument("--out", default=None, help="JSON path")
    args = parser.parse_args(argv)

    env = load_environment("tictactoe")
    chars = build_tiny_tokenizer()

    def text(rollout) -> str:
        return chars.apply_chat_template(rollout.messages, tokenize=False)

    def replies(rollout) -> list[str]:
        return [m["content"] for m in rollout.messages if m["role"] == "assistant"]

    corpus = [text(r) for r in teacher_games(env, args.train_games, seed=11)]
    held_out = teacher_games(env, args.games, seed=12)
    encoders = {"characters (today)": lambda s: chars.encode(s, add_special_tokens=False)}
    for size in (int(v) for v in args.vocab_sizes.split(",")):
        merged = merged_tokenizer(corpus, size)
        encoders[f"merges, vocabulary {size}"] = lambda s, t=merged: t.encode(s).ids
    rows = []
    for name, encode in encoders.items():
        game = statistics.mean(len(encode(text(r))) for r in held_out)
        reply = statistics.mean(sum(len(encode(x)) for x in replies(r)) for r in held_out)
        rows.append({"tokenizer": name, "tokens_per_game": game, "reply_tokens_per_game": reply})
    base = rows[0]
    print(f"\n{args.games} held-out random-valid games ({args.train_games} to learn the merges)")
    print(
        f"{'tokenizer':28} {'tokens a game':>14} {'of them replies':>16} {'game ratio':>11} {'reply ratio':>12}"
    )
    for row in rows:
        row["game_ratio"] = row["tokens_per_game"] / base["tokens_per_game"]
        row["reply_ratio"] = row["reply_tokens_per_game"] / base["reply_tokens_per_game"]
        print(
            f"{row['tokenizer']:28} {row['tokens_per_game']:14.1f} "
            f"{row['reply_tokens_per_game']:16.1f} {row['game_ratio']:11.2f} {row['reply_ratio']:12.2f}"
        )
    results = {
        "benchmark": "tictactoe_tokens",
        "train_games": args.train_games,
        "games": args.games,
        "rows": rows,
    }
    return write_results(results, args.out, "tictactoe_tokens.json")


if __name__ == "__main__":
    main()
