"""An OpenAI-compatible HTTP server for any checkpoint, on the local engine.

`python -m rlcore.serve MODEL [--host 127.0.0.1] [--port 8000] [--served-name NAME]` serves
`tiny`, a checkpoint directory or a hub id at `/v1`, so anything that speaks the OpenAI API
(the `openai` client, `OpenAIPolicy`, other labs' tools) can evaluate or play against it.
Routes: `GET /v1/models` and `POST /v1/chat/completions` (non-streaming, n=1). Concurrent
requests are batched by the engine. Tools given in a request go to the chat template, and
`<tool_call>{"name": ..., "arguments": ...}</tool_call>` blocks in the model's reply come
back as `message.tool_calls`. Bad requests get a 400 with an OpenAI-style error body.
"""

from __future__ import annotations

import argparse
import json
import re
import threading
import time
import uuid
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from rlcore.policy.base import ContextExceeded, PolicyError
from rlcore.policy.local import LocalEngine
from rlcore.types import SamplingParams

# OpenAI defaults to the rest of the context; a fixed cap keeps one request that names no
# limit from holding a batch for thousands of steps.
DEFAULT_MAX_TOKENS = 1024
ACCEPTED_ROLES = ("system", "developer", "user", "assistant", "tool")
# Options that would change what the client gets back; refusing them beats ignoring them.
UNSUPPORTED_OPTIONS = {
    "stop": "stop sequences are not supported; the reply ends at the model's end-of-turn token",
    "logprobs": "logprobs are not returned by this server",
    "top_logprobs": "logprobs are not returned by this server",
    "response_format": "response_format is not supported",
}
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


class RequestError(ValueError):
    """A request the server refuses; becomes a 400 (or `status`) OpenAI-style error."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code=None):
        super().__init__(message)
        self.param = param
        self.status = status
        self.code = code


def error_response(
    message: str,
    *,
    status: int = 400,
    param: str | None = None,
    code: str | None = None,
    error_type: str = "invalid_request_error",
) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": error_type, "param": param, "code": code}},
        status_code=status,
    )


def _number(body: dict, name: str, default: float, low: float, high: float, *, low_open=False):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RequestError(f"{name} must be a number, got {value!r}", name)
    if (value <= low if low_open else value < low) or value > high:
        low_side = f"> {low}" if low_open else f">= {low}"
        raise RequestError(f"{name} must be {low_side} and <= {high}, got {value!r}", name)
    return float(value)


def parse_chat_request(
    body: Any, served_name: str
) -> tuple[list[dict], SamplingParams, list | None]:
    """Messages, sampling settings and tools from a chat-completions body, or RequestError."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    if body.get("stream"):
        raise RequestError("stream=true is not supported; send stream=false", "stream")
    if body.get("n") not in (None, 1):
        raise RequestError(f"only n=1 is supported, got n={body.get('n')!r}", "n")
    for option, why in UNSUPPORTED_OPTIONS.items():
        if body.get(option) not in (None, False, []):
            raise RequestError(why, option)
    model = body.get("model")
    if model is not None and model != served_name:
        raise RequestError(
            f"the model {model!r} does not exist; this server serves {served_name!r}",
            "model",
            status=404,
            code="model_not_found",
        )
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(
            "messages must be a non-empty list of {role, content} objects", "messages"
        )
    cleaned = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise RequestError(f"{where} must be an object, got {message!r}", where)
        role = message.get("role")
        if role not in ACCEPTED_ROLES:
            raise RequestError(
                f"{where}.role {role!r} is not accepted; accepted: {', '.join(ACCEPTED_ROLES)}",
                f"{where}.role",
            )
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise RequestError(f"{where}.content must be a string or a list of parts", where)
        # ChatML templates know system, not OpenAI's newer name for it.
        cleaned.append({**message, "role": "system" if role == "developer" else role})
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    elif isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise RequestError(
            f"max_tokens must be a positive integer, got {max_tokens!r}", "max_tokens"
        )
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise RequestError(f"seed must be an integer, got {seed!r}", "seed")
    sampling = SamplingParams(
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
        max_tokens=max_tokens,
        seed=seed,
    )
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise RequestError("tools must be a list of function tool schemas", "tools")
    if body.get("tool_choice") == "none":
        tools = None
    return cleaned, sampling, tools or None


def extract_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """Split a reply into its remaining text and the well-formed `<tool_call>` blocks in it,
    as OpenAI tool calls. A block whose body is not `{"name": str, "arguments": ...}` JSON
    stays in the text: the client sees exactly what the model wrote."""
    calls = []

    def take(match: re.Match) -> str:
        try:
            body = json.loads(match.group(1))
        except json.JSONDecodeError:
            return match.group(0)
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            return match.group(0)
        arguments = body.get("arguments", {})
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {
                    "name": body["name"],
                    "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
                },
            }
        )
        return ""

    remaining = _TOOL_CALL.sub(take, text).strip()
    return (remaining or None) if calls else text, calls


def build_app(engine: LocalEngine, served_name: str) -> Starlette:
    """The Starlette app serving `engine` under the model name `served_name`."""
    started = int(time.time())

    async def list_models(request: Request) -> JSONResponse:
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {"id": served_name, "object": "model", "created": started, "owned_by": "rlcore"}
                ],
            }
        )

    async def chat_completions(request: Request) -> JSONResponse:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return error_response(f"the request body is not valid JSON: {exc}")
        try:
            messages, sampling, tools = parse_chat_request(body, served_name)
        except RequestError as exc:
            return error_response(str(exc), status=exc.status, param=exc.param, code=exc.code)
        try:
            generation = await engine.generate(messages, sampling, tools=tools)
        except ContextExceeded as exc:  # checked before the request joins a batch
            return error_response(str(exc), param="messages", code=ContextExceeded.code)
        except PolicyError as exc:
            return error_response(str(exc))
        content, tool_calls = (
            extract_tool_calls(generation.text) if tools else (generation.text, [])
        )
        message: dict[str, Any] = {"role": "assistant", "content": content}
        finish_reason = generation.finish_reason
        if tool_calls:
            message["tool_calls"] = tool_calls
            finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        return JSONResponse(
            {
                "id": f"chatcmpl-{uuid.uuid4().hex}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": served_name,
                "choices": [
                    {
                        "index": 0,
                        "message": message,
                        "finish_reason": finish_reason,
                        "logprobs": None,
                    }
                ],
                "usage": {
                    "prompt_tokens": generation.prompt_tokens,
                    "completion_tokens": generation.completion_tokens,
                    "total_tokens": generation.prompt_tokens + generation.completion_tokens,
                },
            }
        )

    async def not_found(request: Request, exc: Exception) -> JSONResponse:
        return error_response(
            f"no route {request.method} {request.url.path}; this server has GET /v1/models "
            "and POST /v1/chat/completions",
            status=404,
        )

    async def method_not_allowed(request: Request, exc: Exception) -> JSONResponse:
        return error_response(f"{request.method} is not allowed on {request.url.path}", status=405)

    async def server_error(request: Request, exc: Exception) -> JSONResponse:
        return error_response(
            f"internal error: {type(exc).__name__}: {exc}", status=500, error_type="server_error"
        )

    return Starlette(
        routes=[
            Route("/v1/models", list_models, methods=["GET"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        ],
        exception_handlers={404: not_found, 405: method_not_allowed, 500: server_error},
    )


class ServerThread:
    """Serves an ASGI app with uvicorn on a background thread, for callers that need an
    endpoint inside their own process (tests, a trainer exposing its live model).

    `with ServerThread(build_app(engine, "tiny")) as base_url: ...` -> "http://127.0.0.1:PORT/v1";
    port 0 picks a free port.
    """

    def __init__(
        self, app, *, host: str = "127.0.0.1", port: int = 0, startup_timeout: float = 30.0
    ):
        import uvicorn

        self.server = uvicorn.Server(
            uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off")
        )
        self.host = host
        self.startup_timeout = startup_timeout
        self.thread = threading.Thread(target=self.server.run, name="rlcore-serve", daemon=True)
        self.base_url = ""

    def start(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + self.startup_timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server on {self.host} did not start")
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.base_url = f"http://{self.host}:{port}/v1"
        return self.base_url

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()


def load_engine(model: str, *, device: str = "auto", max_batch_size: int = 64) -> LocalEngine:
    """The local engine for MODEL: 'tiny' (built on first use), a directory, or a hub id."""
    from rlcore.policy import load_policy

    engine = load_policy(model, device=device)  # no base_url and no env: a LocalEngine
    engine.max_batch_size = max_batch_size
    return engine


def main(argv: list[str] | None = None, *, prog: str = "python -m rlcore.serve") -> int:
    """The command line; `prog` names it in help and errors (`python -m rlcore serve`)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Serve a model over the OpenAI chat-completions API.",
    )
    parser.add_argument("model", help="'tiny', a Hugging Face checkpoint directory, or a hub id")
    parser.add_argument("--host", default="127.0.0.1", help="interface to listen on")
    parser.add_argument("--port", type=int, default=8000, help="TCP port")
    parser.add_argument("--served-name", default=None, help="model name clients ask for")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument(
        "--max-batch-size", type=int, default=64, help="most requests generated together"
    )
    args = parser.parse_args(argv)
    import uvicorn

    try:
        engine = load_engine(args.model, device=args.device, max_batch_size=args.max_batch_size)
    except PolicyError as exc:
        parser.exit(2, f"error: {exc}\n")
    served_name = args.served_name or args.model
    print(
        f"serving {served_name!r} on {engine.device} at http://{args.host}:{args.port}/v1",
        flush=True,
    )
    uvicorn.run(build_app(engine, served_name), host=args.host, port=args.port, log_level="info")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
