"""Evaluation: run a policy on an environment's examples and summarize how it did.

`run_eval(cfg, sink)` loads the environment and the policy named in an `EvalConfig`, plays
`num_examples x rollouts_per_example` rollouts concurrently, streams running means and new
rollouts to the event sink while it goes (so a web page can plot the eval live), honours
cooperative cancellation, optionally replays the same examples with the environment's
built-in baselines (random-valid, oracle, constant string), and writes `results.jsonl` plus
`metadata.json`. `summarize` turns rollouts into JSON-able statistics (per-function means,
outcome rates with Wilson intervals, breakdowns, tokens, timing, a reward histogram) and
`format_summary` renders them as the CLI report.
"""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import rlcore
from rlcore.envs import Environment, ParamError, load_environment
from rlcore.events import EventSink, NullSink
from rlcore.policy import Policy, PolicyError, load_policy
from rlcore.rollout import run_rollouts
from rlcore.types import Example, Rollout, SamplingParams, jsonl_line

# z for a two-sided 95% interval
WILSON_Z = 1.959963984540054

# The built-in players a --baselines run compares against, in table order.
BASELINE_NAMES = ("random", "oracle", "constant")

HISTOGRAM_BINS = 10


class EvalConfigError(ValueError):
    """The eval config names an unknown environment or gives it bad parameters."""


@dataclass(kw_only=True)
class EvalConfig:
    """Everything one evaluation run needs; stored whole in `metadata.json`."""

    env: str
    """Registered environment name (see `python -m rlcore envs`)."""
    model: str
    """`tiny`, `tiny-bpe`, `tiny-master`, a checkpoint directory or hub id, an env built-in
    (`oracle`, `random`, `constant`), or a served model name when `base_url` is set."""
    env_args: dict = field(default_factory=dict)
    """Environment parameters; validated against the env's schema, defaults filled in."""
    num_examples: int = 10
    """How many dataset examples to evaluate (CLI `-n`)."""
    rollouts_per_example: int = 1
    """Independent rollouts of each example (CLI `-r`)."""
    max_tokens: int = 256
    """Cap on tokens per model reply (CLI `-t`)."""
    temperature: float = 0.7
    """Sampling temperature (CLI `-T`)."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    concurrency: int = 32
    """Most rollouts in flight at once (CLI `-c`)."""
    base_url: str | None = None
    """OpenAI-compatible endpoint; when set, `model` is the served model's name."""
    api_key_env: str = "OPENAI_API_KEY"
    """Name of the environment variable holding the endpoint's API key (never the key)."""
    seed: int = 0
    """Dataset seed: the same seed gives the same examples."""
    out_dir: str | None = None
    """Where results.jsonl and metadata.json go; None writes nothing."""
    baselines: bool = False
    """Also run the env's built-in random / oracle / constant players on the same examples."""
    device: str = "auto"
    """Torch device for local models: auto, cpu, cuda, cuda:N."""

    def to_dict(self) -> dict:
        return asdict(self)

    def check(self) -> None:
        """EvalConfigError naming every out-of-range field (the web form and TOML files
        reach run_eval without the CLI's argument checks)."""
        problems = []
        for name in ("num_examples", "rollouts_per_example", "max_tokens", "concurrency"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(f"{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.temperature, int | float) or self.temperature < 0:
            problems.append(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, int | float) or not 0 < self.top_p <= 1:
            problems.append(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if problems:
            raise EvalConfigError("; ".join(problems))

    def sampling(self) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature, top_p=self.top_p, max_tokens=self.max_tokens
        )


@dataclass
class EvalResult:
    """What `run_eval` returns: the model's rollouts, its summary and the baselines'."""

    rollouts: list[Rollout]
    summary: dict
    out_dir: str | None
    baselines: dict[str, dict] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------
# Statistics


def wilson_interval(successes: int, total: int, z: float = WILSON_Z) -> tuple[float, float]:
    """The Wilson score interval for a binomial rate; (0, 1) when there is no data.

    Unlike the normal approximation it stays inside [0, 1] and is not zero-width at 0 or
    n successes, which matters for "0 losses in 200 games".
    """
    if total <= 0:
        return 0.0, 1.0
    rate = successes / total
    denominator = 1 + z * z / total
    center = (rate + z * z / (2 * total)) / denominator
    half_width = z * math.sqrt(rate * (1 - rate) / total + z * z / (4 * total * total))
    half_width /= denominator
    # at 0 or n successes the bound is exactly 0 or 1; rounding would leave 1e-18 behind
    low = 0.0 if successes == 0 else max(0.0, center - half_width)
    high = 1.0 if successes == total else min(1.0, center + half_width)
    return low, high


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else 0.0


def _std(values: list[float]) -> float:
    """Population standard deviation, matching numpy's default (ddof=0)."""
    return statistics.pstdev(values) if len(values) > 1 else 0.0


def _rate(count: int, total: int) -> dict:
    low, high = wilson_interval(count, total)
    return {
        "count": count,
        "rate": count / total if total else 0.0,
        "ci95": [low, high],
    }


def _outcome_labels(env: Environment, outcomes: list[str | None]) -> list[str]:
    """The env's declared labels first (always reported, even at zero), then any others seen."""
    declared = list(env.outcome_labels)
    seen = sorted({o for o in outcomes if o is not None} - set(declared))
    return declared + seen


def _outcome_rates(outcomes: list[str | None], labels: list[str]) -> dict[str, dict]:
    counts = Counter(outcomes)
    return {label: _rate(counts[label], len(outcomes)) for label in labels}


@dataclass
class RolloutFigures:
    """The numbers a rollout adds to its batch's statistics (`figures_summary`): a few
    hundred bytes where the rollout is kilobytes, so a data-parallel rank sends rank 0 its
    rollouts' figures and rank 0 reads the whole batch's metrics from them."""

    reward: float
    rewards: dict[str, float]
    outcome: str | None
    env_metrics: dict[str, float]  # the env's `rollout_metrics`, under "<env>/<name>"
    truncated: bool
    prompt_tokens: int
    completion_tokens: int
    error: str | None


def rollout_figures(env: Environment, rollout: Rollout) -> RolloutFigures:
    return RolloutFigures(
        reward=rollout.reward,
        rewards=dict(rollout.rewards),
        outcome=rollout.outcome,
        env_metrics={
            f"{env.name}/{key}": float(value) for key, value in env.rollout_metrics(rollout).items()
        },
        truncated=rollout.truncated,
        prompt_tokens=rollout.prompt_tokens,
        completion_tokens=rollout.completion_tokens,
        error=rollout.error,
    )


def figures_summary(env: Environment, figures: list[RolloutFigures]) -> dict:
    """The part of `summarize` that rollouts' figures give: rewards, each reward function,
    outcome rates, the env's metrics, truncation and tokens (what `summary_metrics` reads)."""
    total = len(figures)
    rewards = [f.reward for f in figures]
    outcomes = [f.outcome for f in figures]
    env_metric_values: dict[str, list[float]] = {}
    for figure in figures:
        for name, value in figure.env_metrics.items():
            env_metric_values.setdefault(name, []).append(value)
    prompt_tokens = sum(f.prompt_tokens for f in figures)
    completion_tokens = sum(f.completion_tokens for f in figures)
    return {
        "env": env.name,
        "num_rollouts": total,
        "errors": sum(1 for f in figures if f.error),
        "reward": {
            "mean": _mean(rewards),
            "std": _std(rewards),
            "min": min(rewards) if rewards else 0.0,
            "max": max(rewards) if rewards else 0.0,
        },
        "functions": {
            name: {
                "weight": weight,
                "mean": _mean([f.rewards.get(name, 0.0) for f in figures]),
                "std": _std([f.rewards.get(name, 0.0) for f in figures]),
            }
            for name, weight in env.rubric.weights.items()
        },
        "outcomes": _outcome_rates(outcomes, _outcome_labels(env, outcomes)),
        "env_metrics": {name: _mean(values) for name, values in sorted(env_metric_values.items())},
        "truncated_rate": _mean([float(f.truncated) for f in figures]),
        "tokens": {
            "prompt_total": prompt_tokens,
            "completion_total": completion_tokens,
            "prompt_per_rollout": prompt_tokens / total if total else 0.0,
            "completion_per_rollout": completion_tokens / total if total else 0.0,
        },
    }


def reward_histogram(rewards: list[float], bins: int = HISTOGRAM_BINS) -> dict:
    """Equal-width bins over [min, max]; `edges` has one more entry than `counts`.

    The last bin includes its upper edge. When every reward is equal there is one bin.
    """
    if not rewards:
        return {"edges": [], "counts": []}
    low, high = min(rewards), max(rewards)
    if low == high:
        return {"edges": [low, high], "counts": [len(rewards)]}
    width = (high - low) / bins
    edges = [low + i * width for i in range(bins)] + [high]
    counts = [0] * bins
    for value in rewards:
        counts[min(bins - 1, int((value - low) / width))] += 1
    return {"edges": edges, "counts": counts}


def summarize(env: Environment, rollouts: list[Rollout], seconds: float) -> dict:
    """JSON-able statistics of a set of rollouts of `env` that took `seconds` of wall time."""
    summary = figures_summary(env, [rollout_figures(env, r) for r in rollouts])
    labels = list(summary["outcomes"])
    total = len(rollouts)
    rewards = [r.reward for r in rollouts]

    breakdowns: dict[str, dict[str, dict]] = {}
    split: dict[str, dict[str, list[Rollout]]] = {}
    for rollout in rollouts:
        for key, value in env.breakdowns(rollout).items():
            split.setdefault(key, {}).setdefault(str(value), []).append(rollout)
    for key, by_value in sorted(split.items()):
        breakdowns[key] = {
            value: {
                "count": len(members),
                "reward_mean": _mean([r.reward for r in members]),
                "outcomes": _outcome_rates([r.outcome for r in members], labels),
            }
            for value, members in sorted(by_value.items())
        }
    return summary | {
        "breakdowns": breakdowns,
        "turns_per_rollout": _mean([float(r.num_turns) for r in rollouts]),
        "timing": {
            "seconds": seconds,
            "rollouts_per_s": total / seconds if seconds > 0 else 0.0,
            "mean_rollout_seconds": _mean([r.seconds for r in rollouts]),
        },
        "histogram": reward_histogram(rewards),
    }


def summary_metrics(summary: dict) -> dict[str, float]:
    """A summary as flat, namespaced metrics: the names the sink, database and charts use."""
    values = {"reward/mean": summary["reward"]["mean"], "reward/std": summary["reward"]["std"]}
    for name, stats in summary["functions"].items():
        values[f"reward/{name}"] = stats["mean"]
    for label, stats in summary["outcomes"].items():
        values[f"outcome/{label}"] = stats["rate"]
    values.update(summary["env_metrics"])
    values["length/completion_tokens"] = summary["tokens"]["completion_per_rollout"]
    values["length/truncated_rate"] = summary["truncated_rate"]
    return values


# ---------------------------------------------------------------------------------------
# Text report


def _percent(value: float) -> str:
    return f"{100 * value:5.1f}%"


def _interval(ci: list[float]) -> str:
    return f"[{100 * ci[0]:.1f}%, {100 * ci[1]:.1f}%]"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    """Left-aligned first column, right-aligned others, widths from the content."""
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    lines = []
    for row in [header, *rows]:
        cells = [str(row[0]).ljust(widths[0])]
        cells += [str(cell).rjust(width) for cell, width in zip(row[1:], widths[1:], strict=True)]
        lines.append("  ".join(cells).rstrip())
    return lines


def _histogram_lines(histogram: dict, width: int = 40) -> list[str]:
    counts, edges = histogram["counts"], histogram["edges"]
    if not counts:
        return ["  (no rollouts)"]
    peak = max(counts)
    lines = []
    for i, count in enumerate(counts):
        closing = "]" if i == len(counts) - 1 else ")"
        bar = "#" * round(width * count / peak) if peak else ""
        lines.append(f"  [{edges[i]:7.3f}, {edges[i + 1]:7.3f}{closing}  {bar:<{width}}  {count}")
    return lines


def _baseline_lines(summary: dict, baselines: dict[str, dict]) -> list[str]:
    columns = {"model": summary, **baselines}
    metrics = {name: summary_metrics(s) for name, s in columns.items()}
    names = ["reward/mean"] + [f"reward/{fn}" for fn in summary["functions"]]
    names += [f"outcome/{label}" for label in summary["outcomes"]]
    for other in metrics.values():
        names += [n for n in other if n.startswith("outcome/") and n not in names]
    rows = []
    for name in names:
        cells = []
        for column in columns:
            value = metrics[column].get(name)
            if value is None and name.startswith("outcome/") and columns[column]["num_rollouts"]:
                value = 0.0  # a label this player never reached
            if value is None:
                cells.append("-")
            elif name.startswith("outcome/"):
                cells.append(_percent(value).strip())
            else:
                cells.append(f"{value:.3f}")
        rows.append([name, *cells])
    header = ["", *(c if c != "model" else f"model ({summary.get('model', '?')})" for c in columns)]
    lines = ["baselines (same examples, same verifier)", *_table(header, rows)]
    lines += _exploit_warnings(summary, baselines)
    return lines


def _exploit_warnings(summary: dict, baselines: dict[str, dict]) -> list[str]:
    """A loud line when a constant string scores near or above a real player: the
    verifier rewards something that does not depend on the task."""
    if "constant" not in baselines:
        return []
    constant = baselines["constant"]["reward"]["mean"]
    references = (
        [("oracle", baselines["oracle"]["reward"]["mean"])] if "oracle" in baselines else []
    )
    references.append((f"the model ({summary.get('model', '?')})", summary["reward"]["mean"]))
    warnings = []
    for who, reference in references:
        margin = 0.05 * max(1.0, abs(reference))
        if constant >= reference - margin:
            warnings.append(
                f"!!! WARNING: the constant-string baseline scores {constant:.3f}, near or above "
                f"{who} at {reference:.3f}: verifier may be exploitable !!!"
            )
    return warnings


def format_summary(summary: dict, baselines: dict[str, dict] | None = None) -> str:
    """The CLI report of a summary (and, if given, the baselines side by side)."""
    lines = []
    title = f"eval {summary['env']}"
    if summary.get("model"):
        title += f" | model {summary['model']}"
    title += f" | {summary['num_rollouts']} rollouts | {summary['errors']} errors"
    if summary.get("cancelled"):
        title += " | CANCELLED (partial results)"
    lines += [title, ""]

    reward = summary["reward"]
    rows = [
        ["reward (weighted sum)", "", f"{reward['mean']:.3f}", f"{reward['std']:.3f}"]
        + [f"{reward['min']:.3f}", f"{reward['max']:.3f}"]
    ]
    for name, stats in summary["functions"].items():
        rows.append([f"  {name}", f"{stats['weight']:g}", f"{stats['mean']:.3f}"])
        rows[-1] += [f"{stats['std']:.3f}", "", ""]
    lines += _table(["reward", "weight", "mean", "std", "min", "max"], rows)

    if summary["outcomes"]:
        rows = [
            [label, str(stats["count"]), _percent(stats["rate"]), _interval(stats["ci95"])]
            for label, stats in summary["outcomes"].items()
        ]
        lines += ["", *_table(["outcome", "count", "rate", "95% interval"], rows)]

    for key, by_value in summary["breakdowns"].items():
        labels = list(summary["outcomes"])
        rows = []
        for value, stats in by_value.items():
            cells = [f"{key}={value}", str(stats["count"]), f"{stats['reward_mean']:.3f}"]
            for label in labels:
                rate = stats["outcomes"][label]
                cells.append(f"{_percent(rate['rate']).strip()} {_interval(rate['ci95'])}")
            rows.append(cells)
        lines += ["", *_table([f"by {key}", "n", "reward", *labels], rows)]

    if summary["env_metrics"]:
        rows = [[name, f"{value:.4f}"] for name, value in summary["env_metrics"].items()]
        lines += ["", *_table(["env metric", "mean"], rows)]

    tokens, timing = summary["tokens"], summary["timing"]
    lines += [
        "",
        f"truncated {_percent(summary['truncated_rate']).strip()} | "
        f"turns per rollout {summary['turns_per_rollout']:.2f}",
        f"tokens: prompt {tokens['prompt_total']} ({tokens['prompt_per_rollout']:.1f}/rollout), "
        f"completion {tokens['completion_total']} ({tokens['completion_per_rollout']:.1f}/rollout)",
        f"time: {timing['seconds']:.2f} s | {timing['rollouts_per_s']:.2f} rollouts/s | "
        f"{timing['mean_rollout_seconds']:.3f} s mean per rollout",
        "",
        "reward histogram",
        *_histogram_lines(summary["histogram"]),
    ]
    if baselines:
        lines += ["", *_baseline_lines(summary, baselines)]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------
# Running an evaluation


def build_env(cfg: EvalConfig) -> Environment:
    """The configured environment, or EvalConfigError naming what was wrong."""
    if not isinstance(cfg.env_args, dict):
        raise EvalConfigError(
            f"env_args must be a JSON object of parameters, got {type(cfg.env_args).__name__}"
        )
    try:
        return load_environment(cfg.env, **cfg.env_args)
    except KeyError as exc:
        raise EvalConfigError(exc.args[0]) from None
    except ParamError as exc:
        problems = "; ".join(f"{name}: {why}" for name, why in exc.errors.items())
        raise EvalConfigError(
            f"bad parameters for environment {cfg.env!r}: {problems} (see `python -m rlcore envs`)"
        ) from None


async def _check_endpoint(policy: Policy, cfg: EvalConfig) -> None:
    """One tiny request before launching many, so a wrong URL, model name or key fails
    once with a clear message instead of as N identical rollout errors."""
    try:
        await policy.generate(
            [{"role": "user", "content": "Reply with OK."}],
            SamplingParams(temperature=0.0, max_tokens=1),
        )
    except PolicyError:
        raise
    except Exception as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise PolicyError(
            f"the endpoint {cfg.base_url} did not answer for model {cfg.model!r}: {reason}"
        ) from None


class _Reporter:
    """Collects finished rollouts; every `every` of them (and at the end) sends running
    means and the new rollouts to the sink and asks it whether to stop."""

    def __init__(self, env: Environment, sink: EventSink, total: int, desc: str, live: bool):
        self.env, self.sink, self.total, self.desc, self.live = env, sink, total, desc, live
        self.every = max(1, total // 20)
        self.finished: list[Rollout] = []
        self.unreported: list[Rollout] = []
        self.started = time.monotonic()
        self.stop = sink.should_stop()
        self.logged_quarters = 0
        self.warned_context = False

    def on_result(self, rollout: Rollout) -> None:
        if rollout.state.get("context_exceeded") and not self.warned_context:
            self.warned_context = True  # said once, as soon as it happens
            self.sink.log(
                f"{self.desc}: a conversation outgrew the model's context and ended there, "
                f"truncated ({rollout.state['context_exceeded']}); others may follow",
                "warning",
            )
        self.finished.append(rollout)
        self.unreported.append(rollout)
        done = len(self.finished)
        if done % self.every == 0 or done == self.total:
            self.report()
        self.sink.progress(done, self.total, self.desc)

    def report(self) -> None:
        if not self.unreported:
            return
        done = len(self.finished)
        if self.live:
            running = summarize(self.env, self.finished, time.monotonic() - self.started)
            self.sink.metric(done, summary_metrics(running))
            self.sink.rollouts(done, self.unreported)
        quarter = 4 * done // self.total
        if quarter > self.logged_quarters and done < self.total:  # milestones, for the log
            self.logged_quarters = quarter
            rewards = [r.reward for r in self.finished]
            errors = sum(1 for r in self.finished if r.error)
            self.sink.log(
                f"{self.desc}: {done}/{self.total} rollouts ({100 * done // self.total}%), "
                f"reward mean {sum(rewards) / len(rewards):.3f}, {errors} errors, "
                f"{time.monotonic() - self.started:.0f}s"
            )
        self.unreported = []
        if not self.stop and self.sink.should_stop():
            self.stop = True
            self.sink.log(
                f"{self.desc}: stop requested; rollouts in flight end before their next turn "
                "and are left out",
                "warning",
            )


async def _play(
    env: Environment,
    policy: Policy,
    examples: list[Example],
    cfg: EvalConfig,
    sink: EventSink,
    *,
    desc: str,
    live: bool,
) -> tuple[list[Rollout], float, bool]:
    """Rollouts of `policy` on `examples`; returns (rollouts, wall seconds, cancelled)."""
    total = len(examples) * cfg.rollouts_per_example
    reporter = _Reporter(env, sink, total, desc, live)
    # start the clock of a progress bar now, not when the first (maybe slow) rollout ends
    sink.progress(0, total, desc)
    rollouts = await run_rollouts(
        env,
        policy,
        examples,
        sampling=cfg.sampling(),
        rollouts_per_example=cfg.rollouts_per_example,
        concurrency=cfg.concurrency,
        on_result=reporter.on_result,
        should_stop=lambda: reporter.stop,
    )
    reporter.report()
    return rollouts, time.monotonic() - reporter.started, len(rollouts) < total


def _summary_line(summary: dict) -> str:
    """One line of a summary for the log: rollouts, seconds, reward, outcome rates."""
    outcomes = ", ".join(
        f"{label} {100 * row['rate']:.1f}%" for label, row in summary.get("outcomes", {}).items()
    )
    return (
        f"{summary['num_rollouts']} rollouts in {summary['timing']['seconds']:.1f}s, reward mean "
        f"{summary['reward']['mean']:.3f}" + (f"; {outcomes}" if outcomes else "")
    )


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _write_jsonl(path: Path, rollouts: list[Rollout]) -> None:
    with path.open("w", encoding="utf-8") as handle:
        for rollout in rollouts:
            handle.write(jsonl_line(rollout.to_dict()))


async def arun_eval(
    cfg: EvalConfig, sink: EventSink | None = None, policy: Policy | None = None
) -> EvalResult:
    """`run_eval` for callers already inside an event loop."""
    sink = sink or NullSink()
    started_at = _now()
    cfg.check()
    env = build_env(cfg)
    if cfg.out_dir:
        env.output_dir = cfg.out_dir
    owns_policy = policy is None
    if policy is None:
        policy = load_policy(
            cfg.model,
            env=env,
            base_url=cfg.base_url,
            api_key_env=cfg.api_key_env,
            device=cfg.device,
            concurrency=cfg.concurrency,
        )
    try:
        examples = env.examples(cfg.num_examples, seed=cfg.seed)
        if cfg.base_url:
            await _check_endpoint(policy, cfg)
        sink.log(
            f"eval: {cfg.model} on {cfg.env}: {len(examples)} examples x "
            f"{cfg.rollouts_per_example} rollouts, temperature {cfg.temperature}, top_p "
            f"{cfg.top_p}, at most {cfg.max_tokens} tokens a reply, {cfg.concurrency} at once"
        )
        rollouts, seconds, cancelled = await _play(
            env, policy, examples, cfg, sink, desc="eval", live=True
        )
    finally:
        # a policy handed in belongs to the caller (e.g. the RL trainer's live engine)
        if owns_policy:
            await policy.aclose()
    summary = summarize(env, rollouts, seconds)
    summary["model"] = cfg.model
    summary["cancelled"] = cancelled
    sink.log(f"eval: {'cancelled after' if cancelled else 'done:'} {_summary_line(summary)}")

    baselines: dict[str, dict] = {}
    baseline_rollouts: dict[str, list[Rollout]] = {}
    if cfg.baselines and not cancelled:
        builtins = env.builtin_policies()
        for name in (n for n in BASELINE_NAMES if n in builtins):
            baseline = builtins[name]()
            try:
                played, played_seconds, baseline_cancelled = await _play(
                    env, baseline, examples, cfg, sink, desc=f"baseline {name}", live=False
                )
            finally:
                await baseline.aclose()
            baselines[name] = summarize(env, played, played_seconds)
            baselines[name] |= {"model": name, "cancelled": baseline_cancelled}
            sink.log(f"baseline {name}: {_summary_line(baselines[name])}")
            baseline_rollouts[name] = played
            if baseline_cancelled:
                break

    if cfg.out_dir:
        _write_outputs(cfg, env, rollouts, summary, baselines, baseline_rollouts, started_at)
    return EvalResult(rollouts=rollouts, summary=summary, out_dir=cfg.out_dir, baselines=baselines)


def _write_outputs(
    cfg: EvalConfig,
    env: Environment,
    rollouts: list[Rollout],
    summary: dict,
    baselines: dict[str, dict],
    baseline_rollouts: dict[str, list[Rollout]],
    started_at: str,
) -> None:
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_jsonl(out / "results.jsonl", rollouts)
    for name, played in baseline_rollouts.items():
        (out / "baselines").mkdir(exist_ok=True)
        _write_jsonl(out / "baselines" / f"{name}.jsonl", played)
    metadata: dict[str, Any] = {
        "env": cfg.env,
        "env_args": env.config,
        "model": cfg.model,
        "sampling": cfg.sampling().to_dict(),
        "num_examples": cfg.num_examples,
        "rollouts_per_example": cfg.rollouts_per_example,
        "config": cfg.to_dict(),
        "summary": summary,
        "baselines": baselines,
        "started_at": started_at,
        "finished_at": _now(),
        "rlcore_version": rlcore.__version__,
    }
    (out / "metadata.json").write_text(json.dumps(metadata, indent=2, default=str) + "\n")


def run_eval(
    cfg: EvalConfig, sink: EventSink | None = None, policy: Policy | None = None
) -> EvalResult:
    """Evaluate `cfg.model` (or the given `policy`) on `cfg.env`; see the module docstring.

    Raises EvalConfigError for an unknown env or bad env_args and PolicyError for a model
    that cannot be loaded or an endpoint that does not answer. A policy passed in is left
    open; one built here is closed. Use `arun_eval` from inside a running event loop.
    """
    return asyncio.run(arun_eval(cfg, sink, policy))
