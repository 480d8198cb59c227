"""The checklist a verifier passes before RL: `python -m rlcore audit ENV`.

Three checks, each run against the env's own oracle on the same examples:

- Trivial exploits: players that should earn nothing (random text, an empty reply, a
  constant string, the env's own random and constant players, and the exploits the env
  declares in `known_exploits`, e.g. for `code` printing the expected output or calling
  `sys.exit(0)`) must score near the reward's floor. A player that earns more than
  `EXPLOIT_SHARE` of the way from the floor to the oracle fails the check.
- Format brittleness: the oracle's replies rewritten into equivalent forms (a trailing
  newline, CRLF line ends, surrounding spaces, and the env's own `format_variants`, such
  as 1/2 for \\frac{1}{2}) must earn what the oracle earns; every variant that flips a
  reward is reported with how many examples it flipped.
- Throughput: the env's seconds per rollout (its own time: the built-in players answer
  instantly, so this is the verifier) times rollouts per step, spread over the env's
  parallel verifiers, against the step time; a warning when verification would bound it.

The report is printed and written as JSON.
"""

from __future__ import annotations

import random
import string
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from rlcore.envs.base import Environment
from rlcore.events import EventSink, NullSink
from rlcore.policy.base import ConstantPolicy, Policy
from rlcore.rollout import run_rollouts
from rlcore.types import Example, Generation, Rollout, SamplingParams

# An exploit "scores near zero" when it gets less than this share of the way from the
# reward's floor to what the oracle earns.
EXPLOIT_SHARE = 0.1
# Above this share of the step time spent verifying, verification bounds the step.
BOUND_SHARE = 1.0
SAMPLING = SamplingParams(max_tokens=256)


class RandomTextPolicy(Policy):
    """Random printable characters, 1 to 80 of them, seeded: the floor any env must hold."""

    name = "random_text"

    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)

    async def generate(self, messages, sampling, *, tools=None, state=None) -> Generation:
        length = self.rng.randint(1, 80)
        return Generation(text="".join(self.rng.choices(string.printable, k=length)))


class RewritingPolicy(Policy):
    """Another player's replies, each passed through `rewrite` (format variants)."""

    def __init__(self, inner: Policy, rewrite: Callable[[str], str], name: str):
        self.inner = inner
        self.rewrite = rewrite
        self.name = name

    async def generate(self, messages, sampling, *, tools=None, state=None) -> Generation:
        generation = await self.inner.generate(messages, sampling, tools=tools, state=state)
        generation.text = self.rewrite(generation.text or "")
        return generation


GENERIC_VARIANTS: dict[str, Callable[[str], str]] = {
    "trailing newline": lambda text: text + "\n",
    "surrounding spaces": lambda text: f"  {text}  ",
    "CRLF line ends": lambda text: text.replace("\n", "\r\n"),
    "think block first": lambda text: f"<think>Let me answer.</think>\n{text}",
}


@dataclass
class PlayerResult:
    name: str
    mean_reward: float
    rollouts: int
    errors: int
    share_of_oracle: float | None = None  # (mean - floor) / (oracle - floor)
    ok: bool = True
    note: str = ""


@dataclass
class VariantResult:
    name: str
    mean_reward: float
    flipped: int  # examples whose reward differs from the oracle's reply's
    examples: int
    first_flip: str = ""


@dataclass
class AuditReport:
    env: str
    env_args: dict
    num_examples: int
    seed: int
    oracle_mean: float | None
    floor: float
    exploits: list[PlayerResult] = field(default_factory=list)
    variants: list[VariantResult] = field(default_factory=list)
    throughput: dict = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def passed(self) -> bool:
        return not self.warnings


def _mean(rollouts: list[Rollout]) -> float:
    return sum(r.reward for r in rollouts) / len(rollouts) if rollouts else 0.0


async def _play(env: Environment, policy: Policy, examples: list[Example]) -> list[Rollout]:
    try:
        # As many at once as the env verifies at once: a rollout's seconds are then its
        # verification's, not time spent queueing for a verifier.
        return await run_rollouts(
            env, policy, examples, sampling=SAMPLING, concurrency=env.verify_parallelism
        )
    finally:
        await policy.aclose()


def exploit_players(env: Environment) -> dict[str, Callable[[], Policy]]:
    """Every player that must score near the floor, by name."""
    players: dict[str, Callable[[], Policy]] = {
        "random text": RandomTextPolicy,
        "empty reply": lambda: ConstantPolicy("", name="empty"),
    }
    if "constant" in env.builtin_policies():
        players["env's constant"] = env.builtin_policies()["constant"]
    for name, factory in env.known_exploits().items():
        players[f"exploit: {name}"] = factory
    return players


async def run_audit(
    env: Environment,
    *,
    env_name: str,
    num_examples: int = 16,
    seed: int = 0,
    rollouts_per_step: int = 64,
    step_seconds: float | None = None,
    sink: EventSink | None = None,
) -> AuditReport:
    """The checklist on `num_examples` examples; `sink` hears progress, one player at a
    time (the lab's audit page shows it live), and a stop it asks for ends the audit after
    the player in progress, with a warning that the report is partial."""
    sink = sink or NullSink()
    examples = env.examples(num_examples, seed=seed)
    bounds = env.rubric.reward_bounds()
    floor = bounds[0] if bounds else 0.0
    report = AuditReport(
        env=env_name,
        env_args=dict(env.config),
        num_examples=num_examples,
        seed=seed,
        oracle_mean=None,
        floor=floor,
    )
    oracle_factory = env.builtin_policies().get("oracle")
    players = exploit_players(env)
    if "random" in env.builtin_policies():
        players["env's random (baseline)"] = env.builtin_policies()["random"]
    variants = GENERIC_VARIANTS | env.format_variants() if oracle_factory is not None else {}
    total = len(players) + len(variants) + (oracle_factory is not None)
    sink.progress(0, total, "audit")
    oracle_rollouts: list[Rollout] = []
    if oracle_factory is None:
        report.warnings.append(f"{env_name} has no oracle player; exploits are judged by 0")
    else:
        oracle_rollouts = await _play(env, oracle_factory(), examples)
        report.oracle_mean = _mean(oracle_rollouts)
        sink.progress(1, total, "oracle")
    top = report.oracle_mean if report.oracle_mean is not None else floor + 1.0

    for name, factory in players.items():
        if sink.should_stop():
            break
        played = await _play(env, factory(), examples)
        sink.progress(len(report.exploits) + 1 + (oracle_factory is not None), total, name)
        mean = _mean(played)
        share = (mean - floor) / (top - floor) if top > floor else None
        # The env's random player plays the task (random legal moves): a baseline to
        # beat, reported beside the exploits but not one itself.
        judged = not name.endswith("(baseline)")
        ok = not judged or share is None or share < EXPLOIT_SHARE
        note = "" if ok else f"earns {share:.0%} of the oracle's reward above the floor"
        errors = sum(r.error is not None for r in played)
        report.exploits.append(PlayerResult(name, mean, len(played), errors, share, ok, note))
        if not ok:
            report.warnings.append(f"trivial exploit {name!r} {note}")

    if oracle_factory is not None:
        for name, rewrite in variants.items():
            if sink.should_stop():
                break
            played = await _play(env, RewritingPolicy(oracle_factory(), rewrite, name), examples)
            sink.progress(total - len(variants) + len(report.variants) + 1, total, name)
            flips = [
                (o, p)
                for o, p in zip(oracle_rollouts, played, strict=True)
                if abs(o.reward - p.reward) > 1e-9
            ]
            first = ""
            if flips:
                o, p = flips[0]
                first = f"example {p.example_id}: {o.reward:g} -> {p.reward:g}"
                report.warnings.append(
                    f"format variant {name!r} flips the reward on {len(flips)} of "
                    f"{len(played)} examples ({first})"
                )
            report.variants.append(
                VariantResult(name, _mean(played), len(flips), len(played), first)
            )
        report.throughput = _throughput(env, oracle_rollouts, rollouts_per_step, step_seconds)
        if report.throughput.get("bounds_step"):
            report.warnings.append(report.throughput["note"])
    if sink.should_stop():
        checked = len(report.exploits) + len(report.variants) + (oracle_factory is not None)
        report.warnings.append(f"stopped after {checked} of {total} players: a partial report")
    return report


def _throughput(
    env: Environment, rollouts: list[Rollout], rollouts_per_step: int, step_seconds: float | None
) -> dict:
    seconds = [r.seconds for r in rollouts]
    per_rollout = sum(seconds) / len(seconds) if seconds else 0.0
    parallel = env.verify_parallelism
    per_step = per_rollout * rollouts_per_step / parallel
    result = {
        "verify_seconds_per_rollout": per_rollout,
        "rollouts_per_step": rollouts_per_step,
        "parallel_verifiers": parallel,
        "verify_seconds_per_step": per_step,
        "step_seconds": step_seconds,
        "bounds_step": False,
        "note": "",
    }
    if step_seconds is None:
        result["note"] = "no step time given (--step-seconds); not compared"
    elif per_step >= BOUND_SHARE * step_seconds:
        result["bounds_step"] = True
        result["note"] = (
            f"verification would bound the step: {per_step:.2f} s of verifying per step "
            f"({per_rollout:.3f} s x {rollouts_per_step} rollouts / {parallel} in parallel) "
            f"against a {step_seconds:g} s step"
        )
    else:
        result["note"] = f"verification takes {per_step / step_seconds:.0%} of the step time"
    return result


def format_report(report: AuditReport) -> str:
    oracle = "none" if report.oracle_mean is None else f"{report.oracle_mean:.3f}"
    lines = [
        f"audit of {report.env} ({report.num_examples} examples, seed {report.seed}); "
        f"oracle reward {oracle}, floor {report.floor:g}",
        "",
        "trivial exploits (each must score near the floor):",
    ]
    width = max((len(p.name) for p in report.exploits), default=10)
    for player in report.exploits:
        mark = "ok  " if player.ok else "FAIL"
        share = "" if player.share_of_oracle is None else f"  {player.share_of_oracle:6.1%}"
        lines.append(f"  {mark} {player.name.ljust(width)}  {player.mean_reward:7.3f}{share}")
    lines += ["", "format brittleness (equivalent replies must score as the oracle's):"]
    width = max((len(v.name) for v in report.variants), default=10)
    for variant in report.variants:
        mark = "ok   " if not variant.flipped else "FLIPS"
        detail = f"  {variant.flipped}/{variant.examples} flipped" if variant.flipped else ""
        lines.append(f"  {mark} {variant.name.ljust(width)}  {variant.mean_reward:7.3f}{detail}")
    if report.throughput:
        t = report.throughput
        lines += [
            "",
            "throughput:",
            f"  {t['verify_seconds_per_rollout']:.4f} s verifying per rollout x "
            f"{t['rollouts_per_step']} rollouts / {t['parallel_verifiers']} in parallel = "
            f"{t['verify_seconds_per_step']:.2f} s per step",
            f"  {'WARN ' if t['bounds_step'] else ''}{t['note']}",
        ]
    lines += ["", f"{len(report.warnings)} warning(s)" if report.warnings else "all checks passed"]
    lines += [f"  - {warning}" for warning in report.warnings]
    return "\n".join(lines)


def timestamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S")
