"""The whole lab, brought up for real, driven through Debian's chromium.

For the session: a fresh PostgreSQL database (`rllab_browser`, dropped and recreated),
`manage.py migrate`, users alice (the one who clicks) and admin (staff, for the admin
page), `uvicorn webapp.asgi:application` on a free port, and a Celery worker on the cpu,
gpu and inference queues, both pointed at that database and at Redis DB 13 (flushed), so
a `make run` on DB 0 or the web tests on DB 14 are not disturbed. Alice logs in once
through the login page; each test gets a fresh page with her session, 1280 pixels wide.
Screenshots go to SCREENSHOTS_DIR (default var/screenshots; `make screenshots` points it
at docs/screenshots/, the README's pictures).

Settings (environment variables, all optional): BROWSER_PG_URL (server, default
postgres://postgres@127.0.0.1:5432), BROWSER_DATABASE (default rllab_browser),
BROWSER_REDIS_URL (default redis://127.0.0.1:6379/13), RLCORE_HOME (default
var/test-rlcore, where the tiny model is built once).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
import redis
from playwright.sync_api import Page, sync_playwright

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
PG_URL = os.environ.get("BROWSER_PG_URL", "postgres://postgres@127.0.0.1:5432")
DATABASE = os.environ.get("BROWSER_DATABASE", "rllab_browser")
REDIS_URL = os.environ.get("BROWSER_REDIS_URL", "redis://127.0.0.1:6379/13")
SCREENSHOTS = Path(os.environ.get("SCREENSHOTS_DIR", REPO / "var" / "screenshots"))
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]
VIEWPORT = {"width": 1280, "height": 900}
USERS = {"alice": "alice-password", "admin": "admin-password"}

_CREATE_USERS = """
from django.contrib.auth import get_user_model
User = get_user_model()
User.objects.create_user("alice", password="alice-password")
User.objects.create_superuser("admin", email="", password="admin-password")
"""


@dataclass
class Stack:
    url: str
    database_url: str
    worker_log: Path
    server_log: Path
    env: dict

    def django(self, code: str) -> str:
        """What `code` prints, run by `manage.py shell` against the lab's database."""
        done = subprocess.run([str(BIN / "python"), "manage.py", "shell", "-c", code], cwd=REPO,
                              env=self.env, capture_output=True, text=True)  # fmt: skip
        if done.returncode:
            pytest.fail(f"manage.py shell failed:\n{done.stderr[-3000:]}")
        return done.stdout

    def sql(self, query: str, *params) -> list[tuple]:
        """Rows of a read-only query on the lab's database (what the worker wrote)."""
        with psycopg.connect(self.database_url, autocommit=True) as conn:
            return conn.execute(query, params).fetchall()

    def logs(self) -> str:
        return (
            f"--- server log ---\n{self.server_log.read_text()[-3000:]}\n"
            f"--- worker log ---\n{self.worker_log.read_text()[-3000:]}"
        )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _recreate_database() -> str:
    with psycopg.connect(f"{PG_URL}/postgres", autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{DATABASE}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{DATABASE}"')
    return f"{PG_URL}/{DATABASE}"


def _run(command: list[str], env: dict) -> None:
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode:
        pytest.fail(f"{' '.join(command)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@pytest.fixture(scope="session")
def stack(tmp_path_factory) -> Stack:
    database_url = _recreate_database()
    redis.Redis.from_url(REDIS_URL).flushdb()
    var_dir = tmp_path_factory.mktemp("browser-var")
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "webapp.settings",
        "DATABASE_URL": database_url,
        "REDIS_URL": REDIS_URL,
        "RLLAB_VAR_DIR": str(var_dir),
        "RUNS_DIR": str(var_dir / "runs"),
        "RLCORE_HOME": os.environ.get("RLCORE_HOME") or str(REPO / "var" / "test-rlcore"),
        "SECRET_KEY": "browser-tests",
        "DEBUG": "0",
        "PYTHONUNBUFFERED": "1",
    }
    python = str(BIN / "python")
    _run([python, "manage.py", "migrate", "--noinput"], env)
    _run([python, "manage.py", "shell", "-c", _CREATE_USERS], env)

    port = _free_port()
    server_log, worker_log = var_dir / "server.log", var_dir / "worker.log"
    node = f"browser-{os.getpid()}@{socket.gethostname()}"
    with server_log.open("w") as out:
        server = subprocess.Popen(
            [str(BIN / "uvicorn"), "webapp.asgi:application", "--host", "127.0.0.1",
             "--port", str(port), "--log-level", "warning"],
            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    with worker_log.open("w") as out:
        worker = subprocess.Popen(
            [str(BIN / "celery"), "-A", "workers", "worker", "-Q", "cpu,gpu,inference",
             "--concurrency", "1", "-P", "solo", "-n", node, "--without-gossip",
             "--without-mingle", "-l", "INFO"],
            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    stack = Stack(f"http://127.0.0.1:{port}", database_url, worker_log, server_log, env)
    try:
        deadline = time.monotonic() + 90
        while not (
            _answers(f"{stack.url}/accounts/login/") and " ready." in worker_log.read_text()
        ):
            if (
                server.poll() is not None
                or worker.poll() is not None
                or time.monotonic() > deadline
            ):
                pytest.fail(f"the lab did not come up:\n{stack.logs()}")
            time.sleep(0.3)
        yield stack
    finally:
        _stop(worker)
        _stop(server)


@pytest.fixture(scope="session")
def browser():
    executable = shutil.which("chromium")
    if executable is None:
        pytest.fail("Debian's chromium is missing: apt-get install -y chromium")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


def log_in(browser, stack: Stack, username: str, login_path: str = "/accounts/login/"):
    """A browser context logged in as `username` through the login page's form."""
    context = browser.new_context(viewport=VIEWPORT, base_url=stack.url)
    page = context.new_page()
    page.goto(login_path)
    page.fill("input[name=username]", username)
    page.fill("input[name=password]", USERS[username])
    page.click("button[type=submit], input[type=submit]")
    page.wait_for_load_state()
    if "login" in page.url:
        pytest.fail(f"{username} could not log in: {page.content()[:2000]}")
    page.close()
    return context


@pytest.fixture(scope="session")
def alice_state(browser, stack, tmp_path_factory) -> Path:
    context = log_in(browser, stack, "alice")
    path = tmp_path_factory.mktemp("state") / "alice.json"
    context.storage_state(path=str(path))
    context.close()
    return path


@pytest.fixture
def page(browser, stack, alice_state) -> Page:
    context = browser.new_context(
        viewport=VIEWPORT, base_url=stack.url, storage_state=str(alice_state)
    )
    page = context.new_page()
    page.set_default_timeout(20_000)
    yield page
    context.close()


def screenshot(page: Page, name: str) -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / name
    page.screenshot(path=str(path), full_page=True)
    return path
