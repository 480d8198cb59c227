"""Check on the GPU: does the CUDA-graph static decoder play and sample tic-tac-toe like the
engine's dynamic loop? (docs/mastery.md, "The static decoder cleared".)

`play`: SFT of the tiny model once (or `--sft DIR`), then that one model played by each
decode loop, bf16 (as evaluation loads it) and fp32 (as the RL trainer holds it):
greedy games against the random opponent (invalid moves, and how many turn prompts got the
same reply as the first loop's), and sampled games at the RL temperature against the
training opponents, every sampled token checked against a plain fp32 forward pass: its
randomized probability integral transform (uniform on [0, 1) for a correct sampler; the
Kolmogorov distance is printed with its 1 % bound) and the gap between the logprob the
engine reported and the forward pass's.

`rl`: one RL run of the default recipe's settings from a given SFT model, rollouts through
`--decode`, then 300 greedy games against each opponent. Run several seeds of each loop at
once to compare them (run_rl has no decode setting, so the engine class is wrapped here).

    python3 bench/static_decode_check.py play --out /tmp/dc
    python3 bench/static_decode_check.py rl --sft /tmp/dc/sft/final --decode static --seed 0
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))
sys.path.insert(0, str(ROOT))

import tictactoe_mastery as mastery  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

import rlcore.train.grpo as grpo  # noqa: E402
from rlcore.evaluate import EvalConfig, arun_eval  # noqa: E402
from rlcore.events import NullSink  # noqa: E402
from rlcore.policy.local import LocalEngine  # noqa: E402
from rlcore.policy.static_decode import StaticDecoder  # noqa: E402
from rlcore.policy.tiny import ensure_tiny_model  # noqa: E402
from rlcore.train.config import RLConfig  # noqa: E402

ENV_ARGS = {"max_turns": 6, "num_groups": 4, "reasoning": "empty"}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# (dtype, decode loop, CUDA graphs, batch cap): the first is the reference for "same reply".
GREEDY_LOOPS = [
    ("bf16", "dynamic", True, None),
    ("bf16", "static", True, None),
    ("bf16", "static", False, None),
    ("bf16", "static", True, 64),
    ("fp32", "dynamic", True, None),
    ("fp32", "static", True, None),
]
SAMPLED_LOOPS = [("fp32", "dynamic"), ("fp32", "static"), ("bf16", "dynamic"), ("bf16", "static")]
RL_TEMPERATURE = 0.7


def card() -> str:
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def play(engine, games: int, temperature: float, random_move_probs, seed: int, device: str):
    cfg = EvalConfig(
        env="tictactoe",
        model=engine.name,
        env_args={
            **ENV_ARGS,
            "min_random_move_prob": random_move_probs[0],
            "max_random_move_prob": random_move_probs[1],
        },
        num_examples=games,
        max_tokens=64,
        temperature=temperature,
        concurrency=256,
        seed=seed,
        device=device,
    )
    started = time.monotonic()
    result = asyncio.run(arun_eval(cfg, NullSink(), policy=engine))
    summary = result.summary
    return result.rollouts, {
        "invalid": summary["env_metrics"]["tictactoe/invalid_move_rate"],
        "unfinished": summary["outcomes"]["unfinished"]["rate"],
        "win": summary["outcomes"]["win"]["rate"],
        "seconds": round(time.monotonic() - started, 1),
    }


def token_checks(model, turns, device: str) -> dict:
    """Transform of every sampled token under a plain fp32 forward pass, and logprob gaps."""
    jitter = torch.Generator().manual_seed(1)
    draws, gaps = [], []
    for start in range(0, len(turns), 64):
        chunk = turns[start : start + 64]
        width = max(len(t.prompt_ids) + len(t.completion_ids) for t in chunk)
        ids = torch.tensor(
            [t.prompt_ids + t.completion_ids + [0] * (width - len(t.prompt_ids) - len(t.completion_ids))
             for t in chunk], device=device,
        )  # fmt: skip
        with torch.no_grad():
            probabilities = torch.softmax(model(input_ids=ids).logits.float() / RL_TEMPERATURE, -1)
        below = probabilities.cumsum(-1) - probabilities
        for row, turn in enumerate(chunk):
            steps = torch.arange(len(turn.completion_ids), device=device) + len(turn.prompt_ids) - 1
            tokens = torch.tensor(turn.completion_ids, device=device)
            chosen = probabilities[row, steps, tokens].cpu()
            jitters = torch.rand(len(tokens), generator=jitter)
            draws.append(below[row, steps, tokens].cpu() + jitters * chosen)
            gaps.append((chosen.log() - torch.tensor(turn.logprobs)).abs())
    ordered = torch.cat(draws).sort().values.double()
    count = len(ordered)
    distance = max(
        (torch.arange(1, count + 1) / count - ordered).max().item(),
        (ordered - torch.arange(count) / count).max().item(),
    )
    gap = torch.cat(gaps)
    return {
        "tokens": count,
        "ks_distance": round(distance, 5),
        "ks_bound_1pct": round(1.63 / count**0.5, 5),
        "logprob_gap_mean": float(gap.mean()),
        "logprob_gap_max": float(gap.max()),
    }


def run_play(args) -> dict:
    if args.sft is None:
        base = ensure_tiny_model(hidden_size=128, num_layers=4)
        synth = mastery.teacher_games("random", 200, ENV_ARGS, Path(args.out) / "synth")
        args.seed = 0
        args.sft = mastery.warm_up(base, synth["path"], Path(args.out) / "sft", 40, args)
    tokenizer = AutoTokenizer.from_pretrained(args.sft)
    models = {
        name: AutoModelForCausalLM.from_pretrained(args.sft, dtype=dtype).to(args.device).eval()
        for name, dtype in DTYPES.items()
    }

    def engine(dtype: str, decode: str, graphs: bool = True, batch: int | None = None):
        built = LocalEngine(
            model=models[dtype], tokenizer=tokenizer, name=f"{dtype} {decode}", decode=decode,
            max_batch_size=batch,
        )  # fmt: skip
        if not graphs:
            built._static = StaticDecoder(
                built.model, built.eos_token_ids, built.pad_token_id, use_graphs=False
            )
        return built

    report = {"card": card(), "sft": args.sft, "greedy": {}, "sampled": {}}
    reference = None
    for dtype, decode, graphs, batch in GREEDY_LOOPS:
        name = (
            f"{dtype} {decode}"
            + ("" if graphs else " eager")
            + (f" batch {batch}" if batch else "")
        )
        rollouts, row = play(
            engine(dtype, decode, graphs, batch), args.games, 0.0, (1.0, 1.0), 10_000, args.device
        )
        replies = {tuple(t.prompt_ids): t.completion_ids for r in rollouts for t in r.turns}
        reference = reference or replies
        shared = [prompt for prompt in replies if prompt in reference]
        row["shared_prompts"] = len(shared)
        row["same_replies"] = sum(replies[p] == reference[p] for p in shared)
        report["greedy"][name] = row
        print("greedy", name, row, flush=True)
    for dtype, decode in SAMPLED_LOOPS:
        rollouts, row = play(
            engine(dtype, decode), args.sampled_games, RL_TEMPERATURE, (0.0, 1.0), 0, args.device
        )
        turns = [t for r in rollouts for t in r.turns]
        row |= token_checks(
            models.get("fp32") or engine("fp32", "static").model, turns, args.device
        )
        report["sampled"][f"{dtype} {decode}"] = row
        print("sampled", dtype, decode, row, flush=True)
    return report


def run_one_rl(args) -> dict:
    grpo.LocalEngine = functools.partial(LocalEngine, decode=args.decode)
    out = Path(args.out)
    settings = mastery.settings(
        RLConfig, model=args.sft, env="tictactoe",
        env_args={**ENV_ARGS, "min_random_move_prob": 0.0, "max_random_move_prob": 1.0,
                  "opening_moves": 2, "draw_reward": 0.5},
        output_dir=str(out / "rl"), max_steps=args.steps, batch_size=64, rollouts_per_example=8,
        loss_type="grpo", loss_aggregation="turn", advantage="tree", seed=args.seed, lr=1e-4,
        temperature=RL_TEMPERATURE, max_tokens=64, micro_batch_size=32, save_every=0,
        device=args.device,
    )  # fmt: skip
    started = time.monotonic()
    sink = mastery.DeadlineSink(
        started + args.minutes * 60, ["reward/mean", "tictactoe/invalid_move_rate"],
        out / "rl" / "metrics.jsonl",
    )  # fmt: skip
    final = grpo.run_rl(settings, sink)
    seconds = time.monotonic() - started
    steps = [json.loads(line) for line in (out / "rl" / "metrics.jsonl").open()]
    eval_args = argparse.Namespace(
        max_turns=6, reasoning="empty", max_tokens=64, eval_concurrency=256, out=str(out),
        device=args.device,
    )  # fmt: skip
    return {
        "card": card(),
        "decode": args.decode,
        "seed": args.seed,
        "steps": len(steps),
        "rl_seconds": round(seconds, 1),
        "train_invalid_last10": sum(s["tictactoe/invalid_move_rate"] for s in steps[-10:]) / 10,
        "logprob_mismatch": sum(s["policy/logprob_mismatch"] for s in steps) / len(steps),
        "eval": mastery.evaluate(final, 300, eval_args, "rl"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=["play", "rl"])
    parser.add_argument("--sft", help="SFT checkpoint (play: trained here when absent)")
    parser.add_argument("--games", type=int, default=300, help="greedy games a loop (play)")
    parser.add_argument("--sampled-games", type=int, default=512, help="sampled games (play)")
    parser.add_argument("--decode", choices=["static", "dynamic"], default="static")
    parser.add_argument("--seed", type=int, default=0, help="RL seed (rl)")
    parser.add_argument("--steps", type=int, default=100, help="RL steps (rl)")
    parser.add_argument("--minutes", type=float, default=5.0, help="RL time cap (rl)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default="/tmp/static_decode_check")
    parser.add_argument("--results", help="JSON file for the report")
    args = parser.parse_args()
    torch.set_num_threads(2)  # several runs share the host's cores
    report = run_play(args) if args.mode == "play" else run_one_rl(args)
    print("RESULT", json.dumps(report), flush=True)
    if args.results:
        Path(args.results).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
