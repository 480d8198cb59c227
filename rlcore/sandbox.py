"""A jail for running untrusted, model-written programs: bubblewrap plus resource limits.

Each run gets a fresh bubblewrap jail (`bwrap`, Debian's `bubblewrap` package): new user,
PID, network, IPC and UTS namespaces (so no network at all, and no view of the lab's
processes), the system's /usr bound read-only and nothing else of the host's files (no
/etc, no home, no lab var dir), a small tmpfs as the only writable directory, and inside
it `prlimit` caps address space, CPU seconds, processes and file size before the program
starts. The run is killed, its whole process group and PID namespace with it, at a wall
time limit; `--die-with-parent` takes the jail down if the lab process dies first, and
`--new-session` keeps the program off the lab's terminal.

Process limits count per user, so when the lab runs as root (where the kernel exempts
the count entirely) each concurrent run drops to its own unused uid from `SANDBOX_UIDS`,
leased across every process of the host (a lock file a uid, `_UidLease`): two workers'
jails never share a uid, so one's program can neither signal the other's nor count against
its limit. As an ordinary user, the run's user namespace is what the count is kept in.

There is no fallback: when bubblewrap is missing or the kernel refuses it namespaces,
`Sandbox.check` raises `SandboxUnavailable` saying why, and nothing runs unsandboxed.
"""

from __future__ import annotations

import atexit
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

HARNESS_PATH = Path(__file__).with_name("sandbox_harness.py")
HARNESS_INSIDE = "/sandbox/harness.py"
_readable_harness: Path | None = None


def readable_harness() -> Path:
    """A copy of the harness that the jail's unprivileged uid can read wherever the code
    lives (a checkout under a private directory, such as a 0700 home or `mktemp -d`, is
    out of its reach): made once per process in a world-readable temporary directory."""
    global _readable_harness
    if _readable_harness is None or not _readable_harness.is_file():
        directory = Path(tempfile.mkdtemp(prefix="rlcore-harness-"))
        directory.chmod(0o755)
        copy = directory / "harness.py"
        shutil.copyfile(HARNESS_PATH, copy)
        copy.chmod(0o644)
        atexit.register(shutil.rmtree, directory, ignore_errors=True)
        _readable_harness = copy
    return _readable_harness


# Unused uids the jails run as when the lab is root: one per concurrent run, so one run's
# processes never count against another's limit (and no real account is borrowed).
SANDBOX_UIDS = range(61000, 61064)
# Where the uid leases are held (root only: the uids are used only when the lab is root).
UID_LEASE_DIR = Path("/run/rlcore-sandbox-uids")
MAX_OUTPUT_BYTES = 1 << 20


class _UidLease:
    """A uid of `SANDBOX_UIDS` held by this run alone, across the host's processes: an
    exclusive lock on the uid's file in `UID_LEASE_DIR` (released with the file, so a
    killed worker's leases free themselves). Waits while every uid is held."""

    def __init__(self, directory: Path = UID_LEASE_DIR):
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            info = directory.lstat()
        except OSError as exc:
            raise SandboxUnavailable(
                f"cannot keep the jails' uid leases in {directory}: {exc}"
            ) from exc
        if not directory.is_dir() or directory.is_symlink() or info.st_uid != os.geteuid():
            raise SandboxUnavailable(
                f"{directory} is not a directory of this user's for uid leases"
            )
        self.directory = directory

    def acquire(self) -> tuple[int, int]:
        """(uid, the open lock file's descriptor)."""
        while True:
            for uid in SANDBOX_UIDS:
                if (fd := self.hold(uid)) is not None:
                    return uid, fd
            time.sleep(0.05)

    def hold(self, uid: int) -> int | None:
        """The lock of `uid` if no one holds it (its descriptor), else None."""
        fd = os.open(self.directory / f"{uid}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        return fd

    @staticmethod
    def release(fd: int) -> None:
        os.close(fd)  # closing the only descriptor drops the lock


# bwrap's outer process exits as soon as it learns the program's status, leaving its
# PID-namespace init to be reaped by PID 1; where PID 1 reaps nothing (a container's
# entry point), each run would leave a zombie. So bwrap is started by this small reaper,
# which adopts orphans (PR_SET_CHILD_SUBREAPER), dies with the lab (PR_SET_PDEATHSIG),
# reaps every descendant before it exits, and on SIGTERM kills bwrap's process group.
REAPER = """
import ctypes, os, signal, sys
libc = ctypes.CDLL(None)
libc.prctl(36, 1, 0, 0, 0)
libc.prctl(1, signal.SIGKILL, 0, 0, 0)
child = os.fork()
if child == 0:
    os.setpgid(0, 0)
    os.execv(sys.argv[1], sys.argv[1:])
def stop(signum, frame):
    try:
        os.killpg(child, signal.SIGKILL)
    except ProcessLookupError:
        pass
signal.signal(signal.SIGTERM, stop)
status = 1 << 8
while True:
    try:
        pid, found = os.wait()
    except ChildProcessError:
        break
    if pid == child:
        status = found
code = os.waitstatus_to_exitcode(status)
if code < 0:
    signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
os._exit(code)
"""


class SandboxUnavailable(RuntimeError):
    """The jail cannot be built here; candidate code must not run at all."""


@dataclass(frozen=True)
class Limits:
    """What one run may use."""

    wall_seconds: float = 10.0  # killed (whole process group and PID namespace) after this
    cpu_seconds: int = 10  # RLIMIT_CPU
    memory_mb: int = 512  # RLIMIT_AS
    max_processes: int = 16  # RLIMIT_NPROC, counted in the jail's own user
    max_file_mb: int = 4  # RLIMIT_FSIZE: any file written, stdout and stderr included
    scratch_mb: int = 16  # size of the tmpfs at /tmp, the only writable directory


@dataclass
class JailResult:
    """How one run ended and what it wrote."""

    stdout: str
    stderr: str
    exit_code: int  # negative: killed by that signal (subprocess's convention)
    timed_out: bool
    seconds: float

    def describe_exit(self) -> str:
        if self.timed_out:
            return "killed at the wall-time limit"
        if self.exit_code < 0:
            name = signal.Signals(-self.exit_code).name if -self.exit_code in _SIGNALS else ""
            return f"killed by signal {-self.exit_code} {name}".strip()
        return f"exited with status {self.exit_code}"


_SIGNALS = {s.value for s in signal.Signals}


def jail_python() -> str:
    """The interpreter candidate code runs with: RLCORE_SANDBOX_PYTHON, else Debian's
    /usr/bin/python3 (inside /usr, which the jail binds anyway), else this one."""
    configured = os.environ.get("RLCORE_SANDBOX_PYTHON")
    if configured:
        return configured
    if Path("/usr/bin/python3").exists():
        return "/usr/bin/python3"
    return os.path.realpath(sys.executable)


class Sandbox:
    """Runs programs in fresh bubblewrap jails, up to `slots` at once."""

    def __init__(
        self,
        limits: Limits | None = None,
        *,
        bwrap: str = "bwrap",
        python: str | None = None,
        slots: int = 4,
    ):
        self.limits = limits or Limits()
        self.bwrap = bwrap
        self.python = python or jail_python()
        self.reaper_python = jail_python()
        self._slots = threading.BoundedSemaphore(slots)  # this sandbox's concurrent runs
        self._lease = _UidLease() if os.geteuid() == 0 else None
        self.used_uids: set[int] = set()  # every uid a run of this sandbox has had
        self._checked = False

    # -- the jail ------------------------------------------------------------------------
    def _system_binds(self) -> list[str]:
        args = ["--ro-bind", "/usr", "/usr"]
        for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):
            if os.path.islink(top):
                args += ["--symlink", os.readlink(top), top]
            elif os.path.isdir(top):
                args += ["--ro-bind", top, top]
        prefix = os.path.dirname(os.path.dirname(os.path.realpath(self.python)))
        if not prefix.startswith("/usr"):
            args += ["--ro-bind", prefix, prefix]
        return args

    def command(self, argv: list[str]) -> list[str]:
        """The bwrap command line that runs `argv` (paths as seen inside the jail)."""
        bwrap = shutil.which(self.bwrap)
        if bwrap is None:
            raise SandboxUnavailable(
                f"bubblewrap ({self.bwrap!r}) is not installed, and candidate code never runs "
                "outside a jail; install it with `apt-get install -y bubblewrap` "
                "(`make install` does)"
            )
        limits = self.limits
        return [
            bwrap,
            "--unshare-all",
            "--die-with-parent",
            "--new-session",
            "--cap-drop",
            "ALL",
            "--hostname",
            "sandbox",
            *self._system_binds(),
            "--ro-bind",
            str(readable_harness()),
            HARNESS_INSIDE,
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--size",
            str(limits.scratch_mb << 20),
            "--tmpfs",
            "/tmp",
            "--chdir",
            "/tmp",
            "--clearenv",
            "--setenv",
            "PATH",
            "/usr/bin:/bin",
            "--setenv",
            "HOME",
            "/tmp",
            "--setenv",
            "LANG",
            "C.UTF-8",
            "--",
            "/usr/bin/prlimit",
            f"--as={limits.memory_mb << 20}",
            f"--cpu={limits.cpu_seconds}",
            f"--nproc={limits.max_processes}",
            f"--fsize={limits.max_file_mb << 20}",
            "--nofile=64",
            "--core=0",
            "--",
            *argv,
        ]

    def run(self, argv: list[str], stdin: bytes = b"") -> JailResult:
        """Run `argv` in a fresh jail and wait for it (at most the wall-time limit)."""
        command = self.command(argv)
        self._slots.acquire()
        uid, lease = self._lease.acquire() if self._lease is not None else (None, None)
        if uid is not None:
            self.used_uids.add(uid)
        started = time.monotonic()
        try:
            with (
                tempfile.TemporaryFile() as given,
                tempfile.TemporaryFile() as out,
                tempfile.TemporaryFile() as err,
            ):
                given.write(stdin)
                given.seek(0)
                # Output goes to files, not pipes: RLIMIT_FSIZE then caps what a program
                # can write, and a reader can never be flooded or deadlocked.
                process = subprocess.Popen(
                    [self.reaper_python, "-I", "-S", "-c", REAPER, *command],
                    stdin=given,
                    stdout=out,
                    stderr=err,
                    start_new_session=True,
                    user=uid,
                    group=uid,
                    extra_groups=[] if uid is not None else None,
                    close_fds=True,
                )
                timed_out = False
                try:
                    process.wait(timeout=self.limits.wall_seconds)
                except subprocess.TimeoutExpired:
                    timed_out = True
                    # The reaper kills bwrap's group; bwrap's init dies with it, and with
                    # that every process left in the jail's PID namespace, setsid'd ones too.
                    process.terminate()
                    try:
                        process.wait(timeout=5)
                    except subprocess.TimeoutExpired:
                        os.killpg(process.pid, signal.SIGKILL)
                        process.wait()
                seconds = time.monotonic() - started
                return JailResult(
                    stdout=_read_capped(out),
                    stderr=_read_capped(err),
                    exit_code=process.returncode,
                    timed_out=timed_out,
                    seconds=seconds,
                )
        finally:
            if lease is not None:
                _UidLease.release(lease)
            self._slots.release()

    def check(self) -> None:
        """Raise SandboxUnavailable, with bwrap's own words, unless a jail can be built."""
        if self._checked:
            return
        probe = self.run([self.python, "-I", "-S", "-c", "print('jailed')"])
        if probe.stdout.strip() != "jailed":
            detail = (probe.stderr.strip() or probe.describe_exit())[-500:]
            raise SandboxUnavailable(
                f"bubblewrap could not build a jail here ({detail}); candidate code never runs "
                "outside one. Check that user namespaces are allowed (`bwrap --unshare-all "
                "--ro-bind / / true` should succeed; sysctl user.max_user_namespaces > 0, "
                "kernel.apparmor_restrict_unprivileged_userns = 0) and that "
                f"{self.python} is readable by uid {SANDBOX_UIDS[0]} when running as root "
                "(set RLCORE_SANDBOX_PYTHON to another interpreter)"
            )
        self._checked = True

    def run_harness(self, request: bytes) -> JailResult:
        """Run the test harness (sandbox_harness.py) on a JSON request, in a fresh jail."""
        self.check()
        return self.run([self.python, "-I", "-S", HARNESS_INSIDE], stdin=request)


def _read_capped(handle) -> str:
    handle.seek(0)
    return handle.read(MAX_OUTPUT_BYTES).decode("utf-8", errors="replace")
