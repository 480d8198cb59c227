"""A checkpoint served by a child process that speaks the OpenAI API: `vllm serve` on GPU
nodes, reached through `OpenAIPolicy` like any endpoint.

`ServedModel(path).start()` picks a free port, starts the command (by default
`vllm serve {model} --host {host} --port {port} --served-model-name {name}`; any command
with the same placeholders works, e.g. `{python} -m rlcore serve {model} --host {host}
--port {port} --served-name {name}`, the project's own server), waits until
`GET /v1/models` lists the model, and hands back the base URL. The child runs in a
process group of its own, so `stop()` ends it with everything it spawned (vLLM starts an
engine process beside its API server): SIGTERM, then SIGKILL after a grace period. Its
output goes to a log file whose tail is in every error.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from rlcore.policy.base import PolicyError
from rlcore.policy.openai_client import OpenAIPolicy

VLLM_SERVE = "vllm serve {model} --host {host} --port {port} --served-model-name {name}"
PLACEHOLDERS = ("model", "host", "port", "name", "python")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def command_argv(template: str, **values) -> list[str]:
    """`template` split like a shell would, each word's placeholders filled in ({python}
    is this interpreter); a value is never split or interpreted by a shell."""
    values = {"python": sys.executable, **values}
    try:
        return [word.format(**values) for word in shlex.split(template)]
    except (KeyError, IndexError, ValueError) as exc:
        raise PolicyError(
            f"serve command {template!r} is not usable ({type(exc).__name__}: {exc}); "
            f"placeholders accepted: {', '.join('{' + p + '}' for p in PLACEHOLDERS)}"
        ) from None


def command_unavailable_reason(template: str) -> str | None:
    """Why the serve command cannot run on this machine (its program is not installed),
    or None."""
    words = shlex.split(template)
    if not words:
        return "the serve command is empty"
    program = words[0]
    if program == "{python}":
        return None
    if shutil.which(program) is None:
        what = "vLLM is not installed on this node" if Path(program).name == "vllm" else ""
        return f"{program!r} is not on PATH" + (f" ({what})" if what else "")
    return None


class ServedModel:
    """`model` (a checkpoint directory or hub id) served by `command` on a free port."""

    def __init__(
        self,
        model: str,
        *,
        command: str = VLLM_SERVE,
        name: str | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        startup_seconds: float = 600.0,
        log_path: str | Path | None = None,
        env: dict | None = None,
    ):
        self.model = model
        self.command = command
        self.name = name or Path(model).name or model
        self.host = host
        self.port = port
        self.startup_seconds = startup_seconds
        self.log_path = Path(log_path) if log_path else None
        self.env = env
        self.process: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def __repr__(self) -> str:
        return f"ServedModel({self.model!r}, command={self.command.split()[0]!r}, port={self.port})"

    def log_tail(self, chars: int = 3000) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")[-chars:]

    def start(self) -> str:
        """Start the server and wait until it serves the model; its base URL."""
        if self.process is not None and self.process.poll() is None:
            return self.base_url
        self.port = self.port or free_port(self.host)
        argv = command_argv(
            self.command, model=self.model, host=self.host, port=self.port, name=self.name
        )
        if self.log_path is None:
            handle, name = tempfile.mkstemp(prefix="served-model-", suffix=".log")
            os.close(handle)
            self.log_path = Path(name)
        with self.log_path.open("ab") as log:
            try:
                self.process = subprocess.Popen(
                    argv,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env={**os.environ, **(self.env or {})},
                    start_new_session=True,
                )
            except OSError as exc:
                raise PolicyError(
                    f"could not start {argv[0]!r} to serve {self.model}: {exc}"
                ) from exc
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self.base_url

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_seconds
        last = "no answer yet"
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise PolicyError(
                    f"the server for {self.model} exited with status {self.process.returncode} "
                    f"before it answered; its log ({self.log_path}) ends:\n{self.log_tail()}"
                )
            try:
                answer = httpx.get(f"{self.base_url}/models", timeout=2.0)
                if answer.status_code == 200:
                    served = [row.get("id") for row in answer.json().get("data", [])]
                    if self.name in served:
                        return
                    last = f"it serves {served}, not {self.name!r}"
                else:
                    last = f"GET /v1/models answered {answer.status_code}"
            except (httpx.HTTPError, ValueError) as exc:
                last = f"{type(exc).__name__}: {exc}"
            time.sleep(0.5)
        raise PolicyError(
            f"the server for {self.model} did not serve {self.name!r} at {self.base_url} within "
            f"{self.startup_seconds:g} s ({last}); its log ({self.log_path}) ends:\n{self.log_tail()}"
        )

    def is_running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, grace_seconds: float = 10.0) -> None:
        """End the server and whatever it started: SIGTERM to its process group, SIGKILL
        after `grace_seconds`."""
        process, self.process = self.process, None
        if process is None:
            return
        for sig, wait in ((signal.SIGTERM, grace_seconds), (signal.SIGKILL, 10.0)):
            if process.poll() is not None:
                break
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=wait)
        # Children that outlived the leader (the group may hold more than one process).
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)

    def policy(self, **kwargs) -> OpenAIPolicy:
        """The OpenAI-compatible client for the served model (no API key is sent)."""
        return OpenAIPolicy(base_url=self.base_url, model=self.name, api_key_env="", **kwargs)

    def __enter__(self) -> ServedModel:
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()
