"""Load benchmark of the lab as users run it: `scripts/run.sh` serving websocket viewers
of a running job, bursts of metric reads and games of tic-tac-toe while RL jobs train.

    .venv/bin/python bench/load.py [--viewers 100] [--gets 200] [--games 20] [--rl-jobs 2]
        [--duration 60] [--burst-every 15] [--points 4650] [--out bench/results/load.json]

It starts the lab through scripts/run.sh in its own process group, with its own var
directory (a temporary one), port, Redis database and PostgreSQL database (dropped and
created afresh), logs in as the admin over HTTP, and then, for --duration seconds:
- `--rl-jobs` RL jobs of the tiny model train, started through the JSON API;
- `--viewers` websockets watch the first of them; each job.update's receipt time minus the
  newest metric time it carries (the moment the worker's sink took the point) is the
  notification latency: it includes the sink's wait for a quiet moment (0.25 s) before it
  writes a batch;
- every --burst-every seconds `--gets` concurrent GET /api/jobs/<id>/metrics/ read a
  finished job of `--points` points (written straight to the database beforehand); the
  first burst finds no cached series, and half a period after each burst the same burst
  goes out with If-None-Match (304s where the server answers them);
- `--games` games against the tiny model play on: the move latency is the time from
  POSTing a cell to the websocket message that the model has answered (after one
  warm-up move, before the RL jobs start, in which the inference worker loads the model).
Prints a table (count, p50, p95, max, errors per measure) and writes the JSON results
with the machine and the git commit. Everything it started is stopped on the way out, on
error too. Only loopback addresses are used.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import re
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psycopg
from websockets.asyncio.client import connect

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results" / "load.json"
PYTHON = REPO / ".venv" / "bin" / "python"
HOST = "127.0.0.1"

# The finished job the metric bursts read: series named like an RL job's, one point per
# series per step.
SERIES = (
    "reward/mean", "reward/std", "reward/win", "reward/draw", "reward/loss", "reward/format",
    "reward/invalid", "loss/policy", "loss/kl", "loss/entropy", "perf/tokens_per_s",
    "perf/step_s", "train/lr", "train/grad_norm", "rollout/completion_tokens",
)  # fmt: skip

# Small RL steps, so the tiny model reports often on a CPU; more steps than any run lasts
# (the benchmark cancels them at the end).
RL_OPTIONS = {
    "max_steps": 100000,
    "batch_size": 2,
    "rollouts_per_example": 2,
    "micro_batch_size": 2,
    "max_tokens": 24,
    "save_every": 0,
    "log_rollouts": 2,
}

VIEWER_ARRIVAL_S = 5.0

SETUP_SCRIPT = """
import json, random
from datetime import timedelta
from django.contrib.auth import get_user_model
from django.utils import timezone
from webapp.jobs.models import EnvironmentConfig, Job, Metric, ModelEntry
admin = get_user_model().objects.get(username="admin")
series, points = json.loads({spec!r})
steps = points // len(series)
start = timezone.now() - timedelta(hours=1)
job = Job.objects.create(owner=admin, kind="rl", status="succeeded", last_step=steps,
                         config={{"benchmark": "load"}}, started=start, finished=timezone.now(),
                         heartbeat=timezone.now())
rng = random.Random(0)
Metric.objects.bulk_create(
    (Metric(job=job, step=step, name=name, value=rng.random(),
            created=start + timedelta(seconds=step))
     for step in range(1, steps + 1) for name in series),
    batch_size=2000,
)
print(json.dumps({{
    "finished_job": job.pk,
    "points": Metric.objects.filter(job=job).count(),
    "tiny": ModelEntry.objects.get(owner=admin, name="tiny").pk,
    "tictactoe": EnvironmentConfig.objects.get(owner=admin, name="tictactoe (defaults)").pk,
    "play_model": ModelEntry.objects.create(
        owner=admin, name="load checkpoint", kind="checkpoint", location={play_model!r}
    ).pk if {play_model!r} else None,
}}))
"""


@dataclass
class Measure:
    """Latencies (seconds) of one kind of event, and what went wrong."""

    seconds: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    # Events still waited for when the run ended: how long each had waited by then (not
    # errors, not latencies; a long one would show a stall the percentiles miss).
    cut_off: list[float] = field(default_factory=list)

    def summary(self) -> dict:
        values = sorted(self.seconds)
        out: dict = {"count": len(values), "errors": len(self.errors)}
        if self.cut_off:
            out |= {"cut_off": len(self.cut_off), "cut_off_waited_max": max(self.cut_off)}
        if values:
            out |= {
                "p50": statistics.median(values),
                "p95": values[min(len(values) - 1, int(0.95 * len(values)))],
                "max": values[-1],
            }
        if self.errors:
            out["error_examples"] = sorted(set(self.errors))[:5]
        return out


@dataclass
class Lab:
    """The lab started by run.sh, and the session of its logged-in admin."""

    base: str
    process: subprocess.Popen
    log_path: Path
    env: dict
    client: httpx.AsyncClient | None = None

    @property
    def ws_base(self) -> str:
        return self.base.replace("http://", "ws://", 1)

    def cookie_header(self) -> str:
        return "; ".join(f"{k}={v}" for k, v in self.client.cookies.items())

    def csrf_headers(self) -> dict:
        return {"X-CSRFToken": self.client.cookies["csrftoken"]}

    def ws_headers(self) -> dict:
        return {"Cookie": self.cookie_header()}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def loopback(url: str, option: str) -> str:
    host = httpx.URL(
        url.replace("postgres://", "http://", 1).replace("redis://", "http://", 1)
    ).host
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise SystemExit(f"{option} must point at this machine's loopback address, got {url}")
    return url


def fresh_database(url: str) -> None:
    """Drop and create the benchmark's own database (never the lab's or the tests')."""
    name = url.rsplit("/", 1)[1]
    if not name.startswith("rllab_bench"):
        raise SystemExit(f"--database-url must name a database rllab_bench*, got {name!r}")
    maintenance = url.rsplit("/", 1)[0].replace("postgres://", "postgresql://", 1) + "/postgres"
    with psycopg.connect(maintenance, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')


def flush_redis(url: str) -> None:
    import redis

    if url.rstrip("/").rsplit("/", 1)[-1] in ("", "0"):
        raise SystemExit(f"--redis-url must name a Redis database of its own (not 0), got {url}")
    redis.Redis.from_url(url).flushdb()


def start_lab(args, var_dir: Path) -> Lab:
    port = args.port or free_port()
    env = {
        **os.environ,
        "HOST": HOST,
        "PORT": str(port),
        "RLLAB_VAR_DIR": str(var_dir),
        "RUNS_DIR": str(var_dir / "runs"),
        "REDIS_URL": args.redis_url,
        "DATABASE_URL": args.database_url,
        "RLLAB_ADMIN_PASSWORD": secrets.token_urlsafe(12),
        "PYTHONUNBUFFERED": "1",
    }
    if args.play_model:
        # The checkpoint the games play against lives outside the lab's own run folders.
        env["MODEL_ROOTS"] = os.pathsep.join(
            [str(var_dir / "runs"), str(Path(args.play_model).parent)]
        )
    log_path = var_dir / "run.log"
    with log_path.open("w") as log_file:
        process = subprocess.Popen(
            ["bash", "scripts/run.sh"],
            cwd=REPO,
            env=env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stop_lab ends all of it
        )
    return Lab(base=f"http://{HOST}:{port}", process=process, log_path=log_path, env=env)


def stop_lab(lab: Lab) -> None:
    """SIGTERM to run.sh's whole process group (it was started as its leader), then
    SIGKILL to whatever is left, even when run.sh itself has already exited."""
    group = lab.process.pid
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        lab.process.wait(timeout=30)
    time.sleep(1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, signal.SIGKILL)
    lab.process.wait()


async def wait_until_up(lab: Lab, timeout: float) -> float:
    started = time.monotonic()
    async with httpx.AsyncClient(base_url=lab.base) as client:
        while time.monotonic() - started < timeout:
            if lab.process.poll() is not None:
                raise RuntimeError(f"run.sh exited:\n{lab.log_path.read_text()[-3000:]}")
            try:
                if (await client.get("/accounts/login/")).status_code == 200:
                    return time.monotonic() - started
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.5)
    raise RuntimeError(
        f"the lab did not answer within {timeout}s:\n{lab.log_path.read_text()[-3000:]}"
    )


def setup_data(lab: Lab, points: int, play_model: str) -> dict:
    """The finished job the bursts read, the ids of the seeded tiny model and config, and of
    the checkpoint the games play against (registered here when `play_model` is given)."""
    script = SETUP_SCRIPT.format(spec=json.dumps([list(SERIES), points]), play_model=play_model)
    out = subprocess.run(
        [str(PYTHON), "manage.py", "shell", "-c", script],
        cwd=REPO, env=lab.env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


async def log_in(lab: Lab, connections: int) -> None:
    # Idle connections are dropped before uvicorn's 5 s keep-alive ends them, so a burst
    # never reuses one the server is closing.
    limits = httpx.Limits(
        max_connections=connections, max_keepalive_connections=connections, keepalive_expiry=2
    )
    lab.client = httpx.AsyncClient(base_url=lab.base, limits=limits, timeout=120)
    await lab.client.get("/accounts/login/")
    response = await lab.client.post(
        "/accounts/login/",
        data={
            "username": "admin",
            "password": lab.env["RLLAB_ADMIN_PASSWORD"],
            "csrfmiddlewaretoken": lab.client.cookies["csrftoken"],
        },
    )
    if response.status_code != 302 or "sessionid" not in lab.client.cookies:
        raise RuntimeError(f"login failed: HTTP {response.status_code}")


async def start_rl_jobs(lab: Lab, count: int, ids: dict) -> list[int]:
    jobs = []
    for _ in range(count):
        response = await lab.client.post(
            "/api/jobs/",
            json={
                "kind": "rl",
                "model": ids["tiny"],
                "env_config": ids["tictactoe"],
                "options": RL_OPTIONS,
            },
            headers=lab.csrf_headers(),
        )
        if response.status_code != 201:
            raise RuntimeError(f"POST /api/jobs/: HTTP {response.status_code}: {response.text}")
        jobs.append(response.json()["id"])
    return jobs


async def wait_for_steps(lab: Lab, job_id: int, timeout: float) -> float:
    """Seconds until the job has stored its first step."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        job = (await lab.client.get(f"/api/jobs/{job_id}/")).json()
        if job["status"] not in ("queued", "running"):
            raise RuntimeError(f"RL job {job_id} is {job['status']}: {job['error']}")
        if job["last_step"] is not None:
            return time.monotonic() - started
        await asyncio.sleep(1)
    raise RuntimeError(f"RL job {job_id} stored no step within {timeout}s")


# ---------------------------------------------------------------------------------------
# The loads


async def viewer(
    lab: Lab, job_id: int, delay: float, until: float, notes: Measure, connected: list
) -> None:
    url = f"{lab.ws_base}/ws/jobs/{job_id}/"
    await asyncio.sleep(delay)
    try:
        async with connect(
            url, additional_headers=lab.ws_headers(), origin=lab.base, open_timeout=60
        ) as ws:
            hello = json.loads(await ws.recv())
            if hello.get("type") != "hello":
                notes.errors.append(f"first message {hello.get('type')!r}")
                return
            connected.append(job_id)
            while (left := until - time.time()) > 0:
                try:
                    raw = await asyncio.wait_for(ws.recv(), timeout=left)
                except TimeoutError:
                    break
                received = time.time()
                message = json.loads(raw)
                if message.get("type") == "job.update" and message.get("metrics"):
                    notes.seconds.append(received - max(m["t"] for m in message["metrics"]))
    except Exception as exc:  # counted, never fatal: the table says how many failed
        notes.errors.append(f"viewer: {type(exc).__name__}: {exc}")


async def get_metrics(lab: Lab, url: str, measure: Measure, etag: str | None) -> str | None:
    headers = {"If-None-Match": etag} if etag else {}
    started = time.monotonic()
    try:
        response = await lab.client.get(url, headers=headers)
    except httpx.HTTPError as exc:
        measure.errors.append(f"{type(exc).__name__}: {exc}")
        return None
    elapsed = time.monotonic() - started
    if response.status_code not in (200, 304):
        measure.errors.append(f"HTTP {response.status_code}")
        return None
    measure.seconds.append(elapsed)
    return response.headers.get("ETag")


async def metric_bursts(
    lab: Lab, job_id: int, count: int, every: float, until: float, measures: dict
) -> None:
    url = f"/api/jobs/{job_id}/metrics/"
    first = True
    while time.time() < until:
        burst_started = time.monotonic()
        plain = measures["metric GET, cold cache" if first else "metric GET"]
        etags = await asyncio.gather(*(get_metrics(lab, url, plain, None) for _ in range(count)))
        etag = next((e for e in etags if e), None)
        # Half a period later, so the server has finished with the first burst.
        await asyncio.sleep(max(0.0, every / 2 - (time.monotonic() - burst_started)))
        conditional = measures["metric GET, If-None-Match"]
        await asyncio.gather(*(get_metrics(lab, url, conditional, etag) for _ in range(count)))
        first = False
        await asyncio.sleep(max(0.0, every - (time.monotonic() - burst_started)))


async def game_player(
    lab: Lab,
    player: str,
    until: float,
    moves: Measure,
    games: list,
    max_moves: int = 10**9,
    posts: Measure | None = None,
) -> None:
    """Play games against `player` until `until` (or `max_moves` answers): each time the
    model is to answer, the latency runs from the cell's POST to the socket's word that
    the model has moved; `posts` gets the POST's own part (until its answer)."""
    try:
        while time.time() < until and len(moves.seconds) < max_moves:
            response = await lab.client.post(
                "/play/api/games/",
                json={"player": player, "human_mark": "X", "human_starts": True},
                headers=lab.csrf_headers(),
            )
            if response.status_code != 201:
                moves.errors.append(f"new game: HTTP {response.status_code}")
                return
            game = response.json()
            games.append(game["id"])
            url = f"{lab.ws_base}/ws/play/{game['id']}/"
            async with connect(
                url, additional_headers=lab.ws_headers(), origin=lab.base, open_timeout=60
            ) as ws:
                await ws.recv()  # hello
                while (
                    game["status"] == "human_turn"
                    and time.time() < until
                    and len(moves.seconds) < max_moves
                ):
                    free = [i for i, mark in enumerate(game["board"]) if mark == "."]
                    if not free:
                        break
                    cell = free[0]
                    sent = time.monotonic()
                    response = await lab.client.post(
                        f"/play/api/games/{game['id']}/move/",
                        json={"cell": cell},
                        headers=lab.csrf_headers(),
                    )
                    if response.status_code != 200:
                        moves.errors.append(f"move: HTTP {response.status_code}")
                        return
                    if posts is not None:
                        posts.seconds.append(time.monotonic() - sent)
                    game = response.json()
                    if game["status"] != "model_turn":
                        break  # the person's move ended the game
                    answered = await wait_for_model(ws, until)
                    if answered is None:
                        moves.cut_off.append(time.monotonic() - sent)
                        return
                    moves.seconds.append(time.monotonic() - sent)
                    # The message carries the game (older versions of the lab: read it).
                    game = (
                        answered.get("data")
                        or (await lab.client.get(f"/play/api/games/{game['id']}/")).json()
                    )
                    if game["status"] == "model_failed":
                        moves.errors.append(f"model failed: {game['error'][:100]}")
                        return
    except Exception as exc:  # counted, never fatal
        moves.errors.append(f"game: {type(exc).__name__}: {exc}")


async def wait_for_model(ws, until: float) -> dict | None:
    while (left := until - time.time()) > 0:
        try:
            message = json.loads(await asyncio.wait_for(ws.recv(), timeout=left))
        except TimeoutError:
            return None
        if message.get("type") == "game.update" and message.get("status") != "model_turn":
            return message
    return None


async def warm_up_play(lab: Lab, player: str, timeout: float) -> float:
    """Seconds until the model's first move in a game of its own: the inference worker
    loads the model then, which is not what a move costs afterwards."""
    moves = Measure()
    await game_player(lab, player, time.time() + timeout, moves, [], max_moves=1)
    if not moves.seconds:
        raise RuntimeError(f"the model never answered a first move: {moves.errors}")
    return moves.seconds[0]


async def cancel_jobs(lab: Lab, job_ids: list[int]) -> dict[int, int | None]:
    """Cancel the RL jobs; returns each one's last step."""
    steps = {}
    for job_id in job_ids:
        await lab.client.post(f"/api/jobs/{job_id}/cancel/", headers=lab.csrf_headers())
        steps[job_id] = (await lab.client.get(f"/api/jobs/{job_id}/")).json()["last_step"]
    return steps


async def measure_one_get(lab: Lab, job_id: int) -> float:
    started = time.monotonic()
    response = await lab.client.get(f"/api/jobs/{job_id}/metrics/")
    response.raise_for_status()
    return time.monotonic() - started


async def run_loads(lab: Lab, args, ids: dict, info: dict) -> dict:
    measures = {
        name: Measure()
        for name in (
            "notification latency",
            "metric GET, cold cache",
            "metric GET",
            "metric GET, If-None-Match",
            "move latency",
            "move POST",
        )
    }
    await log_in(lab, connections=2 * args.gets + args.games + 20)
    info["metric_get_alone_cold_s"] = await measure_one_get(lab, ids["finished_job"])
    info["metric_get_alone_warm_s"] = await measure_one_get(lab, ids["finished_job"])
    player = f"model-{ids['play_model'] or ids['tiny']}"
    if args.games:
        info["first_move_after_s"] = await warm_up_play(lab, player, args.start_timeout)
    rl_jobs = await start_rl_jobs(lab, args.rl_jobs, ids)
    info["rl_jobs"] = rl_jobs
    if rl_jobs:
        info["first_step_after_s"] = await wait_for_steps(lab, rl_jobs[0], args.start_timeout)
    until = time.time() + args.duration
    connected: list[int] = []
    games: list[int] = []
    # Viewers arrive over VIEWER_ARRIVAL_S, as people opening a page do; all at once,
    # each handshake's access check would hold a database connection at the same moment.
    tasks = [
        viewer(
            lab,
            rl_jobs[0],
            VIEWER_ARRIVAL_S * i / args.viewers,
            until,
            measures["notification latency"],
            connected,
        )  # fmt: skip
        for i in range(args.viewers if rl_jobs else 0)
    ]
    if args.gets:
        tasks.append(
            metric_bursts(lab, ids["finished_job"], args.gets, args.burst_every, until, measures)
        )
    tasks += [
        game_player(
            lab, player, until, measures["move latency"], games, posts=measures["move POST"]
        )
        for _ in range(args.games)
    ]
    try:
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=args.duration + 120)
    finally:
        info["viewers_connected"] = len(connected)
        info["games_played"] = len(games)
        info["rl_last_steps"] = await cancel_jobs(lab, rl_jobs)
        await lab.client.aclose()
    return {name: m.summary() for name, m in measures.items()}


# ---------------------------------------------------------------------------------------
# Report


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {"cores": os.cpu_count(), "cpu": cpu, "python": platform.python_version()}


def git(*command: str) -> str:
    out = subprocess.run(["git", *command], cwd=REPO, capture_output=True, text=True)
    return out.stdout.strip()


def print_table(results: dict) -> None:
    print(f"{'measure':<28}{'count':>7}{'p50 s':>9}{'p95 s':>9}{'max s':>9}{'errors':>8}")
    for name, row in results.items():
        cells = (
            "".join(f"{row[k]:>9.3f}" for k in ("p50", "p95", "max"))
            if row["count"]
            else f"{'-':>9}" * 3
        )
        print(f"{name:<28}{row['count']:>7}{cells}{row['errors']:>8}")
        for example in row.get("error_examples", []):
            print(f"    error: {example}")
        if row.get("cut_off"):
            print(
                f"    {row['cut_off']} still waited for when the run ended, the longest "
                f"for {row['cut_off_waited_max']:.3f} s"
            )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--viewers", type=int, default=100, help="websockets on the RL job")
    parser.add_argument("--gets", type=int, default=200, help="concurrent metric GETs a burst")
    parser.add_argument("--games", type=int, default=20, help="concurrent games")
    parser.add_argument("--rl-jobs", type=int, default=2, help="RL jobs training meanwhile")
    parser.add_argument("--duration", type=float, default=60, help="seconds of load")
    parser.add_argument("--burst-every", type=float, default=15, help="seconds between bursts")
    parser.add_argument("--points", type=int, default=4650, help="points of the finished job")
    parser.add_argument(
        "--play-model",
        default="",
        help="a checkpoint directory the games play against (default: the untrained tiny model)",
    )
    parser.add_argument("--port", type=int, default=0, help="default: a free one")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/10")
    parser.add_argument("--database-url", default="postgres://postgres@127.0.0.1:5432/rllab_bench")
    parser.add_argument("--start-timeout", type=float, default=300, help="seconds")
    parser.add_argument("--out", default=str(RESULTS), help="where to write the JSON results")
    parser.add_argument(
        "--keep-log", default="", help="copy run.sh's output and the worker's log to this file"
    )
    args = parser.parse_args(argv)
    for name in ("viewers", "gets", "games", "rl_jobs"):
        if not 0 <= getattr(args, name) <= 1000:
            parser.error(f"--{name.replace('_', '-')} must be in 0..1000")
    if not 1 <= args.duration <= 1800:
        parser.error("--duration must be in 1..1800 seconds")
    if args.viewers and not args.rl_jobs:
        parser.error("--viewers watch an RL job: give --rl-jobs 1 or more")

    if args.play_model:
        play_model = Path(args.play_model).resolve()
        if not (play_model / "config.json").is_file():
            parser.error(f"--play-model: {play_model} holds no config.json (not a checkpoint)")
        args.play_model = str(play_model)
    fresh_database(loopback(args.database_url, "--database-url"))
    flush_redis(loopback(args.redis_url, "--redis-url"))
    info: dict = {}
    with tempfile.TemporaryDirectory(prefix="rllab-load-") as var_dir:
        lab = start_lab(args, Path(var_dir))
        try:
            info["lab_started_after_s"] = asyncio.run(wait_until_up(lab, args.start_timeout))
            ids = setup_data(lab, args.points, args.play_model)
            info |= {"finished_job_points": ids["points"]}
            results = asyncio.run(run_loads(lab, args, ids, info))
        except BaseException:
            for path in Path(var_dir).glob("*.log"):
                print(
                    f"{path.name} ends:\n{path.read_text(errors='replace')[-2000:]}",
                    file=sys.stderr,
                )
            raise
        finally:
            stop_lab(lab)
            # run.sh's own output, then the logs its web server and workers write.
            logs = "\n".join(
                f"--- {path.name}\n{path.read_text(errors='replace')}"
                for path in sorted(
                    Path(var_dir).glob("*.log"), key=lambda p: (p != lab.log_path, p.name)
                )
            )
            if args.keep_log:
                Path(args.keep_log).write_text(logs)
            # The inference worker's own time per move (Celery logs each task's duration).
            tasks = Measure()
            inference_log = Path(var_dir) / "worker-inference.log"
            if inference_log.exists():
                tasks.seconds = [
                    float(seconds)
                    for seconds in re.findall(
                        r"play_model_move\[[^\]]*\] succeeded in ([0-9.]+)s",
                        inference_log.read_text(errors="replace"),
                    )
                ]
    if tasks.seconds:
        results["move task (worker)"] = tasks.summary()
    web_workers = logs.count("Started server process")
    print(
        f"lab via scripts/run.sh on {machine()['cores']} cores "
        f"(WEB_CONCURRENCY={os.environ.get('WEB_CONCURRENCY', 'unset')}, "
        f"{web_workers} web process(es) started); {args.rl_jobs} RL jobs, {args.viewers} "
        f"viewers, bursts of {args.gets} GETs on {info['finished_job_points']} points every "
        f"{args.burst_every:g} s, {args.games} games, {args.duration:g} s"
    )
    print(
        f"one metric GET alone: {info['metric_get_alone_cold_s']:.3f} s cold, "
        f"{info['metric_get_alone_warm_s']:.3f} s warm; viewers connected: "
        f"{info['viewers_connected']}; games: {info['games_played']}; RL steps: "
        f"{info['rl_last_steps']}"
    )
    print_table(results)
    out = {
        "benchmark": "load",
        "machine": machine(),
        "commit": git("rev-parse", "HEAD"),
        "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
        "run_sh_commit": git("log", "-1", "--format=%H %s", "--", "scripts/run.sh"),
        "run_sh_modified": bool(git("status", "--porcelain", "--", "scripts/run.sh")),
        "run_sh_blob": git("hash-object", "scripts/run.sh"),
        "web_concurrency": os.environ.get("WEB_CONCURRENCY"),
        "settings_module": os.environ.get("DJANGO_SETTINGS_MODULE", "webapp.settings"),
        "web_processes": web_workers,
        "options": {k: v for k, v in vars(args).items() if k not in ("out", "keep_log")},
        "rl_options": RL_OPTIONS,
        "info": info,
        "results": results,
    }
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")
    return out


if __name__ == "__main__":
    main()
