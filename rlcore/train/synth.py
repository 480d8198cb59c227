"""Generate an SFT dataset: play a teacher policy through an environment and keep the
rollouts that pass the filters.

The teacher is anything `load_policy` accepts: an environment's built-in player, the tiny
model, a checkpoint, a hub id, or a served model behind `base_url`. Rollouts are played in
chunks until `max_kept` rollouts pass or the examples run out, and taken (kept or dropped,
the progress bar moved) one by one as they finish, in example order. A rollout is dropped for
the first filter it fails, checked in this order: an error, truncation, an excluded
outcome, a `format` reward below 1, too many invalid moves, a reward below `min_reward`.
The dataset is JSONL, one conversation per line (`{"messages", "env", "example_id",
"reward", "outcome"}`), and the kept and dropped-by-reason counts go to the sink's log, to
the returned dict and to `dataset.stats.json` beside the dataset.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from rlcore.envs.base import example_seed
from rlcore.envs.registry import load_environment
from rlcore.events import EventSink, NullSink
from rlcore.policy import load_policy
from rlcore.rollout import run_rollouts
from rlcore.train.config import SynthConfig, save_config
from rlcore.types import Example, Rollout, SamplingParams

# Message fields a chat template understands; anything else a rollout carries stays out.
MESSAGE_FIELDS = ("role", "content", "tool_calls", "tool_call_id", "name")


def drop_reason(rollout: Rollout, cfg: SynthConfig) -> str | None:
    """Why `rollout` fails the filters of `cfg` (the first failing one), or None to keep it."""
    if rollout.error:
        return "error"
    if rollout.truncated:
        return "truncated"
    if rollout.outcome in cfg.exclude_outcomes:
        return f"outcome:{rollout.outcome}"
    if cfg.require_format and rollout.rewards["format"] < 1.0:
        return "format"
    if (
        cfg.max_invalid_moves is not None
        and rollout.state.get("invalid_moves", 0) > cfg.max_invalid_moves
    ):
        return "invalid_moves"
    if cfg.min_reward is not None and rollout.reward < cfg.min_reward:
        return "min_reward"
    return None


def dataset_row(rollout: Rollout, env_name: str) -> dict:
    messages = [
        {key: message[key] for key in MESSAGE_FIELDS if message.get(key) is not None}
        for message in rollout.messages
    ]
    return {
        "messages": messages,
        "env": env_name,
        "example_id": rollout.example_id,
        "reward": rollout.reward,
        "outcome": rollout.outcome,
    }


async def play(
    env,
    policy,
    examples: list[Example],
    sampling: SamplingParams,
    repeats: int,
    concurrency: int,
    on_rollout: Callable[[Rollout], None],
) -> None:
    """`repeats` rollouts of each example (adjacent), each with its own sampling seed, handed
    to `on_rollout` in that order, each as soon as it and those before it are done (so
    progress moves rollout by rollout while what is kept stays independent of timing).

    One seed for all would replay the same game `repeats` times: the env's built-in players
    draw from (sampling seed, board), and a seeded model request from its own generator.
    """
    limit = asyncio.Semaphore(concurrency)

    async def one(example: Example, repeat: int) -> Rollout:
        seeded = replace(sampling, seed=example_seed(example.seed, repeat))
        async with limit:
            (rollout,) = await run_rollouts(env, policy, [example], sampling=seeded)
        return rollout

    tasks = [asyncio.ensure_future(one(e, r)) for e in examples for r in range(repeats)]
    try:
        for task in tasks:
            on_rollout(await task)
    finally:
        for task in tasks:
            task.cancel()


def _check_filters(cfg: SynthConfig, env) -> None:
    """Filters that cannot apply to this env are config errors, not silent no-ops."""
    if cfg.require_format and "format" not in env.rubric.names:
        raise ValueError(
            f"require_format=true needs a `format` reward function, and env {cfg.env!r} has "
            f"only {env.rubric.names}; set require_format=false"
        )
    if cfg.max_invalid_moves is not None and "invalid_moves" not in env.setup_state(
        env.make_example(0, cfg.seed)
    ):
        raise ValueError(
            f"max_invalid_moves={cfg.max_invalid_moves} needs an env that counts invalid "
            f"moves in its state, and env {cfg.env!r} does not; set max_invalid_moves=null"
        )


def run_synth(cfg: SynthConfig, sink: EventSink | None = None) -> dict:
    """Play, filter and write the dataset; returns {path, kept, dropped, played, ...}."""
    sink = sink or NullSink()
    cfg.validate()
    env = load_environment(cfg.env, **cfg.env_args)
    _check_filters(cfg, env)
    policy = load_policy(
        cfg.model,
        env=env,
        base_url=cfg.base_url,
        api_key_env=cfg.api_key_env,
        device=cfg.device,
        concurrency=cfg.concurrency,
    )
    output_dir = Path(cfg.output_dir)
    save_config(cfg, output_dir)
    path = output_dir / "dataset.jsonl"
    sampling = SamplingParams(
        temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=cfg.max_tokens
    )
    target = cfg.max_kept or cfg.num_examples * cfg.rollouts_per_example
    # Chunks of examples keep `max_kept` cheap with a slow teacher: stop once enough passed.
    chunk_size = max(1, cfg.concurrency // cfg.rollouts_per_example)
    kept, played, done = 0, 0, 0
    dropped: Counter[str] = Counter()
    outcomes: Counter[str] = Counter()
    started = time.monotonic()
    sink.log(f"synth: {cfg.model} on {cfg.env}, up to {cfg.num_examples} examples -> {path}")

    def take(rollout: Rollout) -> None:
        """Keep or drop one finished rollout, and move the bar."""
        nonlocal kept, played, done
        played += 1
        outcomes[str(rollout.outcome)] += 1
        reason = drop_reason(rollout, cfg)
        if reason is None and kept >= target:
            reason = "max_kept"
        if reason is not None:
            dropped[reason] += 1
        else:
            out.write(json.dumps(dataset_row(rollout, cfg.env)) + "\n")
            kept += 1
        done = min(kept, target) if cfg.max_kept else played
        sink.progress(done, target, "synth")

    # One event loop for the whole run: an endpoint client keeps its connections on it.
    loop = asyncio.new_event_loop()
    try:
        with path.open("w") as out:
            for offset in range(0, cfg.num_examples, chunk_size):
                if kept >= target or sink.should_stop():
                    break
                examples = env.examples(
                    min(chunk_size, cfg.num_examples - offset), seed=cfg.seed, offset=offset
                )
                loop.run_until_complete(
                    play(
                        env,
                        policy,
                        examples,
                        sampling,
                        cfg.rollouts_per_example,
                        cfg.concurrency,
                        take,
                    )
                )
        if done < target:  # the examples ran out first: close the bar at its end
            sink.progress(target, target, "synth")
    finally:
        loop.run_until_complete(policy.aclose())
        loop.close()

    stats = {
        "path": str(path),
        "kept": kept,
        "dropped": dict(sorted(dropped.items())),
        "played": played,
        "outcomes": dict(sorted(outcomes.items())),
        "seconds": round(time.monotonic() - started, 3),
    }
    stats_path = output_dir / "dataset.stats.json"
    stats_path.write_text(json.dumps(stats, indent=2) + "\n")
    stats["stats_path"] = str(stats_path)
    dropped_text = ", ".join(f"{k}={v}" for k, v in stats["dropped"].items()) or "none"
    sink.log(f"synth: kept {kept} of {played} rollouts; dropped by reason: {dropped_text}")
    if kept == 0:
        sink.log("synth: no rollout passed the filters; the dataset is empty", "warning")
    return stats
