"""rlcore is a plain library: every module of it imports with Django, Celery and Channels
made unimportable, and none of them gets imported along the way."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Runs in a fresh interpreter so nothing the test session imported can leak in.
PROBE = r"""
import importlib
import json
import pkgutil
import sys

BLOCKED = ("django", "celery", "channels", "channels_redis")


class BlockWebStack:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"rlcore must not import {name}")
        return None


sys.meta_path.insert(0, BlockWebStack())

import rlcore

names = ["rlcore", "rlcore.envs", "rlcore.evaluate", "rlcore.cli", "rlcore.policy"]
names += ["rlcore.rollout"]
names += [info.name for info in pkgutil.walk_packages(rlcore.__path__, "rlcore.")]
failures = {}
for name in dict.fromkeys(names):
    try:
        importlib.import_module(name)
    except Exception as exc:
        failures[name] = f"{type(exc).__name__}: {exc}"
leaked = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
print(json.dumps({"imported": sorted(set(names) - set(failures)), "failures": failures,
                  "leaked": leaked}))
"""


def test_every_rlcore_module_imports_without_the_web_stack():
    result = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=REPO,
        env=os.environ | {"PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["failures"] == {}
    assert report["leaked"] == []
    imported = set(report["imported"])
    for name in ("rlcore.envs.tictactoe", "rlcore.evaluate", "rlcore.cli", "rlcore.__main__"):
        assert name in imported
    on_disk = {
        ".".join(path.relative_to(REPO).with_suffix("").parts)
        for path in (REPO / "rlcore").rglob("*.py")
        if path.name != "__init__.py"
    }
    assert on_disk <= imported  # walk_packages found every module file


def test_the_probe_really_blocks_the_web_stack():
    probe = PROBE.split("import rlcore\n")[0] + "import django\n"
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60
    )
    assert result.returncode != 0
    assert "rlcore must not import django" in result.stderr
