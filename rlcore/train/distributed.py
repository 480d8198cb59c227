"""Training on more than one device: generation and training on two devices of one process
(split placement), and SFT and the RL update data-parallel over n processes with
`torch.distributed`.

Placement (`RLConfig.placement`): "colocated", the default, gives the rollout engine the
trainer's own model, so it always samples the current weights. "split" gives the engine a
copy on another device (generation on cuda:0, training on cuda:1; on a CPU both are the
CPU, which is how the tests run it) and copies the trainer's parameters into it in place
after every optimizer step (`copy_weights`): the static decoder's CUDA graphs read the
parameters by address, so an in-place copy keeps them valid (rlcore/policy/static_decode.py).
The copy has the trainer's dtype, so both placements sample the same distribution.

Data parallel (`launch`): rank 0 is the calling process (a Celery worker's pool process,
the CLI, a benchmark); ranks 1..n-1 are child processes started as torchrun starts them
(RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT set) running
`python -m rlcore.train.distributed TARGET PAYLOAD`. Rank r trains on cuda:r (NCCL) or the
CPU (gloo); a gloo group beside the default one carries Python objects and stop flags.
- SFT: every rank runs `run_sft`, draws the same batches, trains on its share of each
  (`Ranks.deal`); only rank 0 reports and saves.
- RL: every rank runs `run_rl` (`follow_rl` on ranks 1..n-1): each draws the same batch of
  examples, rolls out its share of them (`Ranks.deal`) with its own engine, scores them and
  trains on their sequences, the loss normalized by the whole batch's normalizer (summed
  over the ranks); rank 0 gathers every rank's rollouts to log the step and alone saves.
  The step's host work (games, prompts, the engine's bookkeeping), its generation and its
  update are all split. More ranks than GPUs share them (rank r on cuda:r mod the count,
  over gloo), which on a GPU worker puts a step's Python on that many CPU cores; they
  share a card through an MPS daemon of the run's own where the machine has MPS
  (`share_card`).
In both, each rank's loss is its share of the batch's loss (the sum over its tokens divided
by the whole batch's normalizer), so the gradients are summed over the ranks, once after
accumulation (`Ranks.sum_gradients`), and every rank takes the same optimizer step. This is
DDP's arithmetic without its wrapper: DDP averages at every backward and needs every rank
to run the same number of them, where ours accumulate over however many micro-batches
their share holds (possibly none). Metric sums are added up over the ranks the same way.

Rollout actors (`RLConfig.actors`, rlcore/train/actors.py) are launched the same way, as
ranks 1..N without a process group (backend "none"): they meet the learner on a board in
shared memory, and the learner calls `check_followers` while it waits for their batches.

Stop requests: the ranks must run the same collectives, so in a data-parallel run a stop is
heard before a step (rank 0's answer is broadcast) or during rank 0's rollouts (RL: a step
whose rollouts some rank did not finish is dropped on every rank, `Ranks.every`), never
between micro-batches of an update.
"""

from __future__ import annotations

import copy
import ctypes
import fcntl
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

# How long a rank waits in one collective: followers wait through rank 0's rollouts.
TIMEOUT_S = float(os.environ.get("RLCORE_DIST_TIMEOUT_S", "1800"))
# How long rank 0 waits for a follower to exit after the run.
TEARDOWN_S = 30
# Gradients are summed in flat buckets of about this many bytes.
BUCKET_BYTES = 64 << 20
ROOT = Path(__file__).resolve().parents[2]
ResultT = TypeVar("ResultT")
logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------
# Placement


def placement_devices(placement: str, device: torch.device) -> tuple[torch.device, torch.device]:
    """(training device, generation device) for `placement` given the run's `device`."""
    if placement == "colocated":
        return device, device
    if placement != "split":
        raise ValueError(f"placement must be colocated or split, got {placement!r}")
    if device.type == "cpu":
        return device, device
    count = torch.cuda.device_count()
    if count < 2:
        raise ValueError(
            f"placement='split' needs two CUDA GPUs (generation on cuda:0, training on "
            f"cuda:1) but torch sees {count}; use placement='colocated' or device='cpu'"
        )
    return torch.device("cuda", 1), torch.device("cuda", 0)


def generation_model(model: torch.nn.Module, placement: str, device: torch.device):
    """What the rollout engine samples from: the trainer's `model` itself (colocated) or a
    frozen copy of it on `device` (split)."""
    if placement == "colocated":
        return model
    return copy.deepcopy(model).to(device).eval().requires_grad_(False)


@torch.no_grad()
def copy_weights(source: torch.nn.Module, target: torch.nn.Module) -> None:
    """`target`'s parameters set to `source`'s in place (nothing when they are one model).
    A copy between two GPUs is ordered after the work queued on both, so the next
    generation reads the new weights without the host waiting here."""
    if source is target:
        return
    for into, value in zip(target.parameters(), source.parameters(), strict=True):
        into.copy_(value, non_blocking=True)


# ---------------------------------------------------------------------------------------
# Processes of one run sharing a card


MPS_CONTROL = "nvidia-cuda-mps-control"
MPS_DEFAULT_PIPE = Path("/tmp/nvidia-mps")  # where a machine-wide daemon listens
MPS_ENV = ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY")
# One daemon of ours a machine at a time: the process that starts one holds this lock, and
# after it its watcher, until the daemon is gone. A second daemon's server beside the first
# might not get the card; a process outside MPS does share it with a daemon's server (on an
# H100, runs without MPS started while a daemon and its server were still up ran at their
# usual speed).
MPS_LOCK = Path(tempfile.gettempdir()) / "rlcore-mps.lock"
# Run beside the process that started a daemon, holding the lock: once that process is gone
# (however it ended), stop the daemon, wait (at most $4 seconds) until it no longer answers,
# remove its folder and exit, which releases the lock. A daemon told to quit while its
# clients live waits for them, so the quit comes only after the process (rank 0, a client)
# has exited. On an H100 the daemon and its server were gone 2 s after the quit.
MPS_WATCHER = """
while kill -0 "$1" 2>/dev/null; do sleep 1; done
echo quit | "$2"
waited=0
while [ "$waited" -lt "$4" ] && echo get_server_list | "$2" >/dev/null 2>&1; do
    sleep 1
    waited=$((waited + 1))
done
rm -rf "$3"
"""
CUDA_ERROR_NOT_INITIALIZED = 3  # the driver's answer before cuInit
_mps_daemon: dict[str, str] = {}  # the daemon this process started: its environment, lock
_mps_watchers: list[subprocess.Popen] = []


def share_card(device: str, processes: int) -> str | None:
    """Let a run's processes that share one CUDA card (data-parallel ranks, or a learner and
    its rollout actors, more than the GPUs) share it through NVIDIA's Multi-Process Service:
    their small kernels then run on the card side by side, where without it the card
    switches between the processes' contexts. On one H100 with 4 ranks the 64-game
    tic-tac-toe step went 0.30 -> 0.19 s and the 1,024-game step 0.49 -> 0.39 s
    (docs/BENCHMARKS.md, forty-ninth session).

    Starts a daemon of this process's own (`nvidia-cuda-mps-control -d`, its pipes and log
    in a new temporary directory, so nothing else on the machine joins it) once, and sets
    this process's environment so that it (rank 0) and the ranks it starts are its
    clients; a watcher stops the daemon when this process has exited. Nothing is started
    where the run's processes do not share a card, where MPS already serves this process
    (a daemon of the machine's, or an earlier run's here), where another process's daemon
    of ours runs (`MPS_LOCK`: that run keeps MPS, this one runs without), where the machine
    has no MPS, or where this process has already opened CUDA outside MPS (it could not
    join). `RLCORE_MPS=0` in the environment turns it off (a worker whose machine must not
    run MPS). Returns a line for the run's log saying which, or None where no card is
    shared or it is turned off."""
    if not device.startswith(("cuda", "auto")) or processes < 2:
        return None
    if os.environ.get("RLCORE_MPS", "1") == "0":
        return None
    gpus = torch.cuda.device_count()  # NVML: the card is not opened
    if gpus == 0 or processes <= gpus:
        return None
    sharing = f"{processes} processes share {gpus} CUDA card{'s' * (gpus > 1)}"
    if _mps_daemon or mps_serving():
        return f"{sharing} through MPS (a daemon already running)"
    control = shutil.which(MPS_CONTROL)
    if control is None:
        return f"{sharing} without MPS: {MPS_CONTROL} is not on PATH"
    if torch.cuda.is_initialized() or cuda_driver_opened():
        return f"{sharing} without MPS: this process opened CUDA before MPS could start"
    try:
        lock = os.open(MPS_LOCK, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as exc:
        return f"{sharing} without MPS: cannot open {MPS_LOCK} ({exc.strerror})"
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(lock)
        return f"{sharing} without MPS: another run's MPS daemon is running on this machine"
    home = Path(tempfile.mkdtemp(prefix="rlcore-mps-"))
    env = {name: str(home / part) for name, part in zip(MPS_ENV, ("pipe", "log"), strict=True)}
    for folder in env.values():
        Path(folder).mkdir()
    try:
        subprocess.run(
            [control, "-d"], env=os.environ | env, check=True, timeout=30, capture_output=True
        )
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        reason = detail.decode(errors="replace").strip() or f"{type(exc).__name__}: {exc}"
        shutil.rmtree(home, ignore_errors=True)
        os.close(lock)
        return f"{sharing} without MPS: {MPS_CONTROL} -d failed ({reason[:300]})"
    watch_exit(os.getpid(), control, home, env, lock)
    os.environ.update(env)
    _mps_daemon.update(env, lock=str(lock))
    return f"{sharing} through MPS (a daemon of this process's, {home})"


def watch_exit(
    pid: int, control: str, home: Path, env: dict[str, str], lock: int, wait_s: int = 60
) -> subprocess.Popen:
    """Start the watcher (`MPS_WATCHER`) that stops the daemon at `env` once `pid` is gone
    and removes `home`; it holds the `lock` descriptor (flocked) until then, and this
    process keeps it open too. In its own session, so a signal to this process's group
    leaves it to do its work."""
    argv = [str(pid), control, str(home), str(int(wait_s))]
    watcher = subprocess.Popen(
        ["sh", "-c", MPS_WATCHER, "mps-watcher", *argv],
        env=os.environ
        | env
        | {"PATH": os.pathsep.join([os.environ.get("PATH", ""), "/usr/bin:/bin"])},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        pass_fds=(lock,),
        start_new_session=True,
    )
    _mps_watchers.append(watcher)
    return watcher


def cuda_driver_opened() -> bool:
    """Whether this process has initialized the CUDA driver, which settles whether it is an
    MPS client: on an H100 a process that had called `torch.cuda.is_available()` (which
    initializes the driver, though torch itself is not yet initialized) and then joined a
    daemon's environment ran outside MPS. Asked of the driver without initializing it."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:  # no driver: nothing opened
        return False
    count = ctypes.c_int()
    return driver.cuDeviceGetCount(ctypes.byref(count)) != CUDA_ERROR_NOT_INITIALIZED


def mps_serving() -> bool:
    """Whether this process's CUDA clients are served by an MPS daemon (its own or the
    machine's)."""
    return bool(os.environ.get(MPS_ENV[0])) or (MPS_DEFAULT_PIPE / "control").exists()


def _note_sharing(sink, device: str, processes: int) -> None:
    if line := share_card(device, processes):
        if sink is None:
            logger.info(line)
        else:
            sink.log(line)


# ---------------------------------------------------------------------------------------
# Ranks


def never() -> bool:
    return False


@dataclass
class Ranks:
    """This process's place among the ranks of a run (one rank when not data-parallel),
    and the collectives the trainers call; each is a no-op with one rank."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str = ""
    control: Any = None  # a gloo group for Python objects and flags

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def parallel(self) -> bool:
        return self.world_size > 1

    @property
    def collective_device(self) -> torch.device:
        return (
            torch.device("cuda", self.local_rank) if self.backend == "nccl" else torch.device("cpu")
        )

    def device(self, device: torch.device) -> torch.device:
        """This rank's device for a run on `device`: cuda:LOCAL_RANK in a data-parallel run."""
        if self.parallel and device.type == "cuda":
            return torch.device("cuda", self.local_rank % max(torch.cuda.device_count(), 1))
        return device

    def sharing(self, device: torch.device) -> int:
        """How many of the ranks run on `device`'s GPU (1 on the CPU or with one rank)."""
        if not self.parallel or device.type != "cuda":
            return 1
        return -(-self.world_size // max(torch.cuda.device_count(), 1))

    def deal(self, items: list) -> list:
        """This rank's share of `items` (every world_size-th one)."""
        return items[self.rank :: self.world_size]

    def agreed(self, ask: Callable[[], bool]) -> Callable[[], bool]:
        """`ask` as every rank must call it together: rank 0's answer, broadcast."""
        if not self.parallel:
            return ask

        def answer() -> bool:
            flag = torch.tensor([int(ask()) if self.is_main else 0])
            dist.broadcast(flag, src=0, group=self.control)
            return bool(flag.item())

        return answer

    def inside_step(self, ask: Callable[[], bool]) -> Callable[[], bool]:
        """`ask` where one rank may act on it alone (between micro-batches): itself in one
        process, never in a data-parallel run (the ranks would stop at different points)."""
        return never if self.parallel else ask

    def sum_gradients(self, model: torch.nn.Module) -> None:
        """Every parameter's gradient summed over the ranks, on every rank. A parameter
        some rank has a gradient for gets one everywhere (zeros where it had none), so the
        ranks' optimizers step the same parameters; one no rank touched keeps None, as in
        one process."""
        if not self.parallel:
            return
        params = [p for p in model.parameters() if p.requires_grad]
        device = self.collective_device
        touched = torch.tensor([p.grad is not None for p in params], dtype=torch.int32)
        touched = touched.to(device)
        dist.all_reduce(touched)
        grads = []
        for param, count in zip(params, touched.tolist(), strict=True):
            if count:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                grads.append(param.grad)
        for bucket in _buckets(grads):
            flat = torch._utils._flatten_dense_tensors(bucket).to(device)
            dist.all_reduce(flat)
            for grad, summed in zip(
                bucket, torch._utils._unflatten_dense_tensors(flat, bucket), strict=True
            ):
                grad.copy_(summed)

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """`values` added up over the ranks (every rank passes the same shape)."""
        if not self.parallel:
            return values
        summed = values.to(self.collective_device)
        dist.all_reduce(summed)
        return summed.to(values.device)

    def sum_dict(self, sums: dict[str, torch.Tensor], alike=()) -> dict[str, torch.Tensor]:
        """Named 0-dim sums added up over the ranks; a rank without some name counts 0 for
        it. Names in `alike` hold a value every rank has the same (a gradient norm): it
        is kept, not multiplied."""
        if not self.parallel:
            return sums
        names: list = [None] * self.world_size
        dist.all_gather_object(names, sorted(sums), group=self.control)
        keys = sorted(set().union(*names))
        device = self.collective_device
        values = torch.stack(
            [
                sums[k].to(device, torch.float64)
                if k in sums
                else torch.zeros((), dtype=torch.float64, device=device)
                for k in keys
            ]
        )
        dist.all_reduce(values)
        return {
            k: v / self.world_size if k in alike else v for k, v in zip(keys, values, strict=True)
        }

    def every(self, flag: bool) -> bool:
        """Whether `flag` holds on every rank (all ranks call it together)."""
        if not self.parallel:
            return flag
        value = torch.tensor([int(flag)])
        dist.all_reduce(value, op=dist.ReduceOp.MIN, group=self.control)
        return bool(value.item())

    def gather(self, item: Any) -> list | None:
        """Rank 0: every rank's `item`, in rank order; the others: None."""
        if not self.parallel:
            return [item]
        items: list | None = [None] * self.world_size if self.is_main else None
        dist.gather_object(item, items, dst=0, group=self.control)
        return items


def _buckets(tensors: list[torch.Tensor]):
    bucket, size = [], 0
    for tensor in tensors:
        if bucket and (size >= BUCKET_BYTES or tensor.dtype != bucket[0].dtype):
            yield bucket
            bucket, size = [], 0
        bucket.append(tensor)
        size += tensor.numel() * tensor.element_size()
    if bucket:
        yield bucket


_current = Ranks()


def current_ranks() -> Ranks:
    """The ranks of the run this process takes part in (one rank unless `launch`ed)."""
    return _current


class RankFailed(RuntimeError):
    """A follower rank exited with an error; the message ends with its log."""


class RanksDiverged(RuntimeError):
    """Data-parallel ranks that took the same steps hold different weights."""


def weights_digest(model: torch.nn.Module) -> list[float]:
    """Each parameter's sum and sum of squares: equal on ranks that took the same steps."""
    with torch.no_grad():
        sums = [
            torch.stack([p.double().sum(), p.double().square().sum()]) for p in model.parameters()
        ]
        return torch.cat(sums).tolist()


def check_same_weights(model: torch.nn.Module, job: str, when: str, sink=None, saved="") -> None:
    """Every rank calls it together: rank 0 raises RanksDiverged naming the ranks whose
    weights differ from its own and the first parameter that does (`saved`: the checkpoint
    rank 0 has just written, named in the error), or with `sink` logs that they agree. The
    ranks start from the same weights, add up their gradients and take the same optimizer
    step, so their weights must be equal; a run checks at its start, after its first step
    (RL also after that step's rollout, which must leave them alone), before each save and
    at its end, so a run whose ranks drift apart fails within one step, and says where. On
    an H100 ranks under an MPS thread limit (`CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` of 35 or
    75) were apart after their first step (docs/BENCHMARKS.md, fifty-second and fifty-third
    sessions)."""
    ranks = current_ranks()
    if not ranks.parallel:
        return
    digests = ranks.gather(weights_digest(model))
    if not ranks.is_main:
        return
    if differ := [rank for rank, digest in enumerate(digests) if digest != digests[0]]:
        names = [name for name, _ in model.named_parameters()]
        other = digests[differ[0]]
        at = next(i for i, (a, b) in enumerate(zip(digests[0], other, strict=True)) if a != b)
        what = "sum" if at % 2 == 0 else "sum of squares"
        limit = os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
        raise RanksDiverged(
            f"{job}: {when} data-parallel ranks {differ} hold weights other than rank 0's, "
            "though every rank took the same steps; the first that differs is "
            f"{names[at // 2]} (its {what} {other[at]!r} on rank {differ[0]}, "
            f"{digests[0][at]!r} on rank 0)"
            + (f"; the checkpoint {saved} is rank 0's" if saved else "")
            + (
                f"; CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={limit[:20]!r} is set, and MPS thread "
                "limits have made ranks drift apart: unset it"
                if limit
                else ""
            )
        )
    if sink is not None:
        sink.log(f"{job}: {when} the {ranks.world_size} data-parallel ranks hold the same weights")


def init_ranks(
    rank: int,
    world_size: int,
    backend: str,
    address: str,
    timeout_s: float,
    check_followers: Callable[[], None] = lambda: None,
) -> Ranks:
    """Join the process group at `address` (host:port) as `rank` of `world_size`. Rank 0
    holds the rendezvous and waits for every follower to check in, calling
    `check_followers` meanwhile (it raises RankFailed for one that died on its way), so a
    follower that cannot start fails the run at once, not after `timeout_s`."""
    global _current
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    host, port = address.rsplit(":", 1)
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(
        host, int(port), world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=False
    )
    if rank == 0:
        arrivals = [f"joined/{follower}" for follower in range(1, world_size)]
        deadline = time.monotonic() + timeout_s
        while not store.check(arrivals):
            check_followers()
            if time.monotonic() > deadline:
                raise TimeoutError(f"not every rank joined rank 0 at {address} in {timeout_s:g} s")
            time.sleep(0.1)
    else:
        store.set(f"joined/{rank}", "1")
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    global _store
    _store = store
    control = (
        dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        if backend != "gloo"
        else dist.group.WORLD
    )
    _current = Ranks(rank, world_size, local_rank, backend, control)
    return _current


_store: Any = None  # rank 0's rendezvous store, kept until the followers have left


def close_ranks(*, keep_store: bool = False) -> None:
    """Leave the process group. Rank 0 passes `keep_store` while followers may still be
    tearing down theirs (their teardown talks to the store it hosts) and drops the store
    with `release_store()` once they have exited."""
    global _current
    if dist.is_initialized():
        dist.destroy_process_group()
    _current = Ranks()
    if not keep_store:
        release_store()


def release_store() -> None:
    global _store
    _store = None


# ---------------------------------------------------------------------------------------
# Launching


def backend_for(device: str, processes: int = 1) -> str:
    """nccl for a run on CUDA GPUs, a GPU each; gloo on the CPU or where ranks share GPUs
    (NCCL takes one rank a GPU)."""
    on_gpu = device != "cpu" and torch.cuda.is_available()
    return "nccl" if on_gpu and torch.cuda.device_count() >= processes else "gloo"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch(
    main: Callable[[], ResultT],
    follower: str,
    payload: Any,
    *,
    processes: int,
    backend: str,
    log_dir: str | Path | None = None,
    timeout_s: float = TIMEOUT_S,
) -> ResultT:
    """Run `main()` here as rank 0 of `processes` ranks and `follower` ("module:function",
    called with the JSON `payload`) in child processes as ranks 1..n-1; returns what
    `main` returned. Each child's output goes to `log_dir`/rank_N.log; a child that fails
    makes the run fail with the end of its log. Backend "none" forms no process group:
    `main` learns of a failed child by calling `check_followers`."""
    if processes < 2:
        return main()
    if backend == "nccl" and torch.cuda.device_count() < processes:
        raise ValueError(
            f"{processes} data-parallel processes need {processes} CUDA GPUs; torch sees "
            f"{torch.cuda.device_count()}"
        )
    address = f"127.0.0.1:{_free_port()}"
    logs = Path(log_dir or tempfile.mkdtemp(prefix="rlcore-ranks-"))
    logs.mkdir(parents=True, exist_ok=True)
    payload_path = logs / "rank_payload.json"
    payload_path.write_text(json.dumps(payload))
    env = os.environ | {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": address.split(":")[1],
        "WORLD_SIZE": str(processes),
        "LOCAL_WORLD_SIZE": str(processes),
        "RLCORE_DIST_BACKEND": backend,
        "RLCORE_DIST_TIMEOUT_S": str(timeout_s),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    env.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
    children = []
    for rank in range(1, processes):
        log = (logs / f"rank_{rank}.log").open("w")
        command = [sys.executable, "-m", "rlcore.train.distributed", follower, str(payload_path)]
        rank_env = env | {"RANK": str(rank), "LOCAL_RANK": str(rank)}
        children.append(
            (
                rank,
                subprocess.Popen(command, env=rank_env, stdout=log, stderr=subprocess.STDOUT),
                log,
            )
        )

    def check_followers() -> None:
        if failed := _failed_children(children, wait_s=0):
            raise RankFailed(f"data-parallel run: {failed}")

    global _check_followers
    finished = False
    try:
        if backend != "none":
            init_ranks(0, processes, backend, address, timeout_s, check_followers)
        _check_followers = check_followers
        result = main()
        finished = True
    except RankFailed:
        raise
    except BaseException as exc:
        if failed := _failed_children(children, wait_s=2):
            raise RankFailed(f"data-parallel run failed on rank 0 ({exc}); {failed}") from exc
        raise
    finally:
        _check_followers = _no_followers
        # Rank 0 hosts the rendezvous store and keeps it until the followers have exited:
        # a follower still tearing down its group when the store goes away aborts
        # ("terminate called without an active exception"). On gloo a finished run lets
        # the followers leave their group first (rank 0 closing its pairs under a
        # follower's teardown aborts it too); NCCL's teardown waits for the peers, so
        # there every rank leaves together (a follower left to tear down alone hung until
        # it was killed). After a failure rank 0 leaves first, so followers blocked in a
        # collective fail at once.
        together = backend == "nccl" or not finished
        if together:
            close_ranks(keep_store=True)
        stuck = []
        for rank, child, _ in children:
            try:
                child.wait(timeout=TEARDOWN_S)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
                stuck.append(rank)
        if not together:
            close_ranks(keep_store=True)
        release_store()
        for _, _, log in children:
            log.close()
    if stuck:
        # The run's work is done and rank 0 holds its result: a follower that hung on its
        # way out is killed and named, not a failed run.
        logger.warning(
            "data-parallel run: rank(s) %s did not exit %d s after the run ended; killed",
            ", ".join(map(str, stuck)),
            TEARDOWN_S,
        )
        children = [c for c in children if c[0] not in stuck]
    check_followers()
    return result


def _no_followers() -> None:
    return None


_check_followers: Callable[[], None] = _no_followers


def check_followers() -> None:
    """Raise RankFailed for a follower of the running `launch` that exited with an error
    (nothing outside one)."""
    _check_followers()


def _failed_children(children, wait_s: float) -> str:
    """What the children that exited with an error said at the end of their logs."""
    reports = []
    for rank, child, log in children:
        try:
            code = child.wait(timeout=wait_s) if wait_s else child.poll()
        except subprocess.TimeoutExpired:
            continue
        if code:
            if not log.closed:
                log.flush()
            tail = Path(log.name).read_text(errors="replace")[-2000:]
            reports.append(f"rank {rank} exited with {code} ({log.name}):\n{tail}")
    return "\n".join(reports)


def data_parallel_processes(gpus: int, cfg) -> int:
    """How many data-parallel processes a job asking for `gpus` GPUs runs: one a GPU, or
    its config's `processes` where that asks for more, unless its RL run splits generation
    and training over two GPUs in one process or feeds one trainer from rollout actors
    (spread over the GPUs)."""
    if getattr(cfg, "placement", "colocated") != "colocated" or getattr(cfg, "actors", 0):
        return 1
    return max(gpus, getattr(cfg, "processes", 1), 1)


def run_sft_ranks(cfg, sink=None, *, processes: int = 1) -> str:
    """`run_sft`, data-parallel over `processes` ranks."""
    from rlcore.train.sft import run_sft

    _note_sharing(sink, cfg.device, processes)
    return launch(
        lambda: run_sft(cfg, sink),
        "rlcore.train.distributed:follow_sft",
        cfg.to_dict(),
        processes=processes,
        backend=backend_for(cfg.device, processes),
        log_dir=Path(cfg.output_dir) / "ranks",
    )


def run_rl_ranks(
    cfg, sink=None, *, processes: int | None = None, engine: str = "local"
) -> str | None:
    """`run_rl` data-parallel over `processes` ranks (default: the config's `processes`),
    or with the config's rollout actors (rlcore/train/actors.py) beside it."""
    from rlcore.train.grpo import run_rl

    processes = cfg.processes if processes is None else processes
    if processes > 1 and cfg.placement != "colocated":
        raise ValueError(
            f"placement={cfg.placement!r} runs in one process over two devices; a "
            f"data-parallel run ({processes} processes) takes placement='colocated'"
        )
    _note_sharing(sink, cfg.device, processes + cfg.actors)
    if cfg.actors:
        from rlcore.train.actors import discard_board, new_board_path

        if processes > 1:
            raise ValueError(
                f"actors={cfg.actors} runs one learner; a data-parallel run ({processes} "
                "processes, e.g. one a GPU) takes actors = 0"
            )
        board = new_board_path()

        def learner() -> str:
            try:
                return run_rl(cfg, sink, engine=engine, board=board)
            finally:
                discard_board(board)  # also where the learner failed before setting it up

        return launch(
            learner,
            "rlcore.train.actors:run_actor",
            {"settings": cfg.to_dict(), "engine": engine, "board": board},
            processes=1 + cfg.actors,
            backend="none",
            log_dir=Path(cfg.output_dir) / "ranks",
        )
    return launch(
        lambda: run_rl(cfg, sink, engine=engine),
        "rlcore.train.distributed:follow_rl",
        {"settings": cfg.to_dict(), "engine": engine},
        processes=processes,
        backend=backend_for(cfg.device, processes),
        log_dir=Path(cfg.output_dir) / "ranks",
    )


def follow_sft(settings: dict) -> None:
    """Ranks 1..n-1 of a data-parallel SFT run: the same run, silent."""
    from rlcore.train.config import SFTConfig, build_config
    from rlcore.train.sft import run_sft

    run_sft(build_config(SFTConfig, [("rank 0", settings)]))


def follow_rl(payload: dict) -> None:
    """Ranks 1..n-1 of a data-parallel RL run: the same run, each rolling out and training
    its share of every step, silent (rank 0 logs and saves)."""
    from rlcore.train.config import RLConfig, build_config
    from rlcore.train.grpo import run_rl

    run_rl(build_config(RLConfig, [("rank 0", payload["settings"])]), engine=payload["engine"])


def _follower_main(argv: list[str]) -> None:
    target, payload_path = argv
    module, _, function = target.partition(":")
    payload = json.loads(Path(payload_path).read_text())
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    address = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    backend = os.environ["RLCORE_DIST_BACKEND"]
    if backend == "none":  # no process group (rollout actors)
        getattr(__import__(module, fromlist=[function]), function)(payload)
        return
    init_ranks(rank, world_size, backend, address, TIMEOUT_S)
    try:
        getattr(__import__(module, fromlist=[function]), function)(payload)
    except BaseException:
        close_ranks()
        raise
    if backend == "gloo":
        # Done: leave without gloo's teardown, whose threads now and then abort a finished
        # follower ("terminate called without an active exception", exit -6, seen in
        # tests/test_distributed.py); the process's end frees what the group held.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    close_ranks()  # NCCL: every rank leaves together (see `launch`)


if __name__ == "__main__":
    # Run from the imported module, not this `__main__` copy: the trainers ask the
    # imported one which rank they are.
    from rlcore.train.distributed import _follower_main as follower_main

    follower_main(sys.argv[1:])
