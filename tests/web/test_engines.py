"""Which engine runs a job or a Play move (workers/engines.py): vllm where its serve
command can run, else the local engine with the reason; endpoints and built-in players
are their own engines; Play's servers (the stand-in `python -m rlcore serve` for `vllm
serve`) are started per model, the oldest stopped when more are asked for."""

import asyncio
import importlib.util
import socket

import pytest
from django.test import override_settings

from rlcore.types import SamplingParams
from webapp.jobs import services
from webapp.jobs.models import Job
from workers.engines import ServerPool, job_engine, play_engine

pytestmark = pytest.mark.django_db

STAND_IN = (
    "{python} -m rlcore serve {model} --host {host} --port {port} --served-name {name} --device cpu"
)
VLLM_INSTALLED = importlib.util.find_spec("vllm") is not None


def eval_job(alice, ttt_config, model, engine="vllm") -> Job:
    return services.job_create(
        owner=alice, kind="eval", env_config=ttt_config, model=model,
        options={"num_examples": 1, "engine": engine},
    )  # fmt: skip


@pytest.mark.skipif(VLLM_INSTALLED, reason="vllm is installed here")
def test_an_eval_asking_for_vllm_where_vllm_serve_is_missing_runs_local_and_says_why(
    alice, ttt_config, tiny
):
    job = eval_job(alice, ttt_config, tiny)
    engine, why = job_engine(job, job.config)
    assert engine == "local" and why == "'vllm' is not on PATH (vLLM is not installed on this node)"
    with override_settings(VLLM_SERVE_COMMAND=STAND_IN):
        assert job_engine(job, job.config) == ("vllm", "")
    assert job_engine(eval_job(alice, ttt_config, tiny, "local"), job.config) == ("local", "")


def test_endpoints_and_built_in_players_are_their_own_engines(alice, ttt_config, oracle):
    endpoint = services.model_create(
        owner=alice, name="served", kind="openai", location="m", base_url="http://127.0.0.1:9/v1"
    )
    job = eval_job(alice, ttt_config, endpoint)
    engine, why = job_engine(job, job.config)
    assert engine == "endpoint" and "nothing to serve with vllm" in why
    job = eval_job(alice, ttt_config, oracle, "local")
    assert job_engine(job, job.config) == ("builtin", "")


@pytest.mark.skipif(VLLM_INSTALLED, reason="vllm is installed here")
def test_play_uses_vllm_only_where_asked_and_possible():
    assert play_engine() == ("local", "")
    with override_settings(INFERENCE_ENGINE="vllm"):
        engine, why = play_engine()
        assert engine == "local" and "vLLM is not installed" in why
    with override_settings(INFERENCE_ENGINE="vllm", VLLM_SERVE_COMMAND=STAND_IN):
        assert play_engine() == ("vllm", "")


def listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_play_servers_start_per_model_and_the_oldest_stops(default_tiny_model, tiny_model):
    pool = ServerPool(keep=1, command=lambda: STAND_IN)
    try:
        first = pool.policy(default_tiny_model)
        first_port = pool.servers[default_tiny_model].port
        assert pool.policy(default_tiny_model).base_url == first.base_url  # kept running

        async def move(policy):
            try:
                return await policy.generate(
                    [{"role": "user", "content": "Your move."}],
                    SamplingParams(temperature=0.0, max_tokens=4),
                )
            finally:
                await policy.aclose()

        assert asyncio.run(move(first)).completion_tokens > 0
        second = pool.policy(tiny_model)
        assert second.base_url != first.base_url and list(pool.servers) == [tiny_model]
        assert not listening(first_port)
    finally:
        ports = [server.port for server in pool.servers.values()]
        pool.stop_all()
    assert pool.servers == {} and not any(listening(port) for port in ports)
