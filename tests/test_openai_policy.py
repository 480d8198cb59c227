"""The OpenAI-compatible client policy against the project's real server (rlcore.serve on
the tiny model, in a thread): chat completions, tool calls both ways, retries and errors."""

import asyncio
import json

import openai
import pytest
import torch
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from rlcore.policy import PolicyError, load_policy
from rlcore.policy.local import LocalEngine
from rlcore.policy.openai_client import OpenAIPolicy
from rlcore.policy.tiny import build_tiny_model
from rlcore.serve import ServerThread, build_app
from rlcore.types import SamplingParams

SMALL = {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "intermediate_size": 256}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "f", "parameters": {"type": "object", "properties": {}}},
    }
]
QUESTION = [{"role": "user", "content": "hi"}]
TOOL_CALL_TEXT = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """A tiny model fine-tuned until, offered the tool `f`, it answers 'hi' by calling it."""
    engine = LocalEngine(
        build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", **SMALL), device="cpu"
    )
    prompt = engine.encode_prompt(QUESTION, TOOLS)
    target = engine.tokenizer(TOOL_CALL_TEXT, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([prompt + target + [engine.tokenizer.eos_token_id]])
    labels = ids.clone()
    labels[0, : len(prompt)] = -100
    optimizer = torch.optim.Adam(engine.model.parameters(), lr=5e-3)
    for _ in range(200):
        loss = engine.model(input_ids=ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if loss.item() < 0.05:
            break
    engine.model.zero_grad(set_to_none=True)
    return engine


@pytest.fixture(scope="module")
def base_url(engine):
    with ServerThread(build_app(engine, "tiny-tools")) as url:
        yield url


async def test_chat_completion_through_async_openai(base_url, engine):
    client = openai.AsyncOpenAI(base_url=base_url, api_key="EMPTY", max_retries=0)
    response = await client.chat.completions.create(
        model="tiny-tools", messages=QUESTION, max_tokens=7, temperature=0.0
    )
    await client.close()
    assert response.model == "tiny-tools"
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert choice.finish_reason == "length"  # without the tools it was not taught to stop
    assert response.usage.completion_tokens == 7
    assert response.usage.prompt_tokens == len(engine.encode_prompt(QUESTION))
    assert response.usage.total_tokens == response.usage.prompt_tokens + 7


async def test_policy_generate_returns_text_and_token_counts(base_url, engine):
    policy = OpenAIPolicy(base_url=base_url, model="tiny-tools")
    generation = await policy.generate(QUESTION, SamplingParams(temperature=0.0, max_tokens=9))
    direct = await engine.generate(QUESTION, SamplingParams(temperature=0.0, max_tokens=9))
    await policy.aclose()
    assert generation.text == direct.text
    assert generation.finish_reason == "length"
    assert (generation.prompt_tokens, generation.completion_tokens) == (direct.prompt_tokens, 9)


async def test_tool_calls_round_trip(base_url, engine):
    policy = OpenAIPolicy(base_url=base_url, model="tiny-tools")
    greedy = SamplingParams(temperature=0.0, max_tokens=60)
    generation = await policy.generate(QUESTION, greedy, tools=TOOLS)
    assert generation.text == ""
    assert generation.finish_reason == "stop"
    [call] = generation.tool_calls
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "f", "arguments": "{}"}

    # Sent back as history, the call renders to exactly the tokens the model produced.
    assistant = {"role": "assistant", "content": None, "tool_calls": generation.tool_calls}
    history = [*QUESTION, assistant, {"role": "tool", "tool_call_id": call["id"], "content": "ok"}]
    taught = (
        engine.encode_prompt(QUESTION, TOOLS)
        + engine.tokenizer(TOOL_CALL_TEXT + "<|im_end|>", add_special_tokens=False)["input_ids"]
    )
    assert engine.encode_prompt(history, TOOLS)[: len(taught)] == taught
    follow_up = await policy.generate(history, SamplingParams(max_tokens=5), tools=TOOLS)
    assert follow_up.prompt_tokens == len(engine.encode_prompt(history, TOOLS))
    await policy.aclose()


async def test_concurrent_policy_calls_share_engine_batches(base_url, engine):
    policy = OpenAIPolicy(base_url=base_url, model="tiny-tools", concurrency=16)
    before_batches, before_requests = engine.batches_run, engine.requests_served
    await asyncio.gather(
        *(policy.generate(QUESTION, SamplingParams(max_tokens=32)) for _ in range(16))
    )
    await policy.aclose()
    assert engine.requests_served - before_requests == 16
    assert engine.batches_run - before_batches < 16


async def test_an_unreachable_url_is_a_policy_error_after_retries(monkeypatch):
    monkeypatch.setenv("RLCORE_TEST_KEY", "sk-secret-value")
    url = "http://127.0.0.1:1/v1"
    policy = OpenAIPolicy(
        base_url=url,
        model="tiny",
        api_key_env="RLCORE_TEST_KEY",
        max_retries=2,
        backoff_seconds=0.01,
        timeout=5,
    )
    with pytest.raises(PolicyError) as raised:
        await policy.generate(QUESTION, SamplingParams(max_tokens=4))
    message = str(raised.value)
    assert url in message and "after 3 attempts" in message and "Connection" in message
    assert "sk-secret-value" not in message + repr(policy)


async def test_a_refused_request_fails_at_once_naming_url_and_status(base_url):
    policy = OpenAIPolicy(base_url=base_url, model="no-such-model", max_retries=3)
    with pytest.raises(
        PolicyError, match=r"refused the request .*\(404\).*no-such-model"
    ) as raised:
        await policy.generate(QUESTION, SamplingParams(max_tokens=4))
    assert base_url in str(raised.value)
    await policy.aclose()


async def test_server_errors_are_retried_with_backoff():
    attempts = []

    async def flaky(request):
        attempts.append(json.loads(await request.body()))
        if len(attempts) < 3:
            return JSONResponse({"error": {"message": "warming up"}}, status_code=503)
        return JSONResponse(
            {
                "id": "chatcmpl-1",
                "object": "chat.completion",
                "created": 0,
                "model": "m",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "<move>4</move>"},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
            }
        )

    app = Starlette(routes=[Route("/v1/chat/completions", flaky, methods=["POST"])])
    with ServerThread(app) as url:
        policy = OpenAIPolicy(base_url=url, model="m", max_retries=3, backoff_seconds=0.01)
        generation = await policy.generate(QUESTION, SamplingParams(max_tokens=4, seed=7))
        await policy.aclose()
        retried_bodies = list(attempts)
        failing = OpenAIPolicy(base_url=url, model="m", max_retries=0)
        attempts.clear()
        with pytest.raises(PolicyError, match=r"after 1 attempt: server error \(503\): warming up"):
            await failing.generate(QUESTION, SamplingParams(max_tokens=4))
        await failing.aclose()
    assert generation.text == "<move>4</move>"
    assert (generation.prompt_tokens, generation.completion_tokens) == (3, 2)
    assert len(retried_bodies) == 3
    assert retried_bodies[0]["seed"] == 7 and retried_bodies[0]["max_tokens"] == 4


def test_a_bad_base_url_is_named():
    with pytest.raises(PolicyError, match="'localhost:8000' is not an HTTP URL"):
        OpenAIPolicy(base_url="localhost:8000", model="tiny")


def test_load_policy_builds_the_client_for_a_base_url():
    policy = load_policy("gpt-x", base_url="http://127.0.0.1:9/v1", max_retries=1, concurrency=4)
    assert isinstance(policy, OpenAIPolicy)
    assert (policy.model, policy.max_retries, policy.concurrency) == ("gpt-x", 1, 4)
