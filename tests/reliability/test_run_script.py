"""`make run` as a user runs it (make, then scripts/run.sh, in a session of their own as in a
terminal): Redis started persistent and the tiny model built, both under RLLAB_VAR_DIR, one
worker for jobs and one for Play moves, several web processes; a worker killed with
kill -9 is reported and started again while the web server keeps answering; Ctrl-C stops
everything, with no error from make."""

import contextlib
import os
import re
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import redis

from tests.lab_fixtures import REPO, _database_url
from tests.reliability.conftest import free_port

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.worker]


def all_processes() -> dict[int, tuple[int, int, str]]:
    """pid -> (parent pid, session id, command line) of the live (not zombie) processes."""
    out = subprocess.run(
        ["ps", "-e", "-ww", "-o", "pid=,ppid=,sid=,stat=,args="], capture_output=True, text=True
    ).stdout
    processes = {}
    for line in out.splitlines():
        pid, ppid, sid, stat, args = line.split(None, 4)
        if not stat.startswith("Z"):
            processes[int(pid)] = (int(ppid), int(sid), args)
    return processes


def lab_processes(root: int, sessions: set[int]) -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) of run.sh's descendants and of any process left
    in their sessions (run.sh starts each command in a session of its own); the sessions
    seen are added to `sessions`."""
    processes = all_processes()
    tree = {root} if root in processes else set()
    grew = True
    while grew:
        more = {pid for pid, (ppid, _, _) in processes.items() if ppid in tree} - tree
        tree |= more
        grew = bool(more)
    sessions |= {processes[pid][1] for pid in tree}
    return {
        pid: (ppid, args)
        for pid, (ppid, sid, args) in processes.items()
        if pid in tree or sid in sessions
    }


def worker_main(root: int, sessions: set[int], queue_flag: str) -> int | None:
    """The main process of run.sh's celery worker started with `queue_flag`."""
    processes = lab_processes(root, sessions)
    for pid, (ppid, args) in processes.items():
        parent = processes.get(ppid, (0, ""))[1]
        if "celery" in args and queue_flag in args and "celery" not in parent:
            return pid
    return None


def web_answers(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/accounts/login/", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


def wait_for(condition, timeout: float, what: str, output=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.3)
    raise AssertionError(
        f"{what} within {timeout}s\n{output.read_text()[-3000:] if output else ''}"
    )


def test_make_run_restarts_a_dead_worker_keeps_the_web_up_and_stops_cleanly_on_ctrl_c(
    tmp_path, real_services
):
    redis_port, web_port = free_port(), free_port()
    redis_url = f"redis://127.0.0.1:{redis_port}/0"
    output, var = tmp_path / "run.out", tmp_path / "var"
    env = {
        **{name: value for name, value in os.environ.items() if name != "RLCORE_HOME"},
        "RLLAB_VAR_DIR": str(var),
        "RUNS_DIR": str(real_services),
        "REDIS_URL": redis_url,
        "DATABASE_URL": _database_url(),
        "PORT": str(web_port),
        "SECRET_KEY": "test-run-sh",
        "WEB_CONCURRENCY": "2",
        "WORKER_CONCURRENCY": "1",
        "INFERENCE_CONCURRENCY": "1",
        "STOP_GRACE_SECONDS": "5",
    }
    sessions: set[int] = set()
    with output.open("w") as out:
        # -o: the virtual environment counts as installed (no pip run in a test). A terminal
        # starts its foreground job with Ctrl-C's default action; a test run started in the
        # background (`make test &`, nohup) passes on SIGINT ignored, which bash cannot
        # trap, so the job gets the terminal's disposition back.
        run = subprocess.Popen(["make", "-o", ".venv/.installed", "run"], cwd=REPO, env=env,
                               stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    try:
        wait_for(lambda: web_answers(web_port), 240, "the lab does not answer", output)
        # Redis was started by run.sh, persistent, with its files under RLLAB_VAR_DIR...
        started = redis.Redis.from_url(redis_url)
        assert started.config_get("appendonly") == {"appendonly": "yes"}
        assert started.config_get("dir") == {"dir": str(var / f"redis-{redis_port}")}
        # ...as is the tiny model, RLCORE_HOME being unset.
        tiny = re.search(r"tiny model: (\S+)$", output.read_text(), re.MULTILINE)
        assert tiny and tiny.group(1).startswith(f"{var / 'rlcore'}/"), output.read_text()
        assert (Path(tiny.group(1)) / "config.json").is_file()
        jobs_worker = wait_for(
            lambda: worker_main(run.pid, sessions, "-Q cpu"), 60, "no jobs worker", output
        )
        inference = wait_for(
            lambda: worker_main(run.pid, sessions, "-Q inference"),
            60,
            "no inference worker",
            output,
        )
        uvicorn = [
            p for p, (_, a) in lab_processes(run.pid, sessions).items() if "--workers 2" in a
        ]
        assert len(uvicorn) == 1, lab_processes(run.pid, sessions)

        # kill -9 the inference worker's main process: run.sh also kills the pool processes it
        # leaves (a prefork pool has some; a thread pool, none).
        pool = [p for p, (pp, _) in lab_processes(run.pid, sessions).items() if pp == inference]
        os.kill(inference, signal.SIGKILL)
        killed = time.monotonic()
        line = wait_for(
            lambda: re.search(rf"worker inference \(pid {inference}\) exited with status \d+; "
                              r"starting it again", output.read_text()),
            30, "run.sh does not say the worker died", output,
        )  # fmt: skip
        assert line
        assert web_answers(web_port)
        restarted = wait_for(
            lambda: (pid := worker_main(run.pid, sessions, "-Q inference")) not in (None, inference) and pid,
            60, "the inference worker is not started again", output,
        )  # fmt: skip
        print(f"\ninference worker running again {time.monotonic() - killed:.1f} s after kill -9")
        assert restarted != inference
        wait_for(
            lambda: not set(pool) & set(lab_processes(run.pid, sessions)),
            10, "the dead worker's pool is still there", output,
        )  # fmt: skip
        assert (
            worker_main(run.pid, sessions, "-Q cpu") == jobs_worker
        )  # the other worker was left alone
        assert [
            p for p, (_, a) in lab_processes(run.pid, sessions).items() if "--workers 2" in a
        ] == uvicorn

        # Ctrl-C: the terminal sends SIGINT to the whole foreground process group. make
        # dies of it as it should, after run.sh stopped everything and exited 0: make
        # reports a recipe's failure ("make: *** [Makefile:21: run] Error 143"), never this.
        os.killpg(run.pid, signal.SIGINT)
        try:
            code = run.wait(timeout=60)
        except subprocess.TimeoutExpired:
            # What is still running, and what run.sh said, for the next one to look at.
            still = "\n".join(
                f"{pid} (parent {ppid}): {args}"
                for pid, (ppid, args) in lab_processes(run.pid, sessions).items()
            )
            pytest.fail(
                f"make run still running 60 s after Ctrl-C; its processes:\n{still}\n"
                f"its output:\n{output.read_text()[-3000:]}"
            )
        assert code in (0, -signal.SIGINT)
        assert "run.sh: stopping" in output.read_text()
        assert "make: ***" not in output.read_text(), output.read_text()[-3000:]
        deadline = time.monotonic() + 20
        while lab_processes(run.pid, sessions) and time.monotonic() < deadline:
            time.sleep(0.3)
        assert not lab_processes(run.pid, sessions), lab_processes(run.pid, sessions)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
        for pid in lab_processes(run.pid, sessions):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(redis.exceptions.ConnectionError):
            redis.Redis.from_url(redis_url).shutdown(nosave=True)
