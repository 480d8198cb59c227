"""Held-out delta: did training help, beyond noise? `python -m rlcore delta ENV --base A
--trained B`.

Both models play the same held-out examples (a seed training did not use), and each
metric is compared example by example: the reward, every reward function, and every
outcome rate. Pairing removes the spread between easy and hard examples from the
comparison, so a small difference can be told from noise with few examples. The mean
of the per-example differences is reported with a 95 % interval (Student's t): "higher"
when the interval lies wholly above zero, "lower" wholly below, otherwise "no clear
difference" (whether higher is better depends on the metric: not for outcome/loss). The
answer to "did training help?" is the reward's.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from statistics import mean, stdev

from rlcore.envs.base import Environment
from rlcore.events import EventSink, NullSink
from rlcore.policy.base import Policy
from rlcore.rollout import run_rollouts
from rlcore.types import Rollout, SamplingParams

# Two-sided 95 % quantiles of Student's t by degrees of freedom; 1.96 beyond the table.
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
        9: 2.262, 10: 2.228, 12: 2.179, 15: 2.131, 20: 2.086, 25: 2.060, 30: 2.042,
        40: 2.021, 60: 2.000, 120: 1.980}  # fmt: skip


def t95(degrees: int) -> float:
    """The 95 % two-sided t quantile, from the largest tabled df not above `degrees`
    (a slightly wider interval where the exact df is not tabled)."""
    if degrees > 120:
        return 1.96
    return _T95[max(df for df in _T95 if df <= degrees)]


@dataclass
class MetricDelta:
    name: str
    base: float
    trained: float
    delta: float
    low: float
    high: float
    verdict: str  # higher | lower | no clear difference


@dataclass
class DeltaReport:
    env: str
    base: str
    trained: str
    num_examples: int
    rollouts_per_example: int
    seed: int
    metrics: list[MetricDelta] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def per_example(rollouts: list[Rollout], env: Environment) -> dict[int, dict[str, float]]:
    """Each example's metrics, averaged over its rollouts: reward, reward/<fn>, outcome/<label>."""
    grouped: dict[int, list[Rollout]] = {}
    for rollout in rollouts:
        grouped.setdefault(rollout.example_id, []).append(rollout)
    labels = set(env.outcome_labels) | {r.outcome for r in rollouts if r.outcome}
    table = {}
    for example_id, members in grouped.items():
        values = {"reward": mean(r.reward for r in members)}
        for name in env.rubric.names:
            values[f"reward/{name}"] = mean(r.rewards.get(name, 0.0) for r in members)
        for label in labels:
            values[f"outcome/{label}"] = mean(float(r.outcome == label) for r in members)
        table[example_id] = values
    return table


def paired_delta(name: str, base: list[float], trained: list[float]) -> MetricDelta:
    differences = [t - b for b, t in zip(base, trained, strict=True)]
    center = mean(differences)
    if len(differences) > 1:
        half = t95(len(differences) - 1) * stdev(differences) / math.sqrt(len(differences))
    else:
        half = math.inf
    low, high = center - half, center + half
    verdict = "higher" if low > 0 else "lower" if high < 0 else "no clear difference"
    return MetricDelta(name, mean(base), mean(trained), center, low, high, verdict)


async def held_out_delta(
    env: Environment,
    base: Policy,
    trained: Policy,
    *,
    env_name: str,
    base_name: str,
    trained_name: str,
    num_examples: int,
    seed: int,
    rollouts_per_example: int = 1,
    sampling: SamplingParams | None = None,
    concurrency: int = 32,
    sink: EventSink | None = None,
) -> DeltaReport:
    """Both policies on the same examples; `sink` hears progress, one rollout at a time."""
    sink = sink or NullSink()
    examples = env.examples(num_examples, seed=seed)
    sampling = sampling or SamplingParams()
    total = 2 * len(examples) * rollouts_per_example
    done = 0

    def played(rollout: Rollout) -> None:
        nonlocal done
        done += 1
        sink.progress(done, total, "base" if done <= total // 2 else "trained")

    tables = []
    for policy in (base, trained):
        rollouts = await run_rollouts(
            env,
            policy,
            examples,
            sampling=sampling,
            rollouts_per_example=rollouts_per_example,
            concurrency=concurrency,
            on_result=played,
        )
        tables.append(per_example(rollouts, env))
    base_table, trained_table = tables
    shared = sorted(set(base_table) & set(trained_table))
    names = sorted({k for row in base_table.values() for k in row})
    names.remove("reward")
    report = DeltaReport(env_name, base_name, trained_name, len(shared), rollouts_per_example, seed)
    for name in ["reward", *names]:
        report.metrics.append(
            paired_delta(
                name,
                [base_table[i].get(name, 0.0) for i in shared],
                [trained_table[i].get(name, 0.0) for i in shared],
            )
        )
    return report


def format_delta(report: DeltaReport) -> str:
    lines = [
        f"held-out delta on {report.env}: {report.trained} against {report.base}, "
        f"{report.num_examples} examples x {report.rollouts_per_example} (seed {report.seed})",
        "",
        f"{'metric':<24} {'base':>8} {'trained':>8} {'delta':>8}  95% interval        verdict",
    ]
    reward = report.metrics[0]
    answer = {"higher": "yes", "lower": "no, it hurt"}.get(reward.verdict, "not beyond noise")
    lines.insert(
        1,
        f"did training help? {answer}: reward {reward.delta:+.3f} "
        f"[{reward.low:+.3f}, {reward.high:+.3f}]",
    )
    for m in report.metrics:
        interval = f"[{m.low:+.3f}, {m.high:+.3f}]"
        lines.append(
            f"{m.name:<24} {m.base:8.3f} {m.trained:8.3f} {m.delta:+8.3f}  {interval:<19} "
            f"{m.verdict}"
        )
    return "\n".join(lines)
