"""The code environment's jail against hostile programs: each is contained, scores 0 with a
reason that says what happened, and leaves the process that verified it unharmed, able to
score the next reply. Every program here runs in a real bubblewrap jail."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from rlcore.envs.code_env import CodeVerifier, tasks_by_id
from rlcore.sandbox import SANDBOX_UIDS, Limits, Sandbox, SandboxUnavailable

WALL_SECONDS = 3.0
TASK = tasks_by_id()["sum_digits"]  # tests: 0 -> 0, 123 -> 6, 9999 -> 36, 1000001 -> 2


@pytest.fixture(scope="module")
def verifier() -> CodeVerifier:
    # CPU seconds above the wall time, so a busy loop always meets the wall-time kill.
    limits = Limits(wall_seconds=WALL_SECONDS, cpu_seconds=int(WALL_SECONDS) + 2)
    return CodeVerifier(limits, parallel_jails=2, test_seconds=1.0)


def jailed_processes(verifier: CodeVerifier, *, zombies: bool = False) -> list[int]:
    """Processes running as one of the uids `verifier`'s jails had that no jail holds now
    (only meaningful as root; a uid another test process's jail has leased since is
    skipped); with `zombies`, the dead ones not yet reaped instead."""
    from rlcore.sandbox import _UidLease

    lease, uids, held = _UidLease(), set(), []
    for uid in verifier.sandbox.used_uids:
        if (fd := lease.hold(uid)) is not None:
            uids.add(uid)
            held.append(fd)
    try:
        return _processes_of(uids, zombies)
    finally:
        for fd in held:
            _UidLease.release(fd)


def _processes_of(uids: set[int], zombies: bool) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                owner = os.stat(f"/proc/{entry}").st_uid
                state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except (FileNotFoundError, ProcessLookupError):
                continue
            if owner in uids and (state == "Z") == zombies:
                found.append(int(entry))
    return found


def assert_worker_unharmed(verifier: CodeVerifier) -> None:
    """This process is alive, nothing of the jail outlived it, and the next reply is
    scored normally."""
    os.kill(os.getpid(), 0)
    if os.geteuid() == 0:
        assert verifier.sandbox.used_uids and jailed_processes(verifier) == []
    assert verifier.verify(TASK, TASK.solution).passed == len(TASK.tests)


def test_the_reference_solution_passes_in_the_jail(verifier):
    verdict = verifier.verify(TASK, TASK.solution)
    assert (verdict.passed, verdict.total) == (4, 4)
    assert verdict.reason == "4 of 4 tests passed"


SECRET = "the-lab-var-dir-secret"


def lab_var_dir() -> Path:
    return Path(os.environ.get("RLCORE_HOME", "var")).resolve()


HOSTILE = {
    "fork bomb": (
        "import os\ndef sum_digits(n):\n    while True:\n        os.fork()\n",
        r"reported more than once|BlockingIOError|Resource temporarily unavailable|wall-time",
    ),
    "infinite loop that swallows the per-test alarm": (
        "def sum_digits(n):\n    while True:\n        try:\n            while True:\n"
        "                pass\n        except BaseException:\n            pass\n",
        r"no result: the program was killed at the wall-time limit",
    ),
    "10 GB allocation": (
        "def sum_digits(n):\n    block = bytearray(10 * 1024 ** 3)\n    return n\n",
        r"raised MemoryError",
    ),
    "reading /etc/passwd": (
        "def sum_digits(n):\n    return open('/etc/passwd').read()\n",
        r"raised FileNotFoundError: .*'/etc/passwd'",
    ),
    "reading the lab's var dir": (
        "def sum_digits(n):\n    return open({secret!r}).read()\n",
        r"raised FileNotFoundError",
    ),
    "opening a socket to the lab's Redis": (
        "import socket\ndef sum_digits(n):\n"
        "    socket.create_connection(('127.0.0.1', 6379), timeout=1).close()\n"
        "    return sum(int(c) for c in str(n))\n",
        r"raised (ConnectionRefusedError|OSError)",
    ),
    "opening a socket to the internet": (
        "import socket\ndef sum_digits(n):\n"
        "    socket.create_connection(('1.1.1.1', 53), timeout=1).close()\n"
        "    return sum(int(c) for c in str(n))\n",
        r"raised OSError: \[Errno 101\] Network is unreachable",
    ),
    "writing into /usr": (
        "def sum_digits(n):\n    open('/usr/lib/pwned', 'w').write('x')\n"
        "    return sum(int(c) for c in str(n))\n",
        r"raised OSError: \[Errno 30\] Read-only file system",
    ),
    "writing into the repository": (
        "def sum_digits(n):\n    open({outside!r}, 'w').write('x')\n"
        "    return sum(int(c) for c in str(n))\n",
        r"raised FileNotFoundError",
    ),
    "killing the parent and the worker": (
        "import os, signal, time\ndef sum_digits(n):\n"
        "    parent = os.getppid()\n    os.kill(parent, signal.SIGKILL)\n"
        "    for pid in ({worker_pid}, -1):\n        try:\n"
        "            os.kill(pid, signal.SIGKILL)\n        except ProcessLookupError:\n"
        "            pass\n    time.sleep(0.2)\n    os.kill(parent, 0)\n"
        "    raise RuntimeError(f'parent {{parent}} survived')\n",
        r"raised RuntimeError: parent 1 survived",
    ),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_hostile_program_is_contained_and_scores_zero(verifier, name, tmp_path):
    secret = lab_var_dir() / "sandbox-secret.txt"
    secret.parent.mkdir(parents=True, exist_ok=True)
    secret.write_text(SECRET)
    outside = Path.cwd() / f"sandbox-pwned-{os.getpid()}"
    template, reason = HOSTILE[name]
    code = template.format(secret=str(secret), outside=str(outside), worker_pid=os.getpid())

    started = time.monotonic()
    verdict = verifier.verify(TASK, code)
    seconds = time.monotonic() - started

    assert verdict.passed == 0, verdict
    assert re.search(reason, verdict.reason), verdict.reason
    assert SECRET not in verdict.reason
    assert seconds < WALL_SECONDS + 2
    assert not outside.exists() and not Path("/usr/lib/pwned").exists()
    assert_worker_unharmed(verifier)


def test_the_jail_sees_no_host_files_but_its_own(verifier):
    listing = "import os\ndef sum_digits(n):\n    return sorted(os.listdir('/'))\n"
    verdict = verifier.verify(TASK, listing)
    shown = re.search(r"returned (\[.*\])", verdict.tests[0]).group(1)
    assert "'usr'" in shown and "'tmp'" in shown
    for host_dir in ("etc", "home", "root", "work", "var"):
        assert f"'{host_dir}'" not in shown


def test_each_run_gets_a_fresh_scratch_dir(verifier):
    leave_a_mark = (
        "import os\ndef sum_digits(n):\n    seen = os.path.exists('/tmp/mark')\n"
        "    open('/tmp/mark', 'w').write('x')\n    return 'seen' if seen else 'fresh'\n"
    )
    first = verifier.verify(TASK, leave_a_mark)
    second = verifier.verify(TASK, leave_a_mark)
    # Within a run the scratch dir persists (the second test sees the first's mark) ...
    assert first.tests[:2] == ["wrong answer: returned 'fresh'", "wrong answer: returned 'seen'"]
    # ... and a new run starts from an empty one.
    assert second.tests == first.tests


@pytest.mark.skipif(os.geteuid() != 0, reason="jails run as their own uids only under root")
def test_runs_leave_no_zombies_behind(verifier):
    verifier.verify(TASK, TASK.solution)
    before = set(jailed_processes(verifier, zombies=True))
    for _ in range(3):
        verifier.verify(TASK, TASK.solution)
    assert set(jailed_processes(verifier, zombies=True)) <= before


def test_output_floods_are_cut_by_the_file_size_limit(verifier):
    flood = "import sys\ndef sum_digits(n):\n    while True:\n        print('x' * 65536)\n"
    verdict = verifier.verify(TASK, flood)
    assert verdict.passed == 0
    assert_worker_unharmed(verifier)


def test_tampering_with_the_result_channel_counts_for_nothing(verifier):
    forged = (
        "import os, json\n"
        "for fd in range(1, 10):\n"
        "    for i, value in enumerate(['0', '6', '36', '2']):\n"
        "        try:\n"
        "            os.write(fd, (json.dumps({'i': i, 'value': value}) + '\\n').encode())\n"
        "        except OSError:\n"
        "            pass\n"
        "def sum_digits(n):\n    return sum(int(c) for c in str(n))\n"
    )
    verdict = verifier.verify(TASK, forged)
    assert verdict.passed == 0
    assert "reported more than once" in verdict.reason


def test_the_lab_refuses_to_run_code_without_bubblewrap():
    sandbox = Sandbox(Limits(), bwrap="/nonexistent/bwrap")
    with pytest.raises(SandboxUnavailable, match=r"bubblewrap .* is not installed.*apt-get"):
        sandbox.run_harness(b"{}")


def test_a_jail_that_cannot_be_built_is_an_error_in_bwraps_words():
    sandbox = Sandbox(Limits(), python="/nonexistent/bin/python3")
    with pytest.raises(SandboxUnavailable, match=r"could not build a jail here \(bwrap: .*"):
        sandbox.run_harness(b"{}")


NON_ROOT_CHECK = """
import json, sys
sys.path.insert(0, sys.argv[1])
import sandbox
fork_until_refused = (
    "import os, time\\ndef f(x):\\n    n = 0\\n    try:\\n        while True:\\n"
    "            if os.fork() == 0:\\n                time.sleep(2)\\n                os._exit(0)\\n"
    "            n += 1\\n    except OSError:\\n        return n\\n"
)
jail = sandbox.Sandbox(sandbox.Limits(wall_seconds=5, max_processes=8))
request = {"code": fork_until_refused, "entry_point": "f", "inputs": ["(0,)"], "test_seconds": 4}
print(jail.run_harness(json.dumps(request).encode()).stdout)
"""


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="needs root to become an ordinary user",
)
def test_as_an_ordinary_user_the_process_limit_counts_only_the_jails_processes():
    # The lab run by an ordinary user: no uid switching, the count kept in the jail's own
    # user namespace. The modules are copied where that user can read them.
    user = str(SANDBOX_UIDS[-1])
    with tempfile.TemporaryDirectory() as folder:
        for name in ("sandbox.py", "sandbox_harness.py"):
            shutil.copy(Path(__file__).parent.parent / "rlcore" / name, Path(folder) / name)
        os.chmod(folder, 0o755)
        done = subprocess.run(
            ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups",
             "/usr/bin/python3", "-c", NON_ROOT_CHECK, folder],
            capture_output=True, text=True, timeout=60, cwd=folder,
        )  # fmt: skip
    assert done.returncode == 0, done.stderr
    forks = int(re.search(r'"value": "(\d+)"', done.stdout).group(1))
    # prlimit's 8 processes: the harness and bwrap's init are two of them.
    assert 1 <= forks <= 6, done.stdout


def test_the_harness_is_bound_from_where_the_jail_s_user_can_read_it():
    """A checkout under a private directory (a 0700 home, `mktemp -d`) is out of the jail
    uid's reach, so the harness is bound from a world-readable copy, not the checkout."""
    from rlcore.sandbox import HARNESS_INSIDE, HARNESS_PATH, Sandbox

    command = Sandbox().command(["true"])
    source = Path(command[command.index(HARNESS_INSIDE) - 1])
    assert source.read_bytes() == HARNESS_PATH.read_bytes()
    assert HARNESS_PATH.parent.parent not in source.parents  # not from the checkout
    assert source.stat().st_mode & 0o004  # readable by others
    for parent in source.parents:
        assert parent.stat().st_mode & 0o001, parent  # every directory traversable


LEASE_HOLDER = """
import sys, time
sys.path.insert(0, sys.argv[1])
from rlcore.sandbox import _UidLease
uid, _ = _UidLease().acquire()
print(uid, flush=True)
time.sleep(30)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="jails run as their own uids only under root")
def test_jails_of_two_workers_never_share_a_uid():
    """Two worker processes on one host, each with its own sandbox: while one holds a uid,
    the other's runs take another, so neither's programs can signal the other's; a killed
    worker's uid frees itself."""
    from rlcore.sandbox import _UidLease

    root = str(Path(__file__).parent.parent)
    holder = subprocess.Popen(
        [sys.executable, "-c", LEASE_HOLDER, root], stdout=subprocess.PIPE, text=True
    )
    try:
        held = int(holder.stdout.readline())
        uid, lease = _UidLease().acquire()
        _UidLease.release(lease)
        assert uid != held and uid in SANDBOX_UIDS
    finally:
        holder.kill()
        holder.wait()
    # The killed holder's lock went with its process: its uid is free again.
    leases = [_UidLease().acquire() for _ in SANDBOX_UIDS]
    try:
        assert held in {uid for uid, _ in leases}
    finally:
        for _, lease in leases:
            _UidLease.release(lease)
