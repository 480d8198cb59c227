"""RL fixtures for the tests that train on more than one process (tests/test_distributed.py,
tests/test_actors.py): a tiny model that already writes reverse-text replies, and the RL
config they share. Loaded as a plugin by conftest.py."""

from __future__ import annotations

import json
import random

import pytest

from rlcore.envs.registry import load_environment
from rlcore.events import RecordingSink
from rlcore.train.config import RLConfig, SFTConfig, build_config
from rlcore.train.sft import run_sft

REVERSE_AB = {"mode": "random", "min_chars": 2, "max_chars": 3, "alphabet": "ab"}


class StopAfterFirstStep(RecordingSink):
    """Asks the run to stop once its first step is logged."""

    def metric(self, step: int, values: dict[str, float]) -> None:
        super().metric(step, values)
        self.stop_requested = True


def rl_config(model: str, tmp_path, name: str, **changes) -> RLConfig:
    settings = dict(
        model=model,
        env="reverse_text",
        env_args=dict(REVERSE_AB),
        output_dir=str(tmp_path / name),
        device="cpu",
        batch_size=16,
        rollouts_per_example=4,
        micro_batch_size=3,
        max_tokens=8,
        lr=1e-2,
        max_steps=1,
        log_rollouts=0,
    )
    return build_config(RLConfig, [("test", settings | changes)])


@pytest.fixture(scope="module")
def formatted_model(tiny_model, tmp_path_factory) -> str:
    """The tiny model after a short SFT on reverse-text replies of random letters in their
    tags: its rollouts get different rewards, so RL steps move the weights."""
    work = tmp_path_factory.mktemp("formatted")
    env = load_environment("reverse_text", **REVERSE_AB)
    rng = random.Random(0)
    with (work / "data.jsonl").open("w") as out:
        for example in env.examples(32, seed=5):
            letters = "".join(rng.choice("ab") for _ in range(rng.randint(1, 3)))
            reply = {"role": "assistant", "content": f"<reversed>{letters}</reversed>"}
            out.write(json.dumps({"messages": [*example.prompt, reply]}) + "\n")
    settings = dict(
        model=tiny_model,
        dataset=str(work / "data.jsonl"),
        output_dir=str(work / "sft"),
        device="cpu",
        max_steps=20,
        batch_size=16,
        micro_batch_size=16,
        lr=3e-3,
        lr_schedule="constant",
    )
    return run_sft(build_config(SFTConfig, [("test", settings)]))
