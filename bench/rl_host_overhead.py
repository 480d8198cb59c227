"""Host seconds of a large tic-tac-toe RL step with the model's work taken out: what is
left of a step's time on the CPU when the GPU costs nothing.

    python bench/rl_host_overhead.py [--games 1024] [--repeats 3] [--before DIR]
        [--gc-threshold N]

It runs the real code path of `bench/tictactoe_rl_step.py`'s step (the tic-tac-toe env
with the recipe's settings, `run_rollouts`, the local engine with the tiny model's
tokenizer and every concurrent turn in one batch, then advantages and training
sequences) with one stand-in: the engine's sampling (`LocalEngine._sample`, the only part
that runs the model) returns 64 token ids drawn from the vocabulary, seeded by the
prompt's ids, different for each rollout of a group, as an untrained model's replies are
(every reply an invalid move, so every game runs its 6 turns). What remains is host work: rendering and tokenizing the turn
prompts, the engine's per-request bookkeeping, decoding replies, playing and scoring the
games, building the sequences; and, timed apart (`collate`), the update's host side: every
sequence collated into micro-batches of 32 on the CPU.

Each timed step reports wall seconds of the rollout (less the stand-in's own time) and
of the scoring, medians of `--repeats` steps after one untimed; one more step runs under
cProfile (both the event loop's thread and the engine's) and is split into parts. With
`--before DIR` the same measurement runs, interleaved step by step, on the code in DIR
(a `git worktree` of an earlier commit) in a child process, and the table puts the two
side by side; each side prints a digest of every prompt, reply and training sequence,
which must be equal. `--gc-threshold` sets the garbage collector's first threshold on
both sides: a step keeps millions of token ids in lists, which every full collection
walks. Writes bench/results/rl_host_overhead.json.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import hashlib
import json
import os
import pstats
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ENV_ARGS = {
    "min_random_move_prob": 0.0,
    "max_random_move_prob": 1.0,
    "num_groups": 4,
    "max_turns": 6,
    "opening_moves": 2,
}
REPLY_TOKENS = 64
# Parts of the profiled step: (name, groups of functions "file:function"). A part's time
# is the sum over its groups of the largest cumulative time in the group: a group lists
# the same work under the names the code before and after gives it (one may call the other).
PARTS = (
    ("render prompts", (("local.py:render_prompt",),)),
    ("tokenize prompts", (("prompts.py:encode", "tokenization_utils_base.py:__call__"),)),
    ("decode replies", (("local.py:_decode_replies", "tokenization_utils_base.py:decode"),)),
    ("env turns", (("tictactoe.py:env_response",), ("tictactoe.py:is_completed",))),
    ("score rollouts", (("base.py:score",), ("base.py:rollout_facts",))),
    ("advantages", (("grpo.py:step_advantages",),)),
    ("training sequences", (("sequences.py:training_sequences",),)),
)


def stand_in_sample(requests) -> list[tuple[list[int], list[float], str]]:
    """64 token ids per request, drawn from the vocabulary (no special tokens) with a seed
    made of the prompt's ids and how many requests of the batch had that prompt before, so
    the rollouts of a group reply differently (as sampling does) and two runs given the same
    prompts in the same order reply the same."""
    replies, seen = [], {}
    for request in requests:
        prompt = tuple(request.prompt_ids)
        seen[prompt] = seen.get(prompt, -1) + 1
        rng = random.Random(hash((prompt, seen[prompt])))  # an int tuple's hash is stable
        ids = rng.choices(range(3, VOCAB), k=REPLY_TOKENS)
        replies.append((ids, [-1.0] * REPLY_TOKENS, "length"))
    return replies


VOCAB = 0


class Harness:
    """One engine, env and config; `step()` plays and scores one batch of games."""

    def __init__(self, games: int):
        global VOCAB
        import torch

        from rlcore.envs.registry import load_environment
        from rlcore.policy.local import LocalEngine
        from rlcore.train.common import load_model_and_tokenizer
        from rlcore.train.config import RLConfig, load_config
        from rlcore.train.sampling import StratifiedSampler

        settings = [
            "model=tiny", "env=tictactoe", f"batch_size={games}", "rollouts_per_example=8",
            "advantage=tree", "loss_aggregation=turn", "temperature=0.7",
            f"max_tokens={REPLY_TOKENS}", "save_every=0", "device=cpu",
            f"concurrency={games}", f"env_args={json.dumps(ENV_ARGS)}",
            "output_dir=/tmp/rl_host_overhead",
        ]  # fmt: skip
        self.cfg = load_config(RLConfig, None, settings)
        self.env = load_environment(self.cfg.env, **self.cfg.env_args)
        model, tokenizer = load_model_and_tokenizer("tiny", torch.device("cpu"))
        VOCAB = len(tokenizer)
        self.engine = LocalEngine(
            None, model=model, tokenizer=tokenizer, name="policy", max_batch_size=games
        )
        self.stand_in_seconds = 0.0
        self.stand_in_cpu_seconds = 0.0
        self.gc_seconds = 0.0
        gc_started = [0.0]

        def time_gc(phase, _info):
            if phase == "start":
                gc_started[0] = time.perf_counter()
            else:
                self.gc_seconds += time.perf_counter() - gc_started[0]

        gc.callbacks.append(time_gc)

        def timed_sample(requests):
            started, started_cpu = time.perf_counter(), time.process_time()
            try:
                return stand_in_sample(requests)
            finally:
                self.stand_in_seconds += time.perf_counter() - started
                self.stand_in_cpu_seconds += time.process_time() - started_cpu

        self.engine._sample = timed_sample
        self.sampler = StratifiedSampler(self.env, self.cfg.seed, games // 8)
        self.loop = asyncio.new_event_loop()
        self.worker_profile: cProfile.Profile | None = None
        run_batch = self.engine._run_batch

        def profiled_run_batch(batch):
            if self.worker_profile is None:
                return run_batch(batch)
            try:
                self.worker_profile.enable()
            except ValueError:  # Python 3.12+: one profiler sees every thread already
                return run_batch(batch)
            try:
                return run_batch(batch)
            finally:
                self.worker_profile.disable()

        self.engine._run_batch = profiled_run_batch

    def step(self) -> tuple[dict, str]:
        """Seconds of the step's parts, and the digest of everything it produced."""
        from rlcore.rollout import run_rollouts
        from rlcore.train import grpo
        from rlcore.train.grpo import loss_normalizer, step_advantages
        from rlcore.train.sequences import collate, micro_batches, training_sequences
        from rlcore.types import SamplingParams

        cfg = self.cfg
        sampling = SamplingParams(temperature=0.7, max_tokens=REPLY_TOKENS)
        stand_in, gc_seconds = self.stand_in_seconds, self.gc_seconds
        stand_in_cpu = self.stand_in_cpu_seconds
        started, started_cpu = time.perf_counter(), time.process_time()
        rollouts = self.loop.run_until_complete(
            run_rollouts(
                self.env,
                self.engine,
                self.sampler.next_batch(),
                sampling=sampling,
                rollouts_per_example=8,
                concurrency=cfg.sampling.concurrency,
            )
        )
        rolled = time.perf_counter()
        if hasattr(grpo, "step_sequences"):  # the trainer's own steps 3-4 (eleventh session)
            sequences, _, _ = grpo.step_sequences(self.env, rollouts, cfg, None, {})
        else:  # the code before it, inline as the trainer had it
            turn_advantages, _ = step_advantages(self.env, rollouts, cfg)
            sequences = []
            for rollout, advantages in zip(rollouts, turn_advantages, strict=True):
                sequences += training_sequences(rollout, advantages, cfg.loss.aggregation)
            loss_normalizer(sequences, cfg.loss, REPLY_TOKENS)
        micro_batches([s for s in sequences if any(s.advantages)], 128)
        scored, scored_cpu = time.perf_counter(), time.process_time()
        # The update's host side: every sequence collated into the mastery runs'
        # micro-batches of 32 (as a step that trains on all of them would).
        batches = [
            collate(chunk, self.engine.tokenizer.pad_token_id, "cpu")
            for chunk in micro_batches(sequences, 32)
        ]
        collated, collated_cpu = time.perf_counter(), time.process_time()
        digest = hashlib.sha256()
        for batch in batches:
            for tensor in batch:
                digest.update(tensor.numpy().tobytes())
        for rollout in rollouts:
            digest.update(json.dumps([rollout.messages, rollout.reward, rollout.facts]).encode())
            for turn in rollout.turns:
                digest.update(json.dumps([turn.prompt_ids, turn.completion_ids]).encode())
        for sequence in sequences:
            digest.update(
                json.dumps(
                    [
                        sequence.input_ids,
                        sequence.weights,
                        sequence.advantages,
                        sequence.sampled_logprobs,
                        sequence.turns,
                    ]
                ).encode()
            )
        seconds = {
            "rollout": rolled - started - (self.stand_in_seconds - stand_in),
            "scoring": scored - rolled,
        }
        seconds["host"] = seconds["rollout"] + seconds["scoring"]
        seconds["collate"] = collated - scored
        seconds["collate cpu"] = collated_cpu - scored_cpu
        # CPU seconds of the process (all its threads): what other processes' load on the
        # same cores disturbs least.
        seconds["host cpu"] = scored_cpu - started_cpu - (self.stand_in_cpu_seconds - stand_in_cpu)
        seconds["of which gc"] = self.gc_seconds - gc_seconds
        counts = {
            "prompts": sum(len(r.turns) for r in rollouts),
            "sequences": len(sequences),
            "prompt_tokens": sum(len(t.prompt_ids) for r in rollouts for t in r.turns),
        }
        return seconds | counts, digest.hexdigest()[:16]

    def profiled_step(self) -> dict:
        """One step under cProfile (event loop and engine thread): seconds per part."""
        main, self.worker_profile = cProfile.Profile(), cProfile.Profile()
        main.enable()
        try:
            self.step()
        finally:
            main.disable()
        stats = pstats.Stats(main)
        self.worker_profile.create_stats()
        if self.worker_profile.stats:  # empty where the loop's profiler saw every thread
            stats.add(self.worker_profile)
        self.worker_profile = None
        cumulative: dict[str, float] = {}
        for (filename, _, function), (_, _, _, seconds, _) in stats.stats.items():
            where = f"{Path(filename).name}:{function}"
            cumulative[where] = cumulative.get(where, 0.0) + seconds
        return {
            part: sum(max(cumulative.get(name, 0.0) for name in group) for group in groups)
            for part, groups in PARTS
        }


def child(games: int) -> None:
    """Serve steps over stdin/stdout for the parent: 'step' or 'profile' a line."""
    harness = Harness(games)
    for line in sys.stdin:
        command = line.strip()
        if command == "step":
            seconds, digest = harness.step()
            print(json.dumps({"seconds": seconds, "digest": digest}), flush=True)
        elif command == "profile":
            print(json.dumps({"parts": harness.profiled_step()}), flush=True)


class Side:
    """The code under test, here or in a child process running another checkout."""

    def __init__(self, games: int, code: Path | None, extra_args: list[str]):
        self.code = code
        if code is None:
            self.harness = Harness(games)
            return
        env = os.environ | {"PYTHONPATH": str(code)}
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--child", "--games", str(games), *extra_args],
            cwd=code,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def ask(self, command: str) -> dict:
        if self.code is None:
            if command == "step":
                seconds, digest = self.harness.step()
                return {"seconds": seconds, "digest": digest}
            return {"parts": self.harness.profiled_step()}
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        return json.loads(self.process.stdout.readline())

    def close(self) -> None:
        if self.code is not None:
            self.process.stdin.close()
            self.process.wait()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--games", type=int, default=1024, help="games per step")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per side")
    parser.add_argument("--before", default=None, help="a checkout of the code to compare with")
    parser.add_argument(
        "--gc-threshold",
        type=int,
        default=None,
        help="the garbage collector's first threshold, both sides (Python's default: 700)",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help="JSON path")
    args = parser.parse_args(argv)
    extra_args = []
    if args.gc_threshold is not None:
        # Fewer young collections, and far fewer full ones (each walks every live list).
        gc.set_threshold(args.gc_threshold, 50, 100)
        extra_args = ["--gc-threshold", str(args.gc_threshold)]
    if args.child:
        child(args.games)
        return {}
    sides = {"after": Side(args.games, None, extra_args)}
    if args.before:
        sides = {"before": Side(args.games, Path(args.before).resolve(), extra_args)} | sides
    steps: dict[str, list[dict]] = {name: [] for name in sides}
    digests: dict[str, list[str]] = {name: [] for name in sides}
    parts: dict[str, dict] = {}
    try:
        for side in sides.values():
            side.ask("step")  # untimed: first-use costs
        for repeat in range(args.repeats):
            for name, side in sides.items():
                answer = side.ask("step")
                steps[name].append(answer["seconds"])
                digests[name].append(answer["digest"])
                seconds = answer["seconds"]
                print(
                    f"  {name} step {repeat + 1}: host {seconds['host']:.2f} s, "
                    f"cpu {seconds['host cpu']:.2f} s"
                )
        for name, side in sides.items():
            parts[name] = side.ask("profile")["parts"]
    finally:
        for side in sides.values():
            side.close()

    summaries = {}
    for name in sides:
        summaries[name] = {
            key: statistics.median(step[key] for step in steps[name])
            for key in (
                "rollout",
                "scoring",
                "host",
                "of which gc",
                "host cpu",
                "collate",
                "collate cpu",
                "prompts",
                "sequences",
                "prompt_tokens",
            )
        }
    print(f"\nhost seconds of a {args.games}-game tic-tac-toe RL step, model work excluded")
    print(f"medians of {args.repeats} steps; parts from one profiled step (cProfile, slower)")
    print(f"garbage collector threshold: {gc.get_threshold()[0]}")
    names = list(sides)
    print(f"{'':<34}" + "".join(f"{name:>12}" for name in names))
    for key in ("rollout", "scoring", "host", "of which gc", "host cpu", "collate", "collate cpu"):
        print(f"{key + ' s':<34}" + "".join(f"{summaries[n][key]:>12.3f}" for n in names))
    for part, _ in PARTS:
        print(
            f"{'  ' + part + ' s (profiled)':<34}"
            + "".join(f"{parts[n].get(part, 0.0):>12.3f}" for n in names)
        )
    for key in ("prompts", "prompt_tokens", "sequences"):
        print(f"{key:<34}" + "".join(f"{summaries[n][key]:>12.0f}" for n in names))
    print(f"{'digest of step 1':<34}" + "  ".join(digests[n][0] for n in names))
    # Both sides draw the same batches step by step, so their steps' digests must pair up.
    same = all(digests[n] == digests[names[0]] for n in names)
    print("results identical" if same else "RESULTS DIFFER")
    results = {
        "benchmark": "rl_host_overhead",
        "games": args.games,
        "repeats": args.repeats,
        "before": args.before,
        "gc_threshold": args.gc_threshold,
        "summaries": summaries,
        "steps": steps,
        "profiled_parts": parts,
        "digests": digests,
        "identical": same,
    }
    sys.path.insert(0, str(HERE))
    from benchlib import write_results

    return write_results(results, args.out, "rl_host_overhead.json")


if __name__ == "__main__":
    main()
