"""The README tells a newcomer the truth: its "first ten minutes" commands run as written,
each step on what the step before it made, each within minutes at the speeds it states;
and the number of tests it says `make test` runs is about the number pytest collects."""

from __future__ import annotations

import json
import math
import re
import shlex
import subprocess
import sys
from pathlib import Path

from rlcore import cli
from rlcore.evaluate import EvalConfig, build_env
from rlcore.train import cli as train_cli
from rlcore.train.config import load_config

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def first_ten_minutes() -> dict[str, list[str]]:
    """The arguments after `python -m rlcore COMMAND` of each command in the README's
    "first ten minutes" block, by command."""
    section = README.split("### The first ten minutes", 1)[1]
    block = section.split("```sh\n", 1)[1].split("```", 1)[0]
    commands = {}
    for line in block.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if words[:3] == ["python", "-m", "rlcore"]:
            commands[words[3]] = words[4:]
    return commands


def test_the_first_ten_minutes_run_as_written_each_step_on_the_last_ones_output():
    commands = first_ten_minutes()
    assert list(commands) == ["synth", "sft", "rl", "eval"]
    configs = {}
    for kind in ("synth", "sft", "rl"):
        args = train_cli.build_parser(kind).parse_args(commands[kind])
        configs[kind] = load_config(train_cli.CONFIGS[kind], args.config, args.overrides)
    synth, sft, rl = configs["synth"], configs["sft"], configs["rl"]
    assert Path(sft.dataset) == Path(synth.output_dir) / "dataset.jsonl"
    assert Path(rl.model) == Path(sft.output_dir) / "final"
    evaluation = cli.build_parser().parse_args(["eval", *commands["eval"]])
    assert Path(evaluation.model) == Path(rl.output_dir) / "final"
    env_args = json.loads(evaluation.env_args)
    build_env(EvalConfig(env=evaluation.env, model=evaluation.model, env_args=env_args))
    # At the README's own figures (SFT about 1 s a batch of 16 games, an RL step of 64 games
    # 7-25 s), each training step of the walk-through ends within minutes, even at the slow end.
    stated = re.search(r"SFT runs about 1 s a batch of 16 games and an RL step of 64 games\s+"
                       r"7-25 s", README)  # fmt: skip
    assert stated and sft.batch_size == 16 and rl.batch_size == 64
    sft_batches = sft.max_steps or sft.epochs * math.ceil(synth.max_kept / sft.batch_size)
    assert sft_batches * 1 <= 300 and rl.max_steps * 25 <= 600, (sft_batches, rl.max_steps)


def test_the_readme_says_how_many_tests_make_test_runs():
    stated = re.search(r"`make test` runs about ([\d,]+) tests \((\d+) of them browser tests",
                       README)  # fmt: skip
    assert stated, "the README's Tests section states the count"
    total, browser = int(stated.group(1).replace(",", "")), int(stated.group(2))
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    ids = [line for line in collected.stdout.splitlines() if "::" in line]
    assert ids, collected.stdout[-2000:] + collected.stderr[-2000:]
    # "about": within 5 %, so a test or two more does not make the README wrong.
    assert abs(len(ids) - total) <= 0.05 * total, (len(ids), total)
    assert sum(line.startswith("tests/browser/") for line in ids) == browser
