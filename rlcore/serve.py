"""An OpenAI-compatible HTTP server for any checkpoint, on the local engine.

`python -m rlcore.serve MODEL [--host 127.0.0.1] [--port 8000] [--served-name NAME]` serves
`tiny`, a checkpoint directory or a hub id at `/v1`, so anything that speaks the OpenAI API
(the `openai` client, `OpenAIPolicy`, other labs' tools) can evaluate or play against it.
Routes: `GET /v1/models` and `POST /v1/chat/completions`, with `n` replies (batched
together), `stop` sequences (up to 4; the reply ends before the first one), `logprobs` (the
sampled token's logprob per token; `top_logprobs` 0) and `stream` (server-sent events in
OpenAI's chunk format: a chunk per token as the engine samples it, then the finish reason,
the usage and `[DONE]`). Concurrent requests are batched
by the engine. Tools given in a request go to the chat template, and
`<tool_call>{"name": ..., "arguments": ...}</tool_call>` blocks in the model's reply come
back as `message.tool_calls`. Bad requests get a 400 with an OpenAI-style error body.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
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
    "top_logprobs": "top_logprobs are not returned by this server (logprobs=true gives the "
    "sampled tokens' own logprobs)",
    "response_format": "response_format is not supported",
}
MAX_N = 16
MAX_STOP = 4
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


@dataclass
class ChatRequest:
    """A parsed chat-completions body."""

    messages: list[dict]
    sampling: SamplingParams
    tools: list | None
    n: int = 1
    stop: list[str] = field(default_factory=list)
    logprobs: bool = False
    stream: bool = False


def _flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be true or false, got {value!r}", name)
    return value


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if (
        not isinstance(stops, list)
        or not all(isinstance(s, str) and s for s in stops)
        or len(stops) > MAX_STOP
    ):
        raise RequestError(
            f"stop must be a non-empty string or a list of at most {MAX_STOP} of them, got {stop!r}",
            "stop",
        )
    return stops


def parse_chat_request(body: Any, served_name: str) -> ChatRequest:
    """The request in a chat-completions body, or RequestError naming the bad field."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    n = body.get("n", 1)
    if n is None:
        n = 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
        raise RequestError(f"n must be an integer from 1 to {MAX_N}, got {n!r}", "n")
    for option, why in UNSUPPORTED_OPTIONS.items():
        if body.get(option) not in (None, False, [], 0):
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
    return ChatRequest(
        messages=cleaned,
        sampling=sampling,
        tools=tools or None,
        n=n,
        stop=_stop(body),
        logprobs=_flag(body, "logprobs"),
        stream=_flag(body, "stream"),
    )


def cut_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """`text` up to the first of `stops` (which is not included), and whether one was met."""
    ends = [text.find(s) for s in stops if s in text]
    return (text[: min(ends)], True) if ends else (text, False)


def token_logprobs(engine: LocalEngine, generation, text: str) -> dict:
    """OpenAI's `logprobs` of a choice: each sampled token of `text` with its logprob. A
    token's text is what it adds to the decoded reply (a character split over several
    tokens shows on the one that completes it), so the tokens join up to `text`."""
    content, stable = [], ""  # stable: the decoded text up to the last whole character
    ids = generation.completion_ids or []
    for count, (_, logprob) in enumerate(zip(ids, generation.logprobs or [], strict=False), 1):
        now = engine.tokenizer.decode(ids[:count])
        piece = ""
        if not now.endswith("\ufffd"):  # else a character is not complete yet
            piece, stable = now[len(stable) :], now
        content.append(
            {"token": piece, "logprob": logprob, "bytes": list(piece.encode()), "top_logprobs": []}
        )
        if stable.startswith(text) and len(stable) >= len(text):
            break  # the text is complete (a stop sequence may have cut it mid-token)
    if content:  # the last token carries the end exactly: cut by a stop, or a partial char
        before = "".join(entry["token"] for entry in content[:-1])
        if text.startswith(before):
            last = content[-1]
            last["token"] = text[len(before) :]
            last["bytes"] = list(last["token"].encode())
    return {"content": content}


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
            chat = parse_chat_request(body, served_name)
        except RequestError as exc:
            return error_response(str(exc), status=exc.status, param=exc.param, code=exc.code)
        samplings = [
            chat.sampling
            if chat.sampling.seed is None
            else replace(chat.sampling, seed=chat.sampling.seed + index)
            for index in range(chat.n)
        ]
        try:
            for sampling in samplings[:1]:  # refused before a stream starts, with a 400
                engine.prepare(chat.messages, sampling, chat.tools)
        except ContextExceeded as exc:
            return error_response(str(exc), param="messages", code=ContextExceeded.code)
        except PolicyError as exc:
            return error_response(str(exc))
        completion = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "created": int(time.time()),
            "model": served_name,
        }
        if chat.stream:
            return StreamingResponse(
                stream_events(chat, samplings, completion), media_type="text/event-stream"
            )
        try:
            generations = await asyncio.gather(
                *(engine.generate(chat.messages, s, tools=chat.tools) for s in samplings)
            )
        except PolicyError as exc:
            return error_response(str(exc))
        choices = [choice(index, generation, chat) for index, generation in enumerate(generations)]
        return JSONResponse(
            {
                **completion,
                "object": "chat.completion",
                "choices": choices,
                "usage": usage_of(generations),
            }
        )

    async def stream_events(chat: ChatRequest, samplings: list, completion: dict):
        """Server-sent events in OpenAI's `chat.completion.chunk` form: each choice's role,
        then its text as the engine samples it, a chunk per token (with the token's logprob
        when asked), its finish reason, the usage, `[DONE]`. Text that may be the start of a
        stop sequence waits until it is known not to be one. With tools the reply's text
        comes whole at its end (tool calls are parsed from the whole reply)."""

        def event(choice_deltas: list[dict], **extra) -> str:
            chunk = {**completion, "object": "chat.completion.chunk", "choices": choice_deltas}
            return f"data: {json.dumps(chunk | extra)}\n\n"

        def delta(index: int, content: dict, logprobs=None, finish_reason=None) -> str:
            entry = {"index": index, "delta": content, "finish_reason": finish_reason}
            if chat.logprobs:
                entry["logprobs"] = logprobs
            return event([entry])

        events: asyncio.Queue = asyncio.Queue()
        streams = [TextStream(engine.tokenizer, chat.stop) for _ in samplings]

        async def run(index: int, sampling) -> None:
            def on_token(token: int, logprob: float) -> None:
                events.put_nowait(("token", index, token, logprob))

            try:
                generation = await engine.generate(
                    chat.messages,
                    sampling,
                    tools=chat.tools,
                    on_token=None if chat.tools else on_token,
                )
            except PolicyError as exc:
                events.put_nowait(("error", index, exc, None))
                return
            events.put_nowait(("done", index, generation, None))

        tasks = [asyncio.create_task(run(i, s)) for i, s in enumerate(samplings)]
        generations: dict[int, Any] = {}
        try:
            for index in range(len(samplings)):
                yield delta(index, {"role": "assistant"})
            while len(generations) < len(samplings):
                kind, index, value, logprob = await events.get()
                if kind == "token":
                    piece = streams[index].add(value, logprob)
                    if piece is not None:
                        yield delta(index, {"content": piece[0]}, {"content": piece[1]})
                elif kind == "error":
                    yield event([], error={"message": str(value), "type": "invalid_request_error"})
                    return
                else:
                    generations[index] = value
                    final = choice(index, value, chat)
                    rest = streams[index].rest(final["message"])
                    if rest:
                        logprobs = final["logprobs"]
                        yield delta(
                            index,
                            rest,
                            logprobs
                            and {"content": logprobs["content"][streams[index].tokens_sent :]},
                        )
                    yield delta(index, {}, finish_reason=final["finish_reason"])
            yield event([], usage=usage_of([generations[i] for i in range(len(samplings))]))
            yield "data: [DONE]\n\n"
        finally:
            for task in tasks:
                task.cancel()

    def choice(index: int, generation, chat: ChatRequest) -> dict:
        text, stopped = cut_at_stop(generation.text, chat.stop)
        content, tool_calls = extract_tool_calls(text) if chat.tools else (text, [])
        message: dict[str, Any] = {"role": "assistant", "content": content}
        finish_reason = "stop" if stopped else generation.finish_reason
        if tool_calls:
            message["tool_calls"] = tool_calls
            finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        return {
            "index": index,
            "message": message,
            "finish_reason": finish_reason,
            "logprobs": token_logprobs(engine, generation, text) if chat.logprobs else None,
        }

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


def usage_of(generations) -> dict:
    usage = {
        "prompt_tokens": generations[0].prompt_tokens,
        "completion_tokens": sum(g.completion_tokens for g in generations),
    }
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    return usage


class TextStream:
    """A reply's text as its tokens arrive: `add` gives each token's new text (and its
    logprob entry) once it is sure, `rest` what the finished reply adds to what was sent.
    Text is held back, whole tokens at a time, while it ends in an incomplete character or in
    what may begin a stop sequence; once a stop sequence appears nothing more is sent."""

    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer, self.stops = tokenizer, stops
        self.ids: list[int] = []
        self.sent = ""
        self.pending: list[dict] = []  # logprob entries of tokens whose text is held back
        self.tokens_sent = 0
        self.stopped = False

    def add(self, token: int, logprob: float) -> tuple[str, list[dict]] | None:
        if self.stopped:
            return None
        self.ids.append(token)
        self.pending.append({"token": "", "logprob": logprob, "bytes": [], "top_logprobs": []})
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return None  # a character split over tokens: wait for its last byte
        text, self.stopped = cut_at_stop(text, self.stops)
        if not self.stopped and any(
            text.endswith(stop[:end]) for stop in self.stops for end in range(1, len(stop))
        ):
            return None  # may be the start of a stop sequence: wait for the next token
        piece = text[len(self.sent) :]
        if not piece:
            return None
        self.sent = text
        entries, self.pending = self.pending, []
        entries[-1] |= {"token": piece, "bytes": list(piece.encode())}
        self.tokens_sent += len(entries)
        return piece, entries

    def rest(self, message: dict) -> dict:
        """The finished reply's message less the text already sent."""
        content = message.get("content") or ""
        rest = {k: v for k, v in message.items() if k not in ("role", "content") and v}
        if content.startswith(self.sent) and len(content) > len(self.sent):
            rest["content"] = content[len(self.sent) :]
        return rest


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
    """The local engine for MODEL: 'tiny' or 'tiny-bpe' (built on first use), 'tiny-master',
    a directory, or a hub id."""
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
    parser.add_argument(
        "model",
        help="'tiny', 'tiny-bpe', 'tiny-master', a Hugging Face checkpoint directory, or a hub id",
    )
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
