"""Checkpoints never run code when loaded: the RL trainer state is read with
`torch.load(weights_only=True)` and holds only tensors and plain values (the python and
numpy random states included), so a real checkpoint resumes, while a crafted
trainer_state.pt whose unpickling would run code is refused with an error naming the file
and the code never runs."""

from __future__ import annotations

import os
import pickle
import shutil

import pytest
import torch

from rlcore.events import RecordingSink
from rlcore.train.common import TRAINER_STATE, random_states, restore_random_states
from rlcore.train.config import RLConfig, build_config
from rlcore.train.grpo import run_rl


class WritesMarker:
    """Unpickling this calls os.system: the attack a checkpoint file can carry."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def model(tiny_model) -> str:
    return tiny_model


@pytest.fixture(scope="module")
def checkpoint(model, tmp_path_factory) -> str:
    """A real RL checkpoint: one step of reverse-text."""
    return run_rl(rl_config(model, tmp_path_factory.mktemp("rl")), RecordingSink())


def rl_config(model: str, output_dir, **changes) -> RLConfig:
    values = dict(
        model=model,
        env="reverse_text",
        env_args={"mode": "random", "min_chars": 2, "max_chars": 2, "alphabet": "ab"},
        output_dir=str(output_dir),
        batch_size=4,
        rollouts_per_example=2,
        micro_batch_size=4,
        max_tokens=4,
        max_steps=1,
        device="cpu",
    )
    return build_config(RLConfig, [("test", {**values, **changes})])


def test_a_saved_trainer_state_loads_with_weights_only_and_resumes(model, checkpoint, tmp_path):
    state = torch.load(f"{checkpoint}/{TRAINER_STATE}", weights_only=True)
    assert state["step"] == 1 and set(state) >= {"optimizer", "scheduler", "sampler", "random"}
    sink = RecordingSink()
    run_rl(rl_config(model, tmp_path, max_steps=2, resume_from=checkpoint), sink)
    assert [step for step, _ in sink.metrics] == [2]
    assert not any(level == "warning" for level, _ in sink.logs)


def test_random_states_round_trip_through_a_weights_only_file(tmp_path):
    import random

    import numpy as np

    saved = random_states()
    expected = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    torch.save(saved, tmp_path / "random.pt")
    restore_random_states(torch.load(tmp_path / "random.pt", weights_only=True))
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expected


@pytest.mark.parametrize("how", ["torch.save", "plain pickle"])
def test_a_crafted_trainer_state_is_refused_and_its_code_never_runs(
    model, checkpoint, tmp_path, how
):
    crafted = tmp_path / "crafted"
    shutil.copytree(checkpoint, crafted)
    marker = tmp_path / "code-ran"
    payload = {"step": 1, "optimizer": WritesMarker(str(marker))}
    with (crafted / TRAINER_STATE).open("wb") as out:
        if how == "torch.save":
            torch.save(payload, out)
        else:
            pickle.dump(payload, out)
    cfg = rl_config(model, tmp_path / "resumed", max_steps=2, resume_from=str(crafted))

    with pytest.raises(ValueError, match=f"refusing to load '{crafted / TRAINER_STATE}'"):
        run_rl(cfg, RecordingSink())
    assert not marker.exists(), "unpickling the crafted checkpoint ran its code"
