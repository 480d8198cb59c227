"""`python -m rlcore synth|sft|rl --config FILE [key=value ...]`: the training commands.

The config file is TOML (see recipes/), each `key=value` after it overrides one field
(`lr=3e-4`, `env_args.max_turns=6`). Progress shows as a bar on stderr with one metric line
per step; metrics and logged rollouts are also appended to `metrics.jsonl` and
`rollouts.jsonl` in the run's output directory, beside its config.json. The first Ctrl-C
asks the run to stop at the next step boundary (RL and SFT save a checkpoint there); a
second one aborts. Bad configs, datasets or model paths end with exit code 2 and one line
naming the bad value and what is accepted.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

from rlcore.envs.base import ParamError
from rlcore.events import ConsoleSink
from rlcore.policy.base import PolicyError
from rlcore.train.config import (
    ConfigError,
    RLConfig,
    SFTConfig,
    SynthConfig,
    config_schema,
    load_config,
)

PROG = "python -m rlcore"
USAGE_ERROR = 2
CONFIGS = {"synth": SynthConfig, "sft": SFTConfig, "rl": RLConfig}
# The metrics shown on the console line of each step (all of them go to metrics.jsonl).
CONSOLE_METRICS = {
    "synth": None,
    "sft": ["loss/sft", "optim/lr", "optim/grad_norm", "perf/tokens_per_s"],
    "rl": [
        "reward/mean",
        "outcome/win",
        "length/completion_tokens",
        "policy/entropy",
        "loss/policy",
        "optim/grad_norm",
        "perf/step_seconds",
    ],
}


class RunSink(ConsoleSink):
    """The console bar and metric lines, plus metrics.jsonl and rollouts.jsonl on disk."""

    def __init__(self, output_dir: str | Path, metric_keys: list[str] | None) -> None:
        super().__init__(metric_keys=metric_keys)
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.stop_requested = False

    def _append(self, name: str, rows: list[dict]) -> None:
        with (self.output_dir / name).open("a") as out:
            for row in rows:
                out.write(json.dumps(row) + "\n")

    def metric(self, step: int, values: dict[str, float]) -> None:
        self._append("metrics.jsonl", [{"step": step, **values}])
        super().metric(step, values)

    def rollouts(self, step: int, rollouts) -> None:
        self._append("rollouts.jsonl", [{"step": step, **r.to_dict()} for r in rollouts])

    def should_stop(self) -> bool:
        return self.stop_requested


def build_parser(kind: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"{PROG} {kind}",
        description=(CONFIGS[kind].__doc__ or "").split("\n\n")[0],
        epilog="Fields: " + ", ".join(row["name"] for row in config_schema(CONFIGS[kind])),
    )
    parser.add_argument("--config", metavar="FILE", help="TOML config (see recipes/)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="override one field")
    return parser


def _run(kind: str, cfg, sink: RunSink) -> str:
    if kind == "synth":
        from rlcore.train.synth import run_synth

        stats = run_synth(cfg, sink)
        return f"dataset: {stats['path']} ({stats['kept']} kept)\nstats: {stats['stats_path']}"
    if kind == "sft":
        from rlcore.train.sft import run_sft

        return f"final checkpoint: {run_sft(cfg, sink)}"
    from rlcore.train.distributed import run_rl_ranks  # one process unless `processes`

    return f"final checkpoint: {run_rl_ranks(cfg, sink)}"


def main(kind: str, argv: list[str]) -> int:
    if kind not in CONFIGS:
        print(f"{PROG}: unknown command {kind!r}; accepted: {', '.join(CONFIGS)}", file=sys.stderr)
        return USAGE_ERROR
    args = build_parser(kind).parse_args(argv)
    try:
        cfg = load_config(CONFIGS[kind], args.config, args.overrides)
    except ConfigError as exc:
        print(f"{PROG} {kind}: error: {exc}", file=sys.stderr)
        return USAGE_ERROR

    sink = RunSink(cfg.output_dir, CONSOLE_METRICS[kind])

    def request_stop(signum, frame) -> None:
        sink.stop_requested = True
        sink.log("stopping at the next step boundary (Ctrl-C again to abort)", "warning")
        signal.signal(signal.SIGINT, previous_handler)

    previous_handler = signal.signal(signal.SIGINT, request_stop)
    try:
        where = _run(kind, cfg, sink)
    except (ParamError, PolicyError, FileNotFoundError, ValueError) as exc:
        print(f"{PROG} {kind}: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    except KeyboardInterrupt:
        print(f"{PROG} {kind}: aborted", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGINT, previous_handler)
        sink.close()
    print(where)
    print(f"config and metrics: {Path(cfg.output_dir) / 'config.json'}, metrics.jsonl")
    return 0
