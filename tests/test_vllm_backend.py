"""The vLLM backend up to the vLLM calls: a checkpoint served by a child process that
speaks the OpenAI API (here `python -m rlcore serve`, the stand-in for `vllm serve`:
same placeholders, same protocol), health-checked, reached through the OpenAI policy and
killed with everything it started; and the in-process engine's fallback to the local
engine where vLLM cannot run (it is not installed on this machine)."""

import asyncio
import importlib.util
import logging
import os
import socket
from types import SimpleNamespace

import pytest

from rlcore.policy.base import PolicyError
from rlcore.policy.local import LocalEngine
from rlcore.policy.vllm_engine import (
    VLLMEngine,
    generation_from_output,
    rollout_engine,
    sync_weights,
    vllm_unavailable_reason,
)
from rlcore.policy.vllm_server import (
    VLLM_SERVE,
    ServedModel,
    command_argv,
    command_unavailable_reason,
)
from rlcore.types import SamplingParams

# `vllm serve`'s placeholders filled by the project's own OpenAI-compatible server.
STAND_IN = (
    "{python} -m rlcore serve {model} --host {host} --port {port} --served-name {name} --device cpu"
)
HELLO = [{"role": "user", "content": "Your move."}]
VLLM_INSTALLED = importlib.util.find_spec("vllm") is not None


def port_open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_a_served_checkpoint_answers_through_the_openai_policy_and_dies_on_stop(
    default_tiny_model, tmp_path
):
    server = ServedModel(
        default_tiny_model, command=STAND_IN, name="served-tiny", log_path=tmp_path / "serve.log"
    )
    base_url = server.start()
    assert base_url == f"http://127.0.0.1:{server.port}/v1" and port_open(server.port)
    leader = server.process.pid

    async def ask():
        policy = server.policy()
        try:
            return await policy.generate(HELLO, SamplingParams(temperature=0.0, max_tokens=8))
        finally:
            await policy.aclose()

    reply = asyncio.run(ask())
    assert reply.completion_tokens > 0 and reply.prompt_tokens > 0
    server.stop()
    assert not port_open(int(base_url.rsplit(":", 1)[1].split("/")[0]))
    with pytest.raises(ProcessLookupError):  # the whole process group is gone
        os.killpg(leader, 0)
    assert "serving 'served-tiny'" in (tmp_path / "serve.log").read_text()


def test_a_server_that_exits_at_start_is_an_error_with_its_log(tmp_path):
    server = ServedModel(
        str(tmp_path / "no-such-checkpoint"), command=STAND_IN, log_path=tmp_path / "serve.log"
    )
    with pytest.raises(PolicyError) as caught:
        server.start()
    message = str(caught.value)
    assert "exited with status 2 before it answered" in message
    assert "no-such-checkpoint" in message  # the server's own error, from its log
    assert server.process is None


def test_a_server_that_never_answers_is_killed_after_the_startup_limit(tmp_path):
    silent = '{python} -c "import time; time.sleep(300)" {model} {host} {port} {name}'
    server = ServedModel("m", command=silent, startup_seconds=2, log_path=tmp_path / "s.log")
    with pytest.raises(PolicyError) as caught:
        server.start()
    assert "did not serve 'm'" in str(caught.value) and "within 2 s" in str(caught.value)
    assert server.process is None


def test_the_serve_command_fills_placeholders_word_by_word():
    argv = command_argv(VLLM_SERVE, model="/ckpt/with space", host="0.0.0.0", port=8123, name="n")
    assert argv == [
        "vllm", "serve", "/ckpt/with space", "--host", "0.0.0.0", "--port", "8123",
        "--served-model-name", "n",
    ]  # fmt: skip
    with pytest.raises(PolicyError, match="placeholders accepted"):
        command_argv("vllm serve {checkpoint}", model="m", host="h", port=1, name="n")


@pytest.mark.skipif(VLLM_INSTALLED, reason="vllm is installed here")
def test_vllm_serve_is_unavailable_where_vllm_is_not_installed():
    assert "vLLM is not installed on this node" in command_unavailable_reason(VLLM_SERVE)
    assert command_unavailable_reason(STAND_IN) is None


@pytest.mark.skipif(VLLM_INSTALLED, reason="vllm is installed here")
def test_rl_rollouts_fall_back_to_the_local_engine_sharing_the_model(tiny_model, caplog):
    engine_local = LocalEngine(tiny_model, device="cpu")
    model, tokenizer = engine_local.model, engine_local.tokenizer
    warnings = []
    engine, name = rollout_engine(
        "vllm", model=model, tokenizer=tokenizer, path=tiny_model, warn=warnings.append
    )
    assert name == "local" and isinstance(engine, LocalEngine) and engine.model is model
    assert warnings == [
        "engine vllm asked for, running on the local engine: " + vllm_unavailable_reason()
    ]
    with caplog.at_level(logging.WARNING, logger="rlcore.policy.vllm_engine"):
        _, name = rollout_engine("vllm", model=model, tokenizer=tokenizer, path=tiny_model)
    assert name == "local" and "vllm is not installed here" in caplog.text
    # The local engine samples the trainer's own model: nothing to copy after a step.
    sync_weights(engine, model)
    assert engine.model is model
    with pytest.raises(PolicyError, match="vllm is not installed"):
        VLLMEngine(tiny_model, tokenizer=tokenizer)
    with pytest.raises(PolicyError, match="accepted: local, vllm"):
        rollout_engine("sglang", model=model, tokenizer=tokenizer)


def test_a_vllm_output_becomes_a_generation_with_ids_and_logprobs():
    def logprob(value):
        return SimpleNamespace(logprob=value)

    completion = SimpleNamespace(
        text="<move>4</move>",
        token_ids=(11, 12, 2),
        logprobs=[{11: logprob(-0.5), 7: logprob(-1.0)}, {12: logprob(-0.25)}, {2: logprob(0.0)}],
        finish_reason="stop",
    )
    generation = generation_from_output([1, 5], SimpleNamespace(outputs=[completion]))
    assert generation.completion_ids == [11, 12, 2] and generation.prompt_ids == [1, 5]
    assert generation.logprobs == [-0.5, -0.25, 0.0]
    assert (generation.prompt_tokens, generation.completion_tokens) == (2, 3)
    assert generation.finish_reason == "stop"
    cut = SimpleNamespace(text="<mo", token_ids=[11], logprobs=None, finish_reason="length")
    with pytest.raises(PolicyError, match="0 logprobs for 1 sampled tokens"):
        generation_from_output([1], SimpleNamespace(outputs=[cut]))


def test_vllm_conditions_on_the_same_ids_as_the_local_engine(tiny_model):
    local = LocalEngine(tiny_model, device="cpu")
    vllm = VLLMEngine.__new__(VLLMEngine)  # no vLLM here: only the prompt's rendering runs
    vllm.tokenizer, vllm.name = local.tokenizer, "vllm"
    conversation = [
        {"role": "system", "content": "Play tic-tac-toe."},
        {"role": "user", "content": "X.O......"},
    ]
    assert vllm.encode_prompt(conversation) == local.encode_prompt(conversation)
