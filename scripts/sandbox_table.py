"""Print the code sandbox's hostile-program table (docs/checklist.md): each program of
tests/test_sandbox.py's HOSTILE table scored by the code env's verifier, one after the
other in this process, then the reference solution.

    PYTHONPATH=$PWD .venv/bin/python scripts/sandbox_table.py
"""

import os
import time
from pathlib import Path

from rlcore.envs.code_env import CodeVerifier
from rlcore.sandbox import Limits
from tests.test_sandbox import HOSTILE, SECRET, TASK, WALL_SECONDS, lab_var_dir


def main() -> None:
    limits = Limits(wall_seconds=WALL_SECONDS, cpu_seconds=int(WALL_SECONDS) + 2)
    verifier = CodeVerifier(limits, parallel_jails=2, test_seconds=1.0)
    secret = lab_var_dir() / "sandbox-secret.txt"
    secret.parent.mkdir(parents=True, exist_ok=True)
    secret.write_text(SECRET)
    outside = Path.cwd() / f"sandbox-pwned-{os.getpid()}"
    print("| hostile program | tests passed | reason the lab gives | seconds |")
    print("|---|---|---|---|")
    for name in sorted(HOSTILE):
        template, _ = HOSTILE[name]
        code = template.format(secret=str(secret), outside=str(outside), worker_pid=os.getpid())
        started = time.monotonic()
        verdict = verifier.verify(TASK, code)
        seconds = time.monotonic() - started
        reason = verdict.reason[:110].replace("|", "/")
        print(f"| {name} | {verdict.passed} of {verdict.total} | {reason} | {seconds:.2f} |")
    verdict = verifier.verify(TASK, TASK.solution)
    print(
        f"| (the reference solution, after all of them) | {verdict.passed} of {verdict.total} "
        f"| {verdict.reason} | |"
    )
    print(f"\nthis process ({os.getpid()}) is alive; written outside the jail: {outside.exists()}")


if __name__ == "__main__":
    main()
