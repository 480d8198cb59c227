"""The OpenAI-compatible server: routes, request validation, usage, batching, tool-call
extraction and the `python -m rlcore.serve` entry point."""

import asyncio
import json
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from rlcore.policy.local import LocalEngine
from rlcore.policy.tiny import ensure_tiny_model, tiny_config_hash
from rlcore.serve import ServerThread, build_app, extract_tool_calls, main

HELLO = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def rlcore_home(tmp_path_factory):
    """An RLCORE_HOME with the default tiny model already built in its cache slot."""
    home = tmp_path_factory.mktemp("rlcore_home")
    ensure_tiny_model(home / "models" / f"tiny-{tiny_config_hash()}")
    return home


@pytest.fixture(scope="module")
def engine(rlcore_home):
    return LocalEngine(
        str(rlcore_home / "models" / f"tiny-{tiny_config_hash()}"), device="cpu", name="tiny"
    )


@pytest.fixture(scope="module")
def base_url(engine):
    with ServerThread(build_app(engine, "tiny-test")) as url:
        yield url


def chat(base_url, body):
    return httpx.post(f"{base_url}/chat/completions", json=body, timeout=30)


def test_models_lists_the_served_name(base_url):
    response = httpx.get(f"{base_url}/models")
    assert response.status_code == 200
    assert [m["id"] for m in response.json()["data"]] == ["tiny-test"]
    assert response.json()["object"] == "list"


def test_a_completion_reports_usage_and_length(base_url, engine):
    body = {"model": "tiny-test", "messages": HELLO, "max_tokens": 7, "temperature": 0}
    response = chat(base_url, body)
    assert response.status_code == 200
    data = response.json()
    assert data["object"] == "chat.completion" and data["model"] == "tiny-test"
    [choice] = data["choices"]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str)
    prompt_tokens = len(engine.encode_prompt(HELLO))
    assert data["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 7,
        "total_tokens": prompt_tokens + 7,
    }
    # max_completion_tokens is the newer name for the same limit.
    newer = chat(base_url, {"messages": HELLO, "max_completion_tokens": 3, "temperature": 0})
    assert newer.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"messages": HELLO, "stream": "yes"}, "stream", "true or false"),
        ({"messages": HELLO, "n": 0}, "n", "from 1 to 16"),
        ({"messages": HELLO, "n": 99}, "n", "from 1 to 16"),
        ({"messages": HELLO, "top_logprobs": 3}, "top_logprobs", "not returned"),
        ({"messages": []}, "messages", "non-empty list"),
        ({}, "messages", "non-empty list"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "'robot'"),
        ({"messages": ["hello"]}, "messages[0]", "must be an object"),
        ({"messages": HELLO, "temperature": -1}, "temperature", ">= 0.0"),
        ({"messages": HELLO, "temperature": "hot"}, "temperature", "must be a number"),
        ({"messages": HELLO, "top_p": 0}, "top_p", "> 0.0"),
        ({"messages": HELLO, "max_tokens": 0}, "max_tokens", "positive integer"),
        ({"messages": HELLO, "stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
        ({"messages": HELLO, "stop": [""]}, "stop", "non-empty string"),
        ({"messages": HELLO, "tools": "all"}, "tools", "list of function"),
        ([1, 2], None, "JSON object"),
    ],
)
def test_bad_bodies_get_a_400_openai_error(base_url, body, param, words):
    response = chat(base_url, body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert words in error["message"]


def test_invalid_json_gets_a_400(base_url):
    response = httpx.post(f"{base_url}/chat/completions", content=b"{not json")
    assert response.status_code == 400
    assert "not valid JSON" in response.json()["error"]["message"]


def test_an_unknown_model_or_route_is_a_404(base_url):
    response = chat(base_url, {"model": "gpt-9", "messages": HELLO})
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"
    assert "'tiny-test'" in response.json()["error"]["message"]
    missing = httpx.get(f"{base_url}/v1/completions")
    assert missing.status_code == 404 and "POST /v1/chat/completions" in missing.text


def test_a_prompt_over_the_context_is_a_400_naming_the_lengths(base_url):
    response = chat(base_url, {"messages": [{"role": "user", "content": "x" * 3000}]})
    assert response.status_code == 400
    assert "context of 2048" in response.json()["error"]["message"]


def test_concurrent_requests_are_batched_by_the_engine(base_url, engine):
    async def many():
        async with httpx.AsyncClient(timeout=60) as client:
            body = {"messages": HELLO, "max_tokens": 16}
            return await asyncio.gather(
                *(client.post(f"{base_url}/chat/completions", json=body) for _ in range(12))
            )

    before = engine.batches_run
    responses = asyncio.run(many())
    assert [r.status_code for r in responses] == [200] * 12
    assert engine.batches_run - before < 12


def test_tool_call_blocks_become_tool_calls():
    text, calls = extract_tool_calls(
        '<think>add them</think><tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}'
        "</tool_call>"
    )
    assert text == "<think>add them</think>"
    assert [c["function"] for c in calls] == [{"name": "add", "arguments": '{"a": 1, "b": 2}'}]
    only_call, _ = extract_tool_calls('<tool_call>{"name": "f", "arguments": "{}"}</tool_call>')
    assert only_call is None


def test_malformed_tool_call_blocks_stay_text():
    broken = "<tool_call>{name: add}</tool_call> and <tool_call>[1]</tool_call>"
    assert extract_tool_calls(broken) == (broken, [])


def test_main_names_a_missing_model(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["/no/such/checkpoint", "--device", "cpu"])
    assert exited.value.code == 2
    assert "'/no/such/checkpoint' does not exist" in capsys.readouterr().err


def test_python_m_rlcore_serve_tiny_answers(rlcore_home):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "RLCORE_HOME": str(rlcore_home), "HF_HUB_OFFLINE": "1"}
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rlcore.serve",
            "tiny",
            "--port",
            str(port),
            "--device",
            "cpu",
            "--served-name",
            "tiny-cli",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert server.poll() is None, server.stdout.read()
            try:
                models = httpx.get(f"{url}/models", timeout=2)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "server did not come up in 60s"
                time.sleep(0.2)
        assert models.json()["data"][0]["id"] == "tiny-cli"
        response = chat(url, {"model": "tiny-cli", "messages": HELLO, "max_tokens": 4})
        assert response.status_code == 200
        assert response.json()["usage"]["completion_tokens"] <= 4
    finally:
        server.terminate()
        server.wait(timeout=10)


def test_an_eval_whose_games_outgrow_the_context_ends_them_truncated_and_says_so(rlcore_home):
    """Against `rlcore serve`, a conversation past the model's context ends that rollout
    as truncated and scored (no error, no retries); the eval goes on and warns at once."""
    from rlcore.evaluate import EvalConfig, run_eval
    from rlcore.events import RecordingSink

    small = LocalEngine(
        str(rlcore_home / "models" / f"tiny-{tiny_config_hash()}"), device="cpu", name="tiny"
    )
    small.context_length = 260  # a few turns of tic-tac-toe, then no room
    with ServerThread(build_app(small, "tiny")) as url:
        over = chat(url, {"model": "tiny", "messages": [{"role": "user", "content": "x" * 400}]})
        assert over.status_code == 400
        assert over.json()["error"]["code"] == "context_length_exceeded"
        sink = RecordingSink()
        config = EvalConfig(env="tictactoe", model="tiny", base_url=url, api_key_env="",
                            num_examples=3, max_tokens=8, env_args={"max_turns": 9})  # fmt: skip
        result = run_eval(config, sink)
    assert len(result.rollouts) == 3
    assert all(r.error is None for r in result.rollouts)
    outgrown = [r for r in result.rollouts if r.state.get("context_exceeded")]
    assert outgrown and all(r.truncated for r in outgrown)
    assert all("context" in r.state["context_exceeded"] for r in outgrown)
    warnings = [m for level, m in sink.logs if level == "warning" and "outgrew" in m]
    assert len(warnings) == 1


def test_n_stop_and_logprobs_as_the_openai_api_has_them(base_url):
    body = {"model": "tiny-test", "messages": HELLO, "max_tokens": 12, "temperature": 1.0,
            "seed": 7, "n": 3, "logprobs": True}  # fmt: skip
    data = chat(base_url, body).json()
    assert [c["index"] for c in data["choices"]] == [0, 1, 2]
    texts = [c["message"]["content"] for c in data["choices"]]
    assert len(set(texts)) > 1  # seeds 7, 8, 9: different samples
    # Every sampled token of the text, the end-of-turn token aside.
    assert (
        0
        < sum(len(c["logprobs"]["content"]) for c in data["choices"])
        <= (data["usage"]["completion_tokens"])
    )
    for c in data["choices"]:
        tokens = c["logprobs"]["content"]
        assert "".join(t["token"] for t in tokens) == c["message"]["content"]
        assert all(t["logprob"] <= 0 for t in tokens)
    # The reply ends before the first stop sequence, with finish_reason "stop".
    greedy = {"model": "tiny-test", "messages": HELLO, "max_tokens": 12, "temperature": 0}
    full = chat(base_url, greedy).json()["choices"][0]["message"]["content"]
    stop = full[3:5]
    cut = chat(base_url, greedy | {"stop": stop}).json()["choices"][0]
    assert cut["message"]["content"] == full[: full.find(stop)]
    assert cut["finish_reason"] == "stop"


def test_a_streamed_completion_is_openai_chunks_then_done(base_url):
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="EMPTY")
    body = {"model": "tiny-test", "messages": HELLO, "max_tokens": 6, "temperature": 0}
    whole = client.chat.completions.create(**body).choices[0].message.content
    chunks = list(client.chat.completions.create(**body, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    with httpx.stream("POST", f"{base_url}/chat/completions", json=body | {"stream": True}) as raw:
        lines = [line for line in raw.iter_lines() if line]
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert lines[-1] == "data: [DONE]"


def streamed(base_url, body) -> list[dict]:
    """The JSON chunks of a streamed completion, `[DONE]` checked and dropped."""
    with httpx.stream("POST", f"{base_url}/chat/completions", json=body | {"stream": True}) as raw:
        lines = [line for line in raw.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def test_a_stream_comes_token_by_token_and_adds_up_to_the_reply(base_url):
    body = {"model": "tiny-test", "messages": HELLO, "max_tokens": 12, "temperature": 0}
    whole = chat(base_url, body | {"logprobs": True}).json()["choices"][0]
    chunks = streamed(base_url, body | {"logprobs": True})
    contents = [
        c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")
    ]
    assert len(contents) > 3  # not the whole reply in one piece
    assert "".join(c["delta"]["content"] for c in contents) == whole["message"]["content"]
    entries = [e for c in contents for e in c["logprobs"]["content"]]
    assert [e["logprob"] for e in entries] == pytest.approx(
        [e["logprob"] for e in whole["logprobs"]["content"]], abs=1e-5
    )
    assert "".join(e["token"] for e in entries) == whole["message"]["content"]
    assert chunks[-1]["usage"]["completion_tokens"] == 12


def test_a_streamed_reply_ends_before_its_stop_sequence(base_url):
    body = {"model": "tiny-test", "messages": HELLO, "max_tokens": 12, "temperature": 0}
    full = chat(base_url, body).json()["choices"][0]["message"]["content"]
    stop = full[4:7]
    cut = chat(base_url, body | {"stop": stop}).json()["choices"][0]["message"]["content"]
    chunks = streamed(base_url, body | {"stop": stop})
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == cut == full[: full.find(stop)]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"


def test_n_streamed_choices_each_add_up(base_url):
    body = {"model": "tiny-test", "messages": HELLO, "max_tokens": 8, "n": 3, "seed": 5}
    whole = chat(base_url, body).json()["choices"]
    chunks = streamed(base_url, body)
    for index in range(3):
        text = "".join(
            c["choices"][0]["delta"].get("content") or ""
            for c in chunks
            if c["choices"] and c["choices"][0]["index"] == index
        )
        assert text == whole[index]["message"]["content"]


def test_serve_help_names_the_command_people_type(capsys):
    from rlcore.cli import main as cli_main

    with pytest.raises(SystemExit):
        cli_main(["serve", "--help"])
    assert "usage: python -m rlcore serve" in capsys.readouterr().out
