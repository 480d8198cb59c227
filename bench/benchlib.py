"""What the GPU-speed benchmarks share: writing their results as JSON where they say."""

from __future__ import annotations

import json
import platform
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> str:
    """The host a CPU-side figure was measured on: its architecture and Python."""
    return f"{platform.machine()}, {platform.python_version()}"


def write_results(results: dict, out: str | None, default_name: str) -> dict:
    """`results` as JSON at `out` (default bench/results/`default_name`); says where."""
    path = Path(out) if out else RESULTS / default_name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {path}")
    return results


def recipe_rollouts(loop, env, engine, examples, cfg, concurrency: int) -> list:
    """`examples` rolled out on `loop` as a step of `cfg` rolls them out (its sampling, its
    group size), `concurrency` games at once."""
    from rlcore.rollout import run_rollouts
    from rlcore.types import SamplingParams

    sampling = SamplingParams(
        temperature=cfg.sampling.temperature,
        top_p=cfg.sampling.top_p,
        max_tokens=cfg.sampling.max_tokens,
    )
    return loop.run_until_complete(
        run_rollouts(
            env,
            engine,
            examples,
            sampling=sampling,
            rollouts_per_example=cfg.rollouts_per_example,
            concurrency=concurrency,
        )
    )
