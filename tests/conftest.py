"""Fixtures every test may use: one torch thread, and the built-in tiny model built once
per test session (small enough to train a few steps in seconds on a CPU); and, from
tests/lab_fixtures.py, the lab's (users alice and bob, PostgreSQL, the test Redis, one real
Celery worker for the whole session)."""

from __future__ import annotations

import pytest
import torch

from rlcore.policy.tiny import ensure_tiny_model

# Loaded once for the whole session: session fixtures (the Celery worker above all) must
# exist once, not once per folder that uses them.
pytest_plugins = ["tests.lab_fixtures", "tests.rl_fixtures"]


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """Tiny models gain nothing from a second thread, and on a shared CPU its spin-waits
    make every step many times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A small built-in tiny model (random weights, the tiny tokenizer) in Hugging Face
    format, for training tests."""
    return ensure_tiny_model(
        tmp_path_factory.mktemp("tiny") / "model",
        hidden_size=64,
        num_layers=2,
        num_heads=2,
        intermediate_size=128,
    )


@pytest.fixture(scope="session")
def default_tiny_model(tmp_path_factory) -> str:
    """The built-in tiny model at its default shape, for engines and servers."""
    return ensure_tiny_model(tmp_path_factory.mktemp("tiny-default") / "model")
