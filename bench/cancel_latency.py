"""How long an RL run takes to stop once cancellation is requested mid-step.

Runs the default RL config (the built-in tiny model on tic-tac-toe: 32 rollouts of up to
10 turns, 128 tokens a reply, micro-batches of 8) on the CPU with a sink whose
`should_stop()` turns True `--after` seconds into the first step, as the worker's sink
does once a job's cancel_requested is read. Prints the seconds from that moment until
`run_rl` returns, and where the run was (from the sink's log).

    .venv/bin/python bench/cancel_latency.py --after 20
"""

from __future__ import annotations

import argparse
import tempfile
import time

from rlcore.events import RecordingSink
from rlcore.train.config import RLConfig
from rlcore.train.grpo import run_rl


class TimedStopSink(RecordingSink):
    """Says stop from `after` seconds past its first should_stop() call (the first step's
    start) on; `stop_at` is that moment, the cancel request."""

    def __init__(self, after: float) -> None:
        super().__init__()
        self.after = after
        self.first_asked: float | None = None
        self.stop_at: float | None = None

    def should_stop(self) -> bool:
        now = time.monotonic()
        if self.first_asked is None:
            self.first_asked = now
        if now - self.first_asked >= self.after:
            # The request is made at `after`, whether or not the run asks at that moment.
            self.stop_at = self.first_asked + self.after
            return True
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--after", type=float, default=20.0, help="seconds into step 1")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    sink = TimedStopSink(args.after)
    with tempfile.TemporaryDirectory() as work:
        cfg = RLConfig(output_dir=f"{work}/rl", max_steps=3, device=args.device)
        path = run_rl(cfg, sink)
    ended = time.monotonic()
    if sink.stop_at is None:
        print("the run ended before the stop was requested; use a smaller --after")
        return
    print(f"stop requested {args.after:.1f} s into step 1")
    print(f"stopped {ended - sink.stop_at:.1f} s after the request; returned {path!r}")
    print(f"steps finished: {[step for step, _ in sink.metrics]}")
    for step, values in sink.metrics:
        print(
            f"  step {step}: {values['perf/step_seconds']:.1f} s (rollouts "
            f"{values['perf/rollout_seconds']:.1f} s, training {values['perf/train_seconds']:.1f} s)"
        )
    for level, message in sink.logs:
        print(f"  [{level}] {message}")


if __name__ == "__main__":
    main()
