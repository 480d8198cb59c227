"""The update's passes over token trees against plain micro-batches, side by side in one
process, on a rank's real tic-tac-toe sequences: seconds per `update_policy`, the tokens
each way computes, and whether the two give the same logprobs and gradient.

    python bench/tree_update.py [--device auto] [--games 8,128,256]
        [--micro-batch-size 64,256] [--repeats 12]
        [--recipe recipes/tictactoe_tiny/rl_gpu.toml] [--model tiny-master] [--out PATH]

For each size: one rollout of `--games` games of the recipe's env by `--model` (the local
engine), scored into training sequences as a step scores them (the ones with a gradient
kept, as the update keeps them). Then, for each micro-batch size, runs of `--repeats`
updates alternate plain / trees / plain / trees, the first two updates of each run not
counted. "plain": every pass a length-sorted, right-padded micro-batch (the GPU's passes
before the fifty-fourth session); "trees": `grpo.pass_batches` as the trainer runs it (on
a GPU, token-ordered runs as token trees; on the CPU, the cheapest runs). The check: the
first run of up to 64 sequences, its logprobs at the trained targets and the gradient of a
loss over them, computed plain and as one tree with the same weights. Writes
bench/results/tree_update_<device>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from benchlib import machine, recipe_rollouts, write_results  # noqa: E402

from rlcore.envs.registry import load_environment  # noqa: E402
from rlcore.policy.local import LocalEngine  # noqa: E402
from rlcore.train import grpo  # noqa: E402
from rlcore.train.common import autocast  # noqa: E402
from rlcore.train.config import RLConfig, load_config  # noqa: E402
from rlcore.train.sampling import StratifiedSampler  # noqa: E402
from rlcore.train.sequences import (  # noqa: E402
    collate,
    micro_batches,
    move_set_rows,
    token_tree,
    trained_targets,
    width_step,
)


def plain_batches(learner, sequences, size, trees=True):
    """Every pass a plain micro-batch, whatever the device."""
    return [(chunk, None) for chunk in micro_batches(sequences, size)]


def padded_tokens(chunk, multiple: int) -> int:
    """The tokens a plain pass over `chunk` computes: its rows at the padded width."""
    return len(chunk) * -(-max(len(s.input_ids) for s in chunk) // multiple) * multiple


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_sequences(args, games: int, device: torch.device):
    """A learner on `device` and one rollout's sequences with a gradient."""
    overrides = [f"model={args.model}", f"batch_size={games}", f"device={device.type}"]
    cfg = load_config(
        RLConfig, args.recipe, [*overrides, "actors=0", "output_dir=runs/bench/tree_update"]
    )
    env = load_environment(cfg.env, **cfg.env_args)
    learner, tokenizer, _ = grpo.build_learner(cfg, device, lambda: False)
    engine = LocalEngine(None, model=learner.model, tokenizer=tokenizer, name="policy")
    sampler = StratifiedSampler(env, cfg.seed, games // cfg.rollouts_per_example)
    loop = asyncio.new_event_loop()
    rollouts = recipe_rollouts(loop, env, engine, sampler.next_batch(), cfg, games)
    loop.run_until_complete(engine.aclose())
    loop.close()
    sequences, normalizer, _ = grpo.step_sequences(env, rollouts, cfg, tokenizer, {})
    return cfg, learner, [s for s in sequences if s.has_gradient], normalizer


def check(learner, sequences) -> dict:
    """Logprobs at the trained targets and the gradient, plain and as one tree."""
    device = learner.device
    chunk = sorted(sequences, key=lambda s: s.input_ids)[:64]
    input_ids, _, weights, advantages = collate(chunk, learner.pad_id, device)
    trained = trained_targets(chunk, input_ids.shape[1], device)
    move_sets = move_set_rows(chunk, device)
    results = []
    for tree in (None, token_tree(chunk, device)):
        learner.model.zero_grad(set_to_none=True)
        with autocast(device):
            logprobs, _, best = grpo.token_logprobs(
                learner.model, input_ids, 1.0, False, move_sets, tree, trained
            )
        loss = -(logprobs * advantages * weights).sum()
        if best is not None:
            loss = loss - best.sum()
        loss.backward()
        gradient = torch.cat([p.grad.flatten() for p in learner.model.parameters()])
        results.append((logprobs.detach()[weights > 0], gradient))
    learner.model.zero_grad(set_to_none=True)
    (plain, plain_gradient), (tree, tree_gradient) = results
    return {
        "checked_sequences": len(chunk),
        "logprob_max_abs_diff": float((plain - tree).abs().max()),
        "gradient_relative_diff": float(
            (plain_gradient - tree_gradient).norm() / plain_gradient.norm()
        ),
    }


def timed_updates(learner, sequences, normalizer, cfg, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        synchronize(learner.device)
        started = time.perf_counter()
        grpo.update_policy(learner, sequences, normalizer, cfg)
        synchronize(learner.device)
        times.append(time.perf_counter() - started)
    return statistics.median(times[2:])


def run_size(args, games: int, device: torch.device) -> list[dict]:
    cfg, learner, sequences, normalizer = step_sequences(args, games, device)
    tokens = sum(len(s.input_ids) for s in sequences)
    multiple = width_step(device)
    base = {
        "games": games,
        "sequences": len(sequences),
        "tokens": tokens,
        "trie_nodes": token_tree(sequences, "cpu").input_ids.shape[1],
        **check(learner, sequences),
    }
    rows, trees_pass = [], grpo.pass_batches
    for size in args.micro_batch_size:
        cfg.micro_batch_size = size
        plain_tokens = sum(
            padded_tokens(chunk, multiple) for chunk in micro_batches(sequences, size)
        )
        planned = trees_pass(learner, sequences, size)
        tree_tokens = sum(
            tree.input_ids.shape[1] if tree is not None else padded_tokens(chunk, multiple)
            for chunk, tree in planned
        )
        seconds = {"plain": [], "trees": []}
        try:
            for name in ("plain", "trees", "plain", "trees"):
                grpo.pass_batches = plain_batches if name == "plain" else trees_pass
                seconds[name].append(
                    timed_updates(learner, sequences, normalizer, cfg, args.repeats)
                )
        finally:
            grpo.pass_batches = trees_pass
        plain_s, trees_s = min(seconds["plain"]), min(seconds["trees"])
        rows.append(
            base
            | {
                "micro_batch_size": size,
                "plain_passes": len(micro_batches(sequences, size)),
                "tree_passes": len(planned),
                "plain_tokens": plain_tokens,
                "tree_tokens": tree_tokens,
                "plain_seconds": plain_s,
                "trees_seconds": trees_s,
                "plain_runs": seconds["plain"],
                "trees_runs": seconds["trees"],
                "speedup": plain_s / trees_s,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", default="recipes/tictactoe_tiny/rl_gpu.toml")
    parser.add_argument("--model", default="tiny-master")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--games", default="8,128,256")
    parser.add_argument("--micro-batch-size", default="64,256")
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.repeats < 3:
        parser.error("--repeats: at least 3 (the first two updates of a run are not counted)")
    args.micro_batch_size = [int(size) for size in args.micro_batch_size.split(",")]
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(args.device)
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else machine()
    rows = [
        row for games in map(int, args.games.split(",")) for row in run_size(args, games, device)
    ]
    print(f"\nthe update over token trees against plain micro-batches, {args.model}, {card}")
    print(
        f"{'games':>5} {'seqs':>5} {'tokens':>7} {'mb':>4} {'passes':>7} {'computed tokens':>16} "
        f"{'plain s':>8} {'trees s':>8} {'speed-up':>8} {'logprob diff':>12} {'grad diff':>9}"
    )
    for r in rows:
        print(
            f"{r['games']:>5} {r['sequences']:>5} {r['tokens']:>7} {r['micro_batch_size']:>4} "
            f"{r['plain_passes']:>3}/{r['tree_passes']:<3} "
            f"{r['plain_tokens']:>7}/{r['tree_tokens']:<8} {r['plain_seconds']:>8.4f} "
            f"{r['trees_seconds']:>8.4f} {r['speedup']:>7.2f}x "
            f"{r['logprob_max_abs_diff']:>12.2e} {r['gradient_relative_diff']:>9.2e}"
        )
    results = {
        "benchmark": "tree_update",
        "card": card,
        "device": args.device,
        "model": args.model,
        "recipe": args.recipe,
        "repeats": args.repeats,
        "command": "python bench/tree_update.py " + " ".join(argv or sys.argv[1:]),
        "rows": rows,
    }
    return write_results(results, args.out, f"tree_update_{device.type}.json")


if __name__ == "__main__":
    main()
