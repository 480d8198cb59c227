"""The `python -m rlcore` command line, in the habits of verifiers' `vf-eval`.

`audit ENV` runs the verifier checklist (rlcore/audit.py) and writes its JSON report;
`delta ENV --base A --trained B` compares two models on held-out examples (rlcore/delta.py).
`eval ENV --model MODEL` runs an evaluation with a progress bar on stderr, prints the
summary tables to stdout and writes results.jsonl + metadata.json under
`runs/eval/<env>--<model>--<timestamp>/`; `envs` lists the environments and their typed
parameters; `serve`, `synth`, `sft` and `rl` hand their arguments to `rlcore.serve` and
`rlcore.train.cli`, imported only when asked for so `eval` never pays for them. Mistakes
in what the user typed (bad JSON, unknown env or parameter, bad model path, unreachable
endpoint) end with exit code 2 and one line naming the bad value and what is accepted.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from datetime import datetime
from pathlib import Path

from rlcore.envs import list_environments
from rlcore.evaluate import EvalConfig, EvalConfigError, format_summary, run_eval
from rlcore.events import ConsoleSink
from rlcore.policy import PolicyError

PROG = "python -m rlcore"
DEFAULT_EVAL_ROOT = Path("runs") / "eval"
DEFAULT_AUDIT_ROOT = Path("runs") / "audit"
# The datasets training draws from start at seed 0 and count up; this one is far from them.
HELD_OUT_SEED = 1_000_003
TRAIN_COMMANDS = ("synth", "sft", "rl")

USAGE_ERROR = 2


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line (plus exit 2), not the whole usage block."""

    def error(self, message: str) -> None:
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message} (see --help)\n")


class _EvalConsoleSink(ConsoleSink):
    """Shows the running reward mean and outcome rates on the progress bar itself instead
    of printing a log line for every report."""

    def metric(self, step: int, values: dict[str, float]) -> None:
        if self._bar is None:
            return
        shown = {"reward": f"{values.get('reward/mean', 0.0):.3g}"}
        for name, value in values.items():
            if name.startswith("outcome/"):
                shown[name.removeprefix("outcome/")] = f"{100 * value:.0f}%"
        self._bar.set_postfix(shown, refresh=False)


def _bounded(kind: type, low: float, high: float | None = None, *, low_inclusive=True):
    """An argparse type that converts to `kind` and checks the range, naming both."""

    def convert(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {'an integer' if kind is int else 'a number'}, got {text!r}"
            ) from None
        too_low = value < low if low_inclusive else value <= low
        if too_low or (high is not None and value > high):
            bound = f">= {low}" if low_inclusive else f"> {low}"
            accepted = f"{bound} and <= {high}" if high is not None else bound
            raise argparse.ArgumentTypeError(f"expected a value {accepted}, got {text!r}")
        return value

    return convert


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="RL environments for small language models.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    ev = commands.add_parser("eval", help="evaluate a model on an environment")
    ev.add_argument("env", metavar="ENV", help="environment name (see `envs`)")
    ev.add_argument(
        "--model",
        "-m",
        required=True,
        help="tiny, tiny-bpe, tiny-bpe-3l, tiny-master, a checkpoint dir or hub id, an env "
        "built-in (oracle, random, constant), or the served model name with --base-url",
    )
    ev.add_argument("-n", "--num-examples", type=_bounded(int, 1), default=10)
    ev.add_argument("-r", "--rollouts-per-example", type=_bounded(int, 1), default=1)
    ev.add_argument(
        "-a",
        "--env-args",
        default="{}",
        metavar="JSON",
        help="environment parameters as a JSON object, e.g. '{\"max_turns\": 6}'",
    )
    ev.add_argument("-t", "--max-tokens", type=_bounded(int, 1), default=256)
    ev.add_argument("-T", "--temperature", type=_bounded(float, 0.0), default=0.7)
    ev.add_argument("--top-p", type=_bounded(float, 0.0, 1.0, low_inclusive=False), default=1.0)
    ev.add_argument(
        "-c", "--concurrency", type=_bounded(int, 1), default=32, help="rollouts in flight"
    )
    ev.add_argument("--base-url", help="OpenAI-compatible endpoint, e.g. http://host:8000/v1")
    ev.add_argument(
        "--api-key-env",
        default="OPENAI_API_KEY",
        metavar="VAR",
        help="environment variable holding the API key",
    )
    ev.add_argument("--seed", type=int, default=0, help="dataset seed")
    ev.add_argument(
        "--out",
        metavar="DIR",
        help=f"output directory (default {DEFAULT_EVAL_ROOT}/<env>--<model>--<timestamp>)",
    )
    ev.add_argument(
        "--baselines",
        action="store_true",
        help="also run the env's random, oracle and constant players on the same examples",
    )
    ev.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")

    au = commands.add_parser(
        "audit", help="check an environment's verifier: exploits, format brittleness, throughput"
    )
    au.add_argument("env", metavar="ENV", help="environment name (see `envs`)")
    au.add_argument("-a", "--env-args", default="{}", metavar="JSON", help="env parameters")
    au.add_argument("-n", "--num-examples", type=_bounded(int, 1, 1000), default=16)
    au.add_argument("--seed", type=int, default=0, help="dataset seed")
    au.add_argument(
        "--rollouts-per-step",
        type=_bounded(int, 1),
        default=64,
        help="rollouts an RL step verifies (examples x rollouts per example)",
    )
    au.add_argument(
        "--step-seconds",
        type=_bounded(float, 0.0, low_inclusive=False),
        help="seconds an RL step takes without verification, to compare against",
    )
    au.add_argument(
        "--out",
        metavar="FILE",
        help=f"JSON report path (default {DEFAULT_AUDIT_ROOT}/<env>--<timestamp>.json)",
    )

    de = commands.add_parser(
        "delta", help="held-out delta: a trained model against its starting model, per metric"
    )
    de.add_argument("env", metavar="ENV", help="environment name (see `envs`)")
    de.add_argument("--base", required=True, metavar="MODEL", help="the starting model")
    de.add_argument("--trained", required=True, metavar="MODEL", help="the trained model")
    de.add_argument("-a", "--env-args", default="{}", metavar="JSON", help="env parameters")
    de.add_argument("-n", "--num-examples", type=_bounded(int, 2), default=100)
    de.add_argument("-r", "--rollouts-per-example", type=_bounded(int, 1), default=1)
    de.add_argument(
        "--seed",
        type=int,
        default=HELD_OUT_SEED,
        help=f"dataset seed; pick one training did not use (default {HELD_OUT_SEED})",
    )
    de.add_argument("-t", "--max-tokens", type=_bounded(int, 1), default=256)
    de.add_argument("-T", "--temperature", type=_bounded(float, 0.0), default=0.0)
    de.add_argument("--base-url", help="OpenAI-compatible endpoint serving both models")
    de.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    de.add_argument("--out", metavar="FILE", help="also write the report as JSON here")

    commands.add_parser("envs", help="list environments and their parameters")
    commands.add_parser("serve", help="OpenAI-compatible server for a checkpoint", add_help=False)
    for kind in TRAIN_COMMANDS:
        commands.add_parser(
            kind, help=f"{kind} job from --config FILE [key=value ...]", add_help=False
        )
    return parser


def model_slug(model: str) -> str:
    """A file-name-safe short form of a model string (paths and hub ids included)."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", model).strip("-.")
    return slug[-60:] or "model"


def default_out_dir(env: str, model: str, root: Path = DEFAULT_EVAL_ROOT) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    base = root / f"{env}--{model_slug(model)}--{stamp}"
    out, attempt = base, 1
    while out.exists():  # two runs in the same second must not share a directory
        attempt += 1
        out = base.with_name(f"{base.name}-{attempt}")
    return out


def _parse_env_args(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise EvalConfigError(
            f"-a/--env-args is not valid JSON ({exc.msg} at column {exc.colno}): {text!r}; "
            "accepted: a JSON object such as '{\"max_turns\": 6}'"
        ) from None
    if not isinstance(value, dict):
        raise EvalConfigError(
            f"-a/--env-args must be a JSON object of parameters, got {text!r}; "
            "accepted: a JSON object such as '{\"max_turns\": 6}'"
        )
    return value


def _fail(command: str, message: str) -> int:
    print(f"{PROG} {command}: error: {message}", file=sys.stderr)
    return USAGE_ERROR


def cmd_eval(args: argparse.Namespace) -> int:
    try:
        env_args = _parse_env_args(args.env_args)
    except EvalConfigError as exc:
        return _fail("eval", str(exc))
    out_dir = Path(args.out) if args.out else default_out_dir(args.env, args.model)
    cfg = EvalConfig(
        env=args.env,
        model=args.model,
        env_args=env_args,
        num_examples=args.num_examples,
        rollouts_per_example=args.rollouts_per_example,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        concurrency=args.concurrency,
        base_url=args.base_url,
        api_key_env=args.api_key_env,
        seed=args.seed,
        out_dir=str(out_dir),
        baselines=args.baselines,
        device=args.device,
    )
    sink = _EvalConsoleSink()
    try:
        result = run_eval(cfg, sink)
    except (EvalConfigError, PolicyError) as exc:
        return _fail("eval", str(exc))
    finally:
        sink.close()
    print(format_summary(result.summary, result.baselines or None))
    print(f"\nresults: {out_dir / 'results.jsonl'}\nmetadata: {out_dir / 'metadata.json'}")
    failed = [r for r in result.rollouts if r.error]
    if result.rollouts and len(failed) == len(result.rollouts):
        first = failed[0].error.strip().splitlines()[0]
        print(f"{PROG} eval: every rollout failed; the first said: {first}", file=sys.stderr)
        return 1
    return 0


def _env_from_args(args: argparse.Namespace):
    """The environment ENV with -a's parameters; EvalConfigError naming what was wrong."""
    from rlcore.envs import ParamError, load_environment

    env_args = _parse_env_args(args.env_args)
    try:
        return load_environment(args.env, **env_args)
    except KeyError as exc:
        raise EvalConfigError(str(exc.args[0])) from None
    except ParamError as exc:
        raise EvalConfigError(f"bad environment parameters: {exc}") from None


def cmd_audit(args: argparse.Namespace) -> int:
    import asyncio

    from rlcore.audit import format_report, run_audit, timestamp

    try:
        env = _env_from_args(args)
    except EvalConfigError as exc:
        return _fail("audit", str(exc))
    report = asyncio.run(
        run_audit(
            env,
            env_name=args.env,
            num_examples=args.num_examples,
            seed=args.seed,
            rollouts_per_step=args.rollouts_per_step,
            step_seconds=args.step_seconds,
        )
    )
    out = Path(args.out) if args.out else DEFAULT_AUDIT_ROOT / f"{args.env}--{timestamp()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report.to_dict(), indent=2))
    print(format_report(report))
    print(f"\nreport: {out}")
    return 0 if report.passed else 1


def cmd_delta(args: argparse.Namespace) -> int:
    import asyncio

    from rlcore.delta import format_delta, held_out_delta
    from rlcore.policy import load_policy
    from rlcore.types import SamplingParams

    try:
        env = _env_from_args(args)
        base, trained = (
            load_policy(model, env=env, base_url=args.base_url, device=args.device)
            for model in (args.base, args.trained)
        )
    except (EvalConfigError, PolicyError) as exc:
        return _fail("delta", str(exc))

    async def both() -> object:
        try:
            return await held_out_delta(
                env,
                base,
                trained,
                env_name=args.env,
                base_name=args.base,
                trained_name=args.trained,
                num_examples=args.num_examples,
                seed=args.seed,
                rollouts_per_example=args.rollouts_per_example,
                sampling=SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens),
            )
        finally:
            await base.aclose()
            await trained.aclose()

    try:
        report = asyncio.run(both())
    except PolicyError as exc:
        return _fail("delta", str(exc))
    print(format_delta(report))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report.to_dict(), indent=2))
        print(f"\nreport: {args.out}")
    return 0


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def _param_range(param: dict) -> str:
    if param["choices"]:
        return "|".join(str(c) for c in param["choices"])
    low, high = param["min"], param["max"]
    if low is not None and high is not None:
        return f"{_number(low)}..{_number(high)}"
    if low is not None:
        return f">= {_number(low)}"
    if high is not None:
        return f"<= {_number(high)}"
    return "any"


def cmd_envs() -> int:
    blocks = []
    for info in list_environments():
        lines = [f"{info.name}: {info.description}"]
        rows = [["name", "type", "default", "range", "help"]]
        rows += [
            [p["name"], p["type"], json.dumps(p["default"]), _param_range(p), p["help"]]
            for p in info.params
        ]
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        for row in rows:
            cells = [cell.ljust(width) for cell, width in zip(row[:4], widths, strict=True)]
            lines.append("  " + "  ".join([*cells, row[4]]))
        blocks.append("\n".join(lines))
    print("\n\n".join(blocks))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Delegated commands parse their own arguments, so they are dispatched before ours.
    if argv and argv[0] == "serve":
        from rlcore.serve import main as serve_main

        return serve_main(argv[1:], prog="python -m rlcore serve") or 0
    if argv and argv[0] in TRAIN_COMMANDS:
        from rlcore.train.cli import main as train_main

        return train_main(argv[0], argv[1:]) or 0

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "eval":
        try:
            return cmd_eval(args)
        except KeyboardInterrupt:
            print(f"{PROG} eval: interrupted", file=sys.stderr)
            return 130
    if args.command == "delta":
        return cmd_delta(args)
    if args.command == "audit":
        return cmd_audit(args)
    if args.command == "envs":
        return cmd_envs()
    parser.print_help(sys.stderr)
    return USAGE_ERROR
