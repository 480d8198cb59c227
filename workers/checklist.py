"""The verifier checklist's jobs: an env config's audit and a held-out delta.

Each builds rlcore objects from the job's stored config, runs rlcore's own function
(`rlcore.audit.run_audit`, `rlcore.delta.held_out_delta`) with the job's sink hearing its
progress, writes the JSON report into the job's folder as the CLI does, and returns
(summary, result) for the job row: the report as data (the pages draw it) and as text.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from rlcore.envs import load_environment
from webapp.jobs.models import ApiKey, Job
from webapp.jobs.presenters import did_training_help
from workers.sink import DatabaseSink


def _write_report(job: Job, name: str, report: dict) -> str:
    out = Path(job.config["out_dir"]) / name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    return str(out)


def run_audit_job(job: Job, sink: DatabaseSink) -> tuple[dict, dict]:
    from rlcore.audit import format_report, run_audit

    config = job.config
    env = load_environment(config["env"], **config["env_args"])
    sink.log(f"audit of {config['env']}: {config['num_examples']} examples, seed {config['seed']}")
    report = asyncio.run(
        run_audit(
            env,
            env_name=config["env"],
            num_examples=config["num_examples"],
            seed=config["seed"],
            rollouts_per_step=config["rollouts_per_step"],
            step_seconds=config["step_seconds"],
            sink=sink,
        )
    )
    for warning in report.warnings:
        sink.log(warning, "warning")
    data = report.to_dict()
    path = _write_report(job, "audit.json", data)
    summary = {"passed": report.passed, "warnings": len(report.warnings)}
    return summary, {"audit": data, "report": format_report(report), "path": path}


def run_delta_job(job: Job, sink: DatabaseSink) -> tuple[dict, dict]:
    from rlcore.delta import format_delta, held_out_delta
    from rlcore.policy import load_policy
    from rlcore.types import SamplingParams

    config = job.config
    env = load_environment(config["env"], **config["env_args"])
    policies = []
    for side in ("base", "trained"):
        args = config[side]
        # Whatever the stored config says, a key only goes where staff declared it may.
        ApiKey.check_use(base_url=args.get("base_url"), env_var=args.get("api_key_env"))
        policies.append(
            load_policy(
                args["model"],
                env=env,
                base_url=args.get("base_url"),
                api_key_env=args.get("api_key_env") or "",
                device=config["device"],
            )
        )
    base, trained = policies
    sink.log(
        f"held-out delta on {config['env']}: {config['trained_name']} against "
        f"{config['base_name']}, {config['num_examples']} examples x "
        f"{config['rollouts_per_example']} (seed {config['seed']})"
    )

    async def both():
        try:
            return await held_out_delta(
                env,
                base,
                trained,
                env_name=config["env"],
                base_name=config["base_name"],
                trained_name=config["trained_name"],
                num_examples=config["num_examples"],
                seed=config["seed"],
                rollouts_per_example=config["rollouts_per_example"],
                sampling=SamplingParams(
                    temperature=config["temperature"], max_tokens=config["max_tokens"]
                ),
                sink=sink,
            )
        finally:
            await base.aclose()
            await trained.aclose()

    report = asyncio.run(both())
    data = report.to_dict()
    reward = report.metrics[0]
    answer = did_training_help(reward.verdict)
    sink.log(f"did training help? {answer}: reward {reward.delta:+.3f}")
    path = _write_report(job, "delta.json", data)
    summary = {"verdict": reward.verdict, "reward_delta": reward.delta, "answer": answer}
    return summary, {"delta": data, "report": format_delta(report), "path": path}
