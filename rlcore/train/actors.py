"""Rollout actors: RL whose rollouts are played in other processes while the learner trains.

With `RLConfig.actors` = N > 0 a run is one learner (the calling process, `grpo.run_rl`) and N
actor processes (`run_actor`, started as `distributed.launch` starts ranks, without a process
group). Each actor loads the policy, then over and over: takes the newest weights the learner
published, draws a batch of examples from its own stream, rolls it out with its own engine,
scores it and builds its training sequences (steps 1-4 of a step), and hands the batch to the
learner. The learner takes the batches as they come, one a step, trains on each (step 5),
publishes its weights, logs and saves (step 6). So a step's rollouts and its update no longer
wait for each other, and the rollouts' host work (the games, the prompts, the engine's
bookkeeping) runs on N more CPU cores.

The price is staleness: a batch was played by weights some steps older than the ones it
trains (`async/lag`, about N at most, since an actor starts its next batch only once the
learner took its last one, with the newest weights). The loss takes the engine's sampled
logprobs as the old policy's, so the importance ratio measures the gap and the clip bounds it
(`policy/clip_fraction`; `policy/logprob_mismatch` reads how far the policy moved).

The board (`Board`) is a directory in shared memory: the header (the published weights'
version, the version being written, the stop flag, and per actor the batches the learner took
and its pid), two slots of flat weights (version v in slot v mod 2: the learner writes one
while actors read the other; an actor whose slot was begun again during its copy, two
versions on, reads again), and each actor's finished batch as a pickle. A stop request, the
end of the run or a failure on the learner sets the stop flag and removes the board; an actor
that dies fails the run with the end of its log (`distributed.check_followers`); actors leave
when the learner's process is gone. The board and its link live in directories only the run's
user can open (`mkdtemp`, mode 0700), since the learner unpickles the batches it finds there.

A resumed run restores the learner as any run; the actors restart their example streams from
the resumed step (seed + rank x stride + step), so it continues but does not replay exactly.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from rlcore.evaluate import RolloutFigures, rollout_figures
from rlcore.types import Rollout

# The header's first fields (the published weights' version, the stop flag, the step the run
# started from, the version being written), then per actor (index 1..N): batches taken, pid.
VERSION, STOP, START, WRITING, FIRST_ACTOR = 0, 1, 2, 3, 4
# How often a waiting side looks at the board again, and checks on the other side.
POLL_S = 0.0005
CHECK_EVERY_S = 0.2
# How long an actor waits for the learner to set up the board.
BOARD_WAIT_S = 600.0


def board_root(slot_bytes: int) -> Path:
    """Where boards go: /dev/shm when it has room for the two weight slots (a container's
    /dev/shm is often 64 MB), else the temporary directory (the page cache serves it)."""
    shm = Path("/dev/shm")
    writable = shm.is_dir() and os.access(shm, os.W_OK)
    if writable and shutil.disk_usage(shm).free > 3 * slot_bytes + (64 << 20):
        return shm
    return Path(tempfile.gettempdir())


def new_board_path() -> str:
    """A fresh path for a run's board (created by the learner once its model is loaded)."""
    return str(Path(tempfile.mkdtemp(prefix="rlcore-actors-")) / "board")


def _parameters(model: torch.nn.Module) -> list[torch.Tensor]:
    return list(model.parameters())


def _slot_dtype(params: list[torch.Tensor]) -> torch.dtype:
    """The parameters' own dtype when they share one (exact and smallest), else float32."""
    dtypes = {p.dtype for p in params}
    return dtypes.pop() if len(dtypes) == 1 else torch.float32


class Board:
    """The shared-memory board of one run (see the module's docstring)."""

    def __init__(self, path: Path, actors: int, numel: int, dtype: torch.dtype):
        self.path, self.actors = path, actors
        self.header = torch.from_file(
            str(path / "header"), shared=True, size=FIRST_ACTOR + 2 * actors, dtype=torch.int64
        )
        self.slots = [
            torch.from_file(str(path / f"weights_{i}"), shared=True, size=numel, dtype=dtype)
            for i in range(2)
        ]

    @classmethod
    def create(cls, path: str, actors: int, model: torch.nn.Module, start: int = 0) -> Board:
        """The learner's side: the board at `path` (a link to a directory in shared memory),
        the run starting after step `start`, whose weights (the model's) are published."""
        params = _parameters(model)
        numel, dtype = sum(p.numel() for p in params), _slot_dtype(params)
        size = numel * torch.empty((), dtype=dtype).element_size()
        where = Path(tempfile.mkdtemp(prefix="rlcore-board-", dir=board_root(size)))
        for name, nbytes in [("header", 8 * (FIRST_ACTOR + 2 * actors))] + [
            (f"weights_{i}", size) for i in range(2)
        ]:
            with open(where / name, "wb") as handle:
                handle.truncate(nbytes)
        board = cls(where, actors, numel, dtype)
        board.header[START] = start
        board.publish(model, start)
        Path(path).symlink_to(where)  # last: an actor that finds the link finds a board
        return board

    @classmethod
    def attach(
        cls, path: str, actors: int, model: torch.nn.Module, alive: Callable[[], bool]
    ) -> Board | None:
        """An actor's side: wait for the learner's board at `path`; None when the run is
        already over (the learner removed the board's directory)."""
        deadline = time.monotonic() + BOARD_WAIT_S
        while not os.path.exists(path):
            if not os.path.isdir(os.path.dirname(path)):
                return None
            if not alive() or time.monotonic() > deadline:
                raise RuntimeError(f"actor: no board at {path} from the learner")
            time.sleep(0.05)
        params = _parameters(model)
        return cls(Path(os.path.realpath(path)), actors, sum(p.numel() for p in params),
                   _slot_dtype(params))  # fmt: skip

    # The weights ----------------------------------------------------------------------

    @torch.no_grad()
    def publish(self, model: torch.nn.Module, version: int) -> None:
        """The learner's weights after `version` steps, for the actors' next batches."""
        self.header[WRITING] = version  # before the slot: a reader of it then knows
        slot, offset = self.slots[version % 2], 0
        for param in _parameters(model):
            slot[offset : offset + param.numel()].copy_(param.detach().reshape(-1))
            offset += param.numel()
        self.header[VERSION] = version

    @torch.no_grad()
    def load(self, model: torch.nn.Module, have: int) -> int:
        """An actor's model set to the newest published weights, in place (the engine's CUDA
        graphs read the parameters by address); returns their version (`have` when none is
        newer)."""
        while not self.over:
            version = int(self.header[VERSION])
            if version <= have:
                return have
            slot, offset = self.slots[version % 2], 0
            for param in _parameters(model):
                param.copy_(slot[offset : offset + param.numel()].view_as(param))
                offset += param.numel()
            if int(self.header[WRITING]) < version + 2:  # its slot was not rewritten meanwhile
                return version
        return have

    # The flag and the counters --------------------------------------------------------

    @property
    def start(self) -> int:
        return int(self.header[START])

    @property
    def stopped(self) -> bool:
        return bool(self.header[STOP])

    @property
    def over(self) -> bool:
        """Stopped, or the board removed (the learner's run ended without a stop)."""
        return self.stopped or not self.path.is_dir()

    def stop(self) -> None:
        self.header[STOP] = 1

    def taken(self, actor: int) -> int:
        return int(self.header[FIRST_ACTOR + 2 * (actor - 1)])

    def register(self, actor: int) -> None:
        self.header[FIRST_ACTOR + 2 * (actor - 1) + 1] = os.getpid()

    # The batches ----------------------------------------------------------------------

    def _batch_file(self, actor: int, number: int) -> Path:
        return self.path / f"batch_{actor}_{number:09d}.pkl"

    def put(self, actor: int, number: int, batch: ActorBatch) -> None:
        """An actor's `number`th batch, visible to the learner only once written whole;
        dropped when the run ended meanwhile (the learner removed the board)."""
        final = self._batch_file(actor, number)
        partial = final.with_suffix(".part")
        try:
            with open(partial, "wb") as handle:
                pickle.dump(batch, handle, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(partial, final)
        except FileNotFoundError:
            if not self.over:
                raise

    def take(
        self, first: int, should_stop: Callable[[], bool], check: Callable[[], None]
    ) -> ActorBatch | None:
        """The learner's next batch: the first finished one looking from actor `first` on,
        round robin; None on a stop request. `check` raises for an actor that died."""
        checked = time.monotonic()
        while True:
            for offset in range(self.actors):
                actor = (first - 1 + offset) % self.actors + 1
                number = self.taken(actor) + 1
                path = self._batch_file(actor, number)
                if path.exists():
                    with open(path, "rb") as handle:
                        batch = pickle.load(handle)
                    path.unlink()
                    self.header[FIRST_ACTOR + 2 * (actor - 1)] = number
                    return batch
            if time.monotonic() - checked > CHECK_EVERY_S:
                check()
                if should_stop():
                    return None
                checked = time.monotonic()
            time.sleep(POLL_S)

    def close(self, link: str) -> None:
        """The learner's end: stop every actor and remove the board."""
        self.stop()
        discard_board(link)


def discard_board(link: str) -> None:
    """Remove a board, its link and the link's directory; an actor that finds them gone
    leaves (`Board.over`, `Board.attach`). Nothing for what is gone already."""
    if os.path.islink(link):
        shutil.rmtree(os.path.realpath(link), ignore_errors=True)
    shutil.rmtree(Path(link).parent, ignore_errors=True)


@dataclass
class ActorBatch:
    """Steps 1-4 of a step as an actor hands them to the learner."""

    actor: int
    version: int  # the published weights that played it
    sequences: list  # TrainingSequence, with the sampled logprobs
    normalizer: float
    advantage_sums: dict
    figures: list[RolloutFigures]
    logged: list[Rollout]  # the log's sample (grpo.for_log)
    tokens: int
    rollout_seconds: float
    scoring_seconds: float


# ---------------------------------------------------------------------------------------
# An actor


def run_actor(payload: dict) -> None:
    """Actor `RANK` of an RL run with actors (a `launch`ed child): roll out batches with the
    learner's newest weights until the board's stop flag is set or the learner is gone."""
    from rlcore.envs.registry import load_environment
    from rlcore.policy.vllm_engine import rollout_engine, sync_weights
    from rlcore.rollout import frozen_heap, run_rollouts
    from rlcore.train.common import (
        load_model_and_tokenizer,
        model_path,
        resolve_device,
        seed_everything,
    )
    from rlcore.train.config import RLConfig, build_config
    from rlcore.train.grpo import RANK_SEED_STRIDE, for_log, step_sequences
    from rlcore.train.sampling import StratifiedSampler, rollout_sample
    from rlcore.types import SamplingParams

    cfg = build_config(RLConfig, [("learner", payload["settings"])])
    actor, learner_pid = int(os.environ["RANK"]), os.getppid()

    def alive() -> bool:
        return os.getppid() == learner_pid

    device = resolve_device(cfg.device)
    if device.type == "cuda":
        device = torch.device("cuda", actor % max(torch.cuda.device_count(), 1))
        torch.cuda.set_device(device)
    model, tokenizer = load_model_and_tokenizer(cfg.resume_from or cfg.model, device)
    model.eval().requires_grad_(False)
    board = Board.attach(payload["board"], cfg.actors, model, alive)
    if board is None:
        return  # the run ended before this actor was ready
    board.register(actor)
    seed = cfg.seed + RANK_SEED_STRIDE * actor + board.start
    seed_everything(seed)
    env = load_environment(cfg.env, **cfg.env_args)
    env.output_dir = cfg.output_dir

    def should_stop() -> bool:
        return board.over or not alive()

    sharers = cfg.actors + 1 if device.type == "cuda" else 1
    engine, _ = rollout_engine(
        payload["engine"],
        model=model,
        tokenizer=tokenizer,
        path=model_path(cfg.resume_from or cfg.model),
        should_stop=should_stop,
        gpu_sharers=-(-sharers // max(torch.cuda.device_count(), 1)),
    )
    sampler = StratifiedSampler(env, seed, cfg.batch_size // cfg.rollouts_per_example)
    sampling = SamplingParams(
        temperature=cfg.sampling.temperature,
        top_p=cfg.sampling.top_p,
        max_tokens=cfg.sampling.max_tokens,
    )
    group, pieces, version, number = cfg.rollouts_per_example, {}, -1, 0
    loop = asyncio.new_event_loop()
    frozen_heap.freeze()
    try:
        while not should_stop():
            if board.taken(actor) < number:  # its last batch is still waiting
                time.sleep(POLL_S)
                continue
            version = board.load(model, version)
            sync_weights(engine, model)
            started = time.monotonic()
            examples = sampler.next_batch()
            rollouts = loop.run_until_complete(
                run_rollouts(
                    env,
                    engine,
                    examples,
                    sampling=sampling,
                    rollouts_per_example=group,
                    concurrency=cfg.sampling.concurrency,
                    should_stop=should_stop,
                )
            )
            if len(rollouts) < len(examples) * group:
                break  # stopped during the rollouts
            scored = time.monotonic()
            sequences, normalizer, sums = step_sequences(env, rollouts, cfg, tokenizer, pieces)
            number += 1
            batch = ActorBatch(
                actor=actor,
                version=version,
                sequences=sequences,
                normalizer=normalizer,
                advantage_sums=sums,
                figures=[rollout_figures(env, r) for r in rollouts],
                logged=[for_log(r) for r in rollout_sample(rollouts, group, cfg.log_rollouts)],
                tokens=sum(len(s.input_ids) for s in sequences),
                rollout_seconds=scored - started,
                scoring_seconds=time.monotonic() - scored,
            )
            board.put(actor, number, batch)
    finally:
        frozen_heap.thaw()
        loop.run_until_complete(engine.aclose())
        loop.close()
