"""Which inference engine runs a job or a Play move, and the vLLM servers behind them.

A job asks for an engine (`Job.engine`: local or vllm) and records the one that ran it
(`Job.engine_used`, in its result, and a log line when they differ):
- eval and synth of a local model with vllm: the model is served by VLLM_SERVE_COMMAND
  (`vllm serve ...`, rlcore/policy/vllm_server.py) for the job's duration and the job
  talks to it through the OpenAI-compatible policy, as to any endpoint;
- rl with vllm: the trainer samples from `vllm.LLM` in its own process, where the trainer
  takes a rollout engine (`run_rl(..., engine=)`, rlcore/policy/vllm_engine.py);
- anywhere vLLM cannot run (not installed, no GPU, the trainer without the hook) the job
  runs on the local engine and its log says why. An endpoint or a built-in player is
  its own engine ("endpoint", "builtin").

Play: an inference worker with INFERENCE_ENGINE=vllm serves each local model it is asked
for with VLLM_SERVE_COMMAND, keeps the last few servers running (`ServerPool`) and stops
them when it shuts down.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path

from django.conf import settings

from rlcore.policy.openai_client import OpenAIPolicy
from rlcore.policy.vllm_engine import vllm_unavailable_reason
from rlcore.policy.vllm_server import ServedModel, command_unavailable_reason
from webapp.jobs.models import Job

logger = logging.getLogger(__name__)

SERVED_KINDS = (Job.Kind.EVAL, Job.Kind.SYNTH)


def model_path(model: str) -> str:
    """What a server loads for a config's `model`: the directory of a built-in model name
    ("tiny", "tiny-bpe", "tiny-bpe-3l", "tiny-master"), else the name itself."""
    from rlcore.policy.tiny import builtin_model_path

    return builtin_model_path(model)


def is_local_model(job: Job, config: dict) -> bool:
    if config.get("base_url"):
        return False
    return job.model is None or job.model.is_local


def serve_command_unavailable_reason() -> str | None:
    return command_unavailable_reason(settings.VLLM_SERVE_COMMAND)


def job_engine(job: Job, config: dict) -> tuple[str, str]:
    """The engine that will run `job` and, when it is not the one asked for, why."""
    if config.get("base_url"):
        engine = "endpoint"
    elif not is_local_model(job, config):
        engine = "builtin"
    else:
        engine = "local"
    if job.engine != "vllm":
        return engine, ""
    if engine != "local":
        return (
            engine,
            f"the model is {'an endpoint' if engine == 'endpoint' else 'a built-in player'}: there is nothing to serve with vllm",
        )
    if job.kind in SERVED_KINDS:
        reason = serve_command_unavailable_reason()
        return ("local", reason) if reason else ("vllm", "")
    if job.kind == Job.Kind.RL:
        reason = vllm_unavailable_reason()
        return ("local", reason) if reason else ("vllm", "")
    return "local", f"{job.kind} samples nothing"


@contextlib.contextmanager
def served_config(job: Job, config: dict, engine: str) -> Iterator[dict]:
    """`config` as the job runs it: for an eval or synth on vllm, pointed at a server
    of its model that lives as long as the block (its log beside the job's outputs)."""
    if engine != "vllm" or job.kind not in SERVED_KINDS:
        yield config
        return
    out_dir = Path(config.get("out_dir") or config.get("output_dir") or settings.RUNS_DIR)
    out_dir.mkdir(parents=True, exist_ok=True)
    server = ServedModel(
        model_path(config["model"]),
        command=settings.VLLM_SERVE_COMMAND,
        name=f"job-{job.pk}",
        startup_seconds=settings.VLLM_STARTUP_SECONDS,
        log_path=out_dir / "vllm-serve.log",
    )
    server.start()
    try:
        yield {**config, "model": server.name, "base_url": server.base_url, "api_key_env": ""}
    finally:
        server.stop()


class ServerPool:
    """Servers of the last `keep` local models Play asked for, one per model path; the
    oldest is stopped when another starts, all of them at shutdown."""

    def __init__(self, keep: int, command: Callable[[], str] = lambda: settings.VLLM_SERVE_COMMAND):
        self.keep = keep
        self.command = command
        self.servers: OrderedDict[str, ServedModel] = OrderedDict()
        self.lock = threading.Lock()

    def policy(self, model: str) -> OpenAIPolicy:
        """A client of the server for `model`, started (and health-checked) if need be."""
        with self.lock:
            server = self.servers.get(model)
            if server is not None and not server.is_running():
                logger.warning("play: the server for %s died; starting it again", model)
                self.servers.pop(model)
                server = None
            if server is None:
                server = ServedModel(
                    model_path(model),
                    command=self.command(),
                    name=Path(model_path(model)).name,
                    startup_seconds=settings.VLLM_STARTUP_SECONDS,
                )
                server.start()
                self.servers[model] = server
                while len(self.servers) > self.keep:
                    evicted, old = self.servers.popitem(last=False)
                    logger.info("play: stopping the server of %s", evicted)
                    old.stop()
            self.servers.move_to_end(model)
            # One quick retry: a person is waiting, and can ask again from the page.
            return server.policy(max_retries=1)

    def stop_all(self) -> None:
        with self.lock:
            while self.servers:
                _, server = self.servers.popitem()
                server.stop()


def play_engine() -> tuple[str, str]:
    """The engine Play moves of local models use on this worker, and why it is not the
    one INFERENCE_ENGINE asks for (else "")."""
    if settings.INFERENCE_ENGINE != "vllm":
        return "local", ""
    reason = serve_command_unavailable_reason()
    return ("local", reason) if reason else ("vllm", "")


play_servers = ServerPool(keep=3)
atexit.register(play_servers.stop_all)
