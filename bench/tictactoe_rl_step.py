"""Seconds per RL step of tic-tac-toe (multi-turn) at 64, 256 and 1024 games a step, split
into rollout / scoring / train, on one device in one process.

    python bench/tictactoe_rl_step.py [--device auto] [--games 64,256,1024] [--steps 3]
        [--micro-batch-size 128] [--profile] [--all-trained] [--[no-]prefix-store]
        [--max-batch-size N] [--recipe TOML --model NAME]

The step is `run_rl`'s (rlcore/train/grpo.py) written out with a clock between its parts,
on the built-in tiny model (untrained: replies run to `max_tokens` more often than a
trained model's) with the tic-tac-toe recipe's settings (recipes/tictactoe_tiny/rl.toml:
groups of 8, tree advantages, turn aggregation, lr 1e-4, temperature 0.7, 64 tokens a
reply, games of up to 6 turns from 2 opening moves):
- rollout: every game of the step played against the minimax opponent, the engine serving
  all concurrent turns in one batch (`concurrency` = games);
- scoring: advantages from the rewards and the training sequences with their weights;
- train: the optimizer update (forward, backward, step), synchronised before the clock
  reads.
The untrained model's games rarely differ within a group, so most advantages are 0 and
little is trained; `--all-trained` gives every rollout an advantage of +1 or -1 (alternating)
so the train column measures a step that trains on every sequence. The `reused` column is
the share of prompt tokens whose keys and values came from the engine's prefix store (a
turn starting from its conversation's previous turn); `--no-prefix-store` turns the store
off, `--prefix-store` keeps one where the engine would not (on a GPU, models under
`GPU_PREFIX_STORE_MIN_PARAMETERS`). `--max-batch-size` caps the engine's batch (default:
every concurrent turn of the step in one batch). The first step of each size (graph capture, allocator warm-up) is not timed; figures are
medians of `--steps` steps. `--profile` runs one more step of the largest size under the
torch profiler and prints its top operators. Writes bench/results/tictactoe_rl_step_<device>.json.

`--recipe` measures a recipe's own step instead (e.g. recipes/tictactoe_tiny/rl_gpu.toml,
the mastery recipe: its env args, self-play included, its loss, the sound mass), with
`--model` as the policy (e.g. `tiny-master`, a trained player whose replies end as a trained
model's do); the games a step, the device and the micro-batch size stay the command's, and
scoring is the trainer's own `step_sequences` (advantages, training sequences and the sound
mass's judged moves).
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from benchlib import write_results  # noqa: E402

from rlcore.envs.registry import load_environment  # noqa: E402
from rlcore.policy.local import LocalEngine  # noqa: E402
from rlcore.rollout import fewer_collections, run_rollouts  # noqa: E402
from rlcore.train.common import build_optimizer, load_model_and_tokenizer  # noqa: E402
from rlcore.train.config import RLConfig, load_config  # noqa: E402
from rlcore.train.grpo import (  # noqa: E402
    Learner,
    loss_normalizer,
    score_sequences,
    step_advantages,
    step_sequences,
    update_policy,
)
from rlcore.train.sampling import StratifiedSampler  # noqa: E402
from rlcore.train.sequences import micro_batches, training_sequences  # noqa: E402
from rlcore.types import SamplingParams  # noqa: E402

ENV_ARGS = (
    '{"min_random_move_prob": 0.0, "max_random_move_prob": 1.0, "num_groups": 4, '
    '"max_turns": 6, "opening_moves": 2}'
)


def config(
    games: int,
    device: str,
    micro_batch_size: int,
    output_dir: str,
    recipe: str | None = None,
    model: str = "tiny",
) -> RLConfig:
    """The benchmark's settings, or `recipe`'s with the command's size, device and model."""
    if recipe is not None:
        overrides = [
            f"model={model}", f"batch_size={games}", f"concurrency={games}",
            f"micro_batch_size={micro_batch_size}", "save_every=0", f"device={device}",
            f"output_dir={output_dir}", "max_steps=1000000", "select.keep=1", "select.average=0",
        ]  # fmt: skip
        # (select.keep=1: no saves, so no choice among them)
        cfg = load_config(RLConfig, recipe, overrides)
        if cfg.loss.beta > 0:  # the step below holds no reference model
            raise SystemExit(f"--recipe {recipe}: beta = {cfg.loss.beta} needs a reference model")
        return cfg
    settings = [
        f"model={model}", "env=tictactoe", f"batch_size={games}", "rollouts_per_example=8",
        "advantage=tree", "loss_aggregation=turn", f"micro_batch_size={micro_batch_size}",
        "lr=1e-4", "lr_schedule=constant", "warmup_steps=5", "temperature=0.7",
        "max_tokens=64", "save_every=0", f"device={device}", f"concurrency={games}",
        f"env_args={ENV_ARGS}", f"output_dir={output_dir}",
    ]  # fmt: skip
    return load_config(RLConfig, None, settings)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def padding_share(chunks) -> float:
    """Share of the trained micro-batches' positions that are padding: what packing the
    sequences into rows could save at most."""
    positions = sum(len(chunk) * max(len(s.input_ids) for s in chunk) for chunk in chunks)
    tokens = sum(len(s.input_ids) for chunk in chunks for s in chunk)
    return 1 - tokens / max(positions, 1)


def run_size(
    games: int,
    device_name: str,
    steps: int,
    micro_batch_size: int,
    profile: bool,
    all_trained: bool,
    prefix_store: str = "auto",
    max_batch_size: int | None = None,
    recipe: str | None = None,
    model_name: str = "tiny",
):
    """Per-step seconds (rollout, scoring, train) at `games` games a step."""
    with tempfile.TemporaryDirectory() as output_dir:
        cfg = config(
            games, device_name, min(micro_batch_size, games), output_dir, recipe, model_name
        )
    device = torch.device(device_name)
    torch.manual_seed(0)
    env = load_environment(cfg.env, **cfg.env_args)
    model, tokenizer = load_model_and_tokenizer(cfg.model, device)
    model.eval()
    optimizer, scheduler = build_optimizer(model, cfg.optimizer, steps + 2)
    sampler = StratifiedSampler(env, cfg.seed, games // cfg.rollouts_per_example)
    engine = LocalEngine(
        None,
        model=model,
        tokenizer=tokenizer,
        name="policy",
        prefix_cache_bytes={"auto": None, "on": 4 * 2**30, "off": 0}[prefix_store],
        max_batch_size=max_batch_size,
    )
    store = engine.prefix_cache
    learner = Learner(
        model, None, optimizer, scheduler, tokenizer.pad_token_id, device, lambda: False
    )
    sampling = SamplingParams(
        temperature=cfg.sampling.temperature,
        top_p=cfg.sampling.top_p,
        max_tokens=cfg.sampling.max_tokens,
    )
    pieces: dict[int, str] = {}  # token texts, as run_rl keeps them across steps
    loop = asyncio.new_event_loop()

    def one_step() -> dict:
        batches, tokens = engine.batches_run, engine.tokens_generated
        looked_up, reused = (store.tokens_looked_up, store.tokens_reused) if store else (0, 0)
        started = time.perf_counter()
        rollouts = loop.run_until_complete(
            run_rollouts(
                env,
                engine,
                sampler.next_batch(),
                sampling=sampling,
                rollouts_per_example=cfg.rollouts_per_example,
                concurrency=cfg.sampling.concurrency,
            )
        )
        rolled = time.perf_counter()
        if all_trained:
            with fewer_collections:  # as grpo.step_sequences builds them
                turn_advantages, _ = step_advantages(env, rollouts, cfg)
                turn_advantages = [
                    [1.0 if index % 2 else -1.0] * len(turns)
                    for index, turns in enumerate(turn_advantages)
                ]
                sequences = []
                for rollout, advantages in zip(rollouts, turn_advantages, strict=True):
                    sequences += training_sequences(rollout, advantages, cfg.loss.aggregation)
                normalizer = loss_normalizer(sequences, cfg.loss, cfg.sampling.max_tokens)
        else:  # the trainer's own steps 3-4
            sequences, normalizer, _ = step_sequences(env, rollouts, cfg, tokenizer, pieces)
        chunks = micro_batches([s for s in sequences if s.has_gradient], cfg.micro_batch_size)
        if cfg.num_iterations > 1:
            score_sequences(learner, sequences, cfg)
        sync(device)
        scored = time.perf_counter()
        update_policy(learner, sequences, normalizer, cfg)
        sync(device)
        trained = time.perf_counter()
        return {
            "rollout": rolled - started,
            "scoring": scored - rolled,
            "train": trained - scored,
            "step": trained - started,
            "engine_batches": engine.batches_run - batches,
            "tokens_generated": engine.tokens_generated - tokens,
            "sequences": len(sequences),
            "trained_tokens": sum(s.trained_tokens for s in sequences),
            "padding": padding_share(chunks),
            "reused": (store.tokens_reused - reused) / max(store.tokens_looked_up - looked_up, 1)
            if store
            else 0.0,
        }

    try:
        one_step()  # untimed
        measured = [one_step() for _ in range(steps)]
        profile_table = None
        if profile:
            from torch.profiler import ProfilerActivity
            from torch.profiler import profile as torch_profile

            activities = [ProfilerActivity.CPU]
            if device.type == "cuda":
                activities.append(ProfilerActivity.CUDA)
            with torch_profile(activities=activities) as profiler:
                profiled = one_step()
            sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
            profile_table = {
                "step": profiled,
                "by_device_time": profiler.key_averages().table(sort_by=sort, row_limit=20),
                "by_cpu_time": profiler.key_averages().table(
                    sort_by="cpu_time_total", row_limit=20
                ),
            }
    finally:
        loop.run_until_complete(engine.aclose())
        loop.close()
    summary = {
        key: statistics.median(m[key] for m in measured)
        for key in (
            "rollout",
            "scoring",
            "train",
            "step",
            "engine_batches",
            "tokens_generated",
            "sequences",
            "trained_tokens",
            "padding",
            "reused",
        )  # fmt: skip
    }
    summary |= {"games": games, "decode": engine.decode, "max_batch_size": engine.max_batch_size}
    return summary, measured, profile_table


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda")
    parser.add_argument("--games", default="64,256,1024", help="games per step, comma-separated")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per size")
    parser.add_argument(
        "--micro-batch-size", type=int, default=128, help="sequences per training micro-batch"
    )
    parser.add_argument("--profile", action="store_true", help="profile one step (largest)")
    parser.add_argument("--all-trained", action="store_true", help="advantage +-1 on every rollout")
    parser.add_argument(
        "--no-prefix-store", action="store_true", help="every turn prefills its whole prompt"
    )
    parser.add_argument(
        "--prefix-store", action="store_true", help="a store even where the engine keeps none"
    )
    parser.add_argument(
        "--max-batch-size", type=int, default=None, help="engine batch cap (default: the engine's)"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument(
        "--recipe", default=None, help="an RL recipe whose step to measure (its settings)"
    )
    parser.add_argument("--model", default="tiny", help="the policy: tiny, tiny-master, a dir")
    parser.add_argument("--out", default=None, help="JSON path (default by device)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    card = (
        torch.cuda.get_device_name()
        if device.startswith("cuda")
        else f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    )
    sizes = [int(n) for n in args.games.split(",")]
    if args.no_prefix_store and args.prefix_store:
        parser.error("--no-prefix-store and --prefix-store: choose one")
    store = "off" if args.no_prefix_store else "on" if args.prefix_store else "auto"
    summaries, details, profile_table = [], {}, None
    for games in sizes:
        summary, measured, table = run_size(
            games,
            device,
            args.steps,
            args.micro_batch_size,
            args.profile and games == sizes[-1],
            args.all_trained,
            store,
            args.max_batch_size,
            args.recipe,
            args.model,
        )
        summaries.append(summary)
        details[games] = measured
        profile_table = table or profile_table
        print(f"  {games} games: {summary['step']:.2f} s/step", flush=True)

    trained = ", every rollout trained (advantage +-1)" if args.all_trained else ""
    setting = f"{args.model}, {args.recipe or 'the benchmark settings'}"
    print(f"\ntic-tac-toe RL step, {setting}, {device} ({card}){trained}")
    print(
        f"{'card':<22}{'games':>6}{'rollout s':>11}{'scoring s':>11}{'train s':>9}{'step s':>8}"
        f"{'vs 64':>7}{'batches':>9}{'tokens':>9}{'games/s':>9}{'padding':>9}{'reused':>8}"
    )
    base = summaries[0]["step"]
    for s in summaries:
        print(
            f"{card[:21]:<22}{s['games']:>6}{s['rollout']:>11.2f}{s['scoring']:>11.3f}"
            f"{s['train']:>9.2f}{s['step']:>8.2f}{s['step'] / base:>6.2f}x"
            f"{s['engine_batches']:>9.0f}{s['tokens_generated']:>9.0f}"
            f"{s['games'] / s['step']:>9.1f}{s['padding']:>9.1%}{s['reused']:>8.1%}"
        )
        s["card"] = card
    if profile_table:
        print(f"\nprofile of one step at {sizes[-1]} games:")
        print(profile_table["by_device_time"])
        print(profile_table["by_cpu_time"])
    results = {
        "benchmark": "tictactoe_rl_step",
        "device": device,
        "card": card,
        "torch": torch.__version__,
        "micro_batch_size": args.micro_batch_size,
        "all_trained": args.all_trained,
        "prefix_store": store,
        "model": args.model,
        "recipe": args.recipe,
        "summaries": summaries,
        "steps": details,
        "profile": profile_table,
    }
    return write_results(results, args.out, f"tictactoe_rl_step_{device.split(':')[0]}.json")


if __name__ == "__main__":
    main()
