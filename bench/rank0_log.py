"""Host milliseconds rank 0 of a data-parallel RL step spends on what the ranks send it for
the step's log, the way the trainer did it before (every rank's rollouts, slim, then the
batch's advantage metrics and summary recomputed from them) against the way it does now
(every rank's rollout figures and advantage sums, and only the rollouts of the log's sample).

    python bench/rank0_log.py [--games 1024] [--processes 4] [--repeats 5] [--log-rollouts 256]

Real games of `tiny-master` (CPU, temperature 1, the mastery recipe's env: two random
opening pairs, 8 games a group), `--games / 4` of them played and repeated to `--games`.
Each side is timed from the bytes rank 0 receives from the other ranks (what
`gather_object` unpickles) to the step's metrics and logged rollouts; rank 0's own share
is in memory. The ranks' own work before sending (slimming; figures) is timed apart: it
runs on every rank at once, rank 0's included (its advantage sums come from its training
step's scoring either way). Both sides must log the same metrics (within float rounding)
and the same rollouts. Writes bench/results/rank0_log.json.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import pickle
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchlib import machine, write_results  # noqa: E402

from rlcore.envs import load_environment  # noqa: E402
from rlcore.evaluate import (  # noqa: E402
    figures_summary,
    rollout_figures,
    summarize,
    summary_metrics,
)
from rlcore.policy.local import LocalEngine  # noqa: E402
from rlcore.rollout import run_rollouts  # noqa: E402
from rlcore.train.common import model_path  # noqa: E402
from rlcore.train.config import RLConfig, build_config  # noqa: E402
from rlcore.train.grpo import add_sums, advantage_metrics, for_log, step_advantages  # noqa: E402
from rlcore.train.sampling import rollout_sample, sample_places  # noqa: E402
from rlcore.types import SamplingParams  # noqa: E402

GROUP = 8


def best_ms(work, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - started)
    return 1000 * best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--games", type=int, default=1024)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--log-rollouts", type=int, default=256)
    parser.add_argument("--out", default=None, help="JSON path")
    args = parser.parse_args()
    if args.games % (4 * GROUP) or args.games // GROUP < args.processes:
        raise SystemExit(f"--games must be a multiple of {4 * GROUP}, a group per process")

    env = load_environment("tictactoe", opening_moves=2, num_groups=4, reasoning="none")
    engine = LocalEngine(str(model_path("tiny-master")), device="cpu")
    played = asyncio.run(
        run_rollouts(
            env,
            engine,
            env.examples(args.games // 4 // GROUP, seed=3),
            sampling=SamplingParams(max_tokens=24, temperature=1.0),
            rollouts_per_example=GROUP,
        )
    )
    batch = [copy.deepcopy(r) for _ in range(4) for r in played]
    cfg = build_config(
        RLConfig,
        [
            (
                "bench",
                dict(
                    model="tiny-master",
                    env="tictactoe",
                    output_dir="runs/bench/rank0_log",
                    batch_size=args.games,
                    rollouts_per_example=GROUP,
                    advantage="tree",
                    turn_reward_weight=1.0,
                ),
            )
        ],
    )
    examples, world, count = args.games // GROUP, args.processes, args.log_rollouts
    shares = [
        [r for e in range(rank, examples, world) for r in batch[e * GROUP : (e + 1) * GROUP]]
        for rank in range(world)
    ]
    # Ranks.sum of the per-move rewards' sum and count: the whole batch's, on every rank.
    verdicts = [[sum(env.turn_rewards(r)), len(r.turns)] for r in batch]
    totals = torch.tensor(verdicts, dtype=torch.float64).sum(dim=0)

    def over_ranks(_mine):
        return totals.clone()

    # What each rank does before it sends (every rank at once), and what it sends.
    def send_before(share):
        return [for_log(r) for r in share]

    # The advantage sums every rank has from its training step's scoring already.
    sums = [step_advantages(env, share, cfg, over_ranks)[1] for share in shares]

    def send_after(rank, share):
        places = sample_places(rank, world, examples, GROUP)
        sampled = [(p, for_log(r)) for p, r in zip(places, share, strict=True) if p < count]
        return [rollout_figures(env, r) for r in share], sampled, sums[rank]

    before_bytes = [pickle.dumps(send_before(share)) for share in shares[1:]]
    after_bytes = [pickle.dumps(send_after(r, share)) for r, share in enumerate(shares) if r]
    mine = send_after(0, shares[0])

    def rank0_before():
        rollouts = list(shares[0]) + [r for b in before_bytes for r in pickle.loads(b)]
        _, sums = step_advantages(env, rollouts, cfg)
        metrics = summary_metrics(summarize(env, rollouts, 1.0)) | advantage_metrics(sums)
        return metrics, rollout_sample(rollouts, GROUP, count)

    def rank0_after():
        parts = [mine] + [pickle.loads(b) for b in after_bytes]
        figures = [f for part in parts for f in part[0]]
        logged = [r for _, r in sorted(p for part in parts for p in part[1])]
        metrics = summary_metrics(figures_summary(env, figures))
        return metrics | advantage_metrics(add_sums([part[2] for part in parts])), logged

    (m_before, l_before), (m_after, l_after) = rank0_before(), rank0_after()
    differ = [k for k in m_before if abs(m_before[k] - m_after.get(k, float("nan"))) > 1e-9]
    if differ or [r.to_dict() for r in l_before] != [r.to_dict() for r in l_after]:
        raise SystemExit(f"the two ways log different steps: metrics {differ}")

    rows = {}
    for name, rank0, send in (
        ("before", rank0_before, lambda: send_before(shares[1])),
        ("after", rank0_after, lambda: send_after(1, shares[1])),
    ):
        received = before_bytes if name == "before" else after_bytes
        rows[name] = {
            "rank0_ms": best_ms(rank0, args.repeats),
            "rank_send_ms": best_ms(send, args.repeats),
            "received_bytes": sum(len(b) for b in received),
        }
    print(
        f"rank 0's log of a step: {args.games} games, {world} processes, "
        f"{count} rollouts logged, {machine()}"
    )
    print(f"{'side':<7} {'rank 0 ms':>10} {'a rank sends ms':>16} {'rank 0 receives':>16}")
    for name, row in rows.items():
        print(
            f"{name:<7} {row['rank0_ms']:>10.1f} {row['rank_send_ms']:>16.1f} "
            f"{row['received_bytes'] / 1e6:>13.2f} MB"
        )
    print(f"before / after (rank 0): {rows['before']['rank0_ms'] / rows['after']['rank0_ms']:.2f}x")
    report = dict(benchmark="rank0_log", machine=machine(), games=args.games, processes=world)
    report |= dict(log_rollouts=count, repeats=args.repeats, rows=rows)
    write_results(report, args.out, "rank0_log.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
