"""A policy served over the OpenAI chat-completions API: OpenAI itself, vLLM, or the
project's own server (`python -m rlcore.serve`).

Built on `openai.AsyncOpenAI` with the client's own retries off: this module retries
connection failures, timeouts, rate limits and 5xx answers itself, with exponential backoff,
so the final error can say which URL failed, how, and after how many attempts. A semaphore
caps the requests in flight. The API key is read from the environment variable the caller
names and is never logged or put in an error message.
"""

from __future__ import annotations

import asyncio
import os
import random
import weakref

import openai

from rlcore.policy.base import ContextExceeded, Policy, PolicyError
from rlcore.types import Generation, Message, SamplingParams


class OpenAIPolicy(Policy):
    """Chat completions from `model` at `base_url` (e.g. http://127.0.0.1:8000/v1)."""

    def __init__(
        self,
        *,
        base_url: str,
        model: str,
        api_key_env: str = "OPENAI_API_KEY",
        timeout: float = 120.0,
        max_retries: int = 3,
        concurrency: int = 32,
        backoff_seconds: float = 0.5,
        max_backoff_seconds: float = 8.0,
    ):
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise PolicyError(
                f"base_url {base_url!r} is not an HTTP URL; accepted: http(s)://HOST[:PORT]/v1"
            )
        if max_retries < 0:
            raise PolicyError(f"max_retries must be >= 0, got {max_retries}")
        if concurrency < 1:
            raise PolicyError(f"concurrency must be at least 1, got {concurrency}")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.name = model
        self.api_key_env = api_key_env
        self.timeout = timeout
        self.max_retries = max_retries
        self.concurrency = concurrency
        self.backoff_seconds = backoff_seconds
        self.max_backoff_seconds = max_backoff_seconds
        # Servers that need no key (vLLM, rlcore.serve) still want a non-empty one.
        self._api_key = os.environ.get(api_key_env) or "EMPTY"
        # An HTTP connection pool and a semaphore belong to one event loop; callers that run
        # asyncio.run once per step (the trainer) get fresh ones on each new loop.
        self._per_loop: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __repr__(self) -> str:
        return f"OpenAIPolicy(base_url={self.base_url!r}, model={self.model!r})"

    def _client_and_limit(self) -> tuple[openai.AsyncOpenAI, asyncio.Semaphore]:
        loop = asyncio.get_running_loop()
        if loop not in self._per_loop:
            client = openai.AsyncOpenAI(
                base_url=self.base_url,
                api_key=self._api_key,
                timeout=self.timeout,
                max_retries=0,
            )
            self._per_loop[loop] = (client, asyncio.Semaphore(self.concurrency))
        return self._per_loop[loop]

    async def generate(
        self,
        messages: list[Message],
        sampling: SamplingParams,
        *,
        tools: list[dict] | None = None,
        state: dict | None = None,
    ) -> Generation:
        request = {
            "model": self.model,
            "messages": messages,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            # max_tokens, not max_completion_tokens: every OpenAI-compatible server knows it.
            "max_tokens": sampling.max_tokens,
        }
        if sampling.seed is not None:
            request["seed"] = sampling.seed
        if tools:
            request["tools"] = tools
        client, limit = self._client_and_limit()
        async with limit:
            response = await self._create_with_retries(client, request)
        if not response.choices:
            raise PolicyError(f"{self.base_url} answered with no choices for model {self.model!r}")
        choice = response.choices[0]
        tool_calls = [
            call.model_dump(exclude_none=True) for call in choice.message.tool_calls or []
        ]
        usage = response.usage
        return Generation(
            text=choice.message.content or "",
            # The contract knows "stop" and "length"; tool calls and filters end a reply too.
            finish_reason="length" if choice.finish_reason == "length" else "stop",
            prompt_tokens=usage.prompt_tokens if usage else 0,
            completion_tokens=usage.completion_tokens if usage else 0,
            tool_calls=tool_calls or None,
        )

    async def _create_with_retries(self, client: openai.AsyncOpenAI, request: dict):
        attempts = self.max_retries + 1
        for attempt in range(1, attempts + 1):
            try:
                return await client.chat.completions.create(**request)
            except openai.APIConnectionError as exc:  # includes APITimeoutError
                failure = f"{type(exc).__name__}: {exc}"
            except openai.RateLimitError as exc:
                failure = f"rate limited (429): {_error_message(exc)}"
            except openai.AuthenticationError as exc:
                raise PolicyError(
                    f"{self.base_url} rejected the API key read from ${self.api_key_env} "
                    f"(401): {_error_message(exc)}"
                ) from exc
            except openai.APIStatusError as exc:
                if exc.status_code == 400 and _error_code(exc) == ContextExceeded.code:
                    raise ContextExceeded(
                        f"{self.base_url}, model {self.model!r}: {_error_message(exc)}"
                    ) from exc
                if exc.status_code < 500:
                    raise PolicyError(
                        f"{self.base_url} refused the request for model {self.model!r} "
                        f"({exc.status_code}): {_error_message(exc)}"
                    ) from exc
                failure = f"server error ({exc.status_code}): {_error_message(exc)}"
            if attempt < attempts:
                delay = min(self.max_backoff_seconds, self.backoff_seconds * 2 ** (attempt - 1))
                # Jitter keeps many rollouts that failed together from retrying in lockstep.
                await asyncio.sleep(delay * (0.75 + 0.5 * random.random()))
        raise PolicyError(
            f"{self.base_url} failed for model {self.model!r} after {attempts} "
            f"attempt{'s' if attempts != 1 else ''}: {failure}"
        )

    async def aclose(self) -> None:
        loop = asyncio.get_running_loop()
        entry = self._per_loop.pop(loop, None)
        if entry is not None:
            await entry[0].close()


def _error_code(exc: openai.APIStatusError) -> str | None:
    """The OpenAI-style error code in the server's body (e.g. context_length_exceeded)."""
    body = exc.body if isinstance(exc.body, dict) else {}
    error = body.get("error", body)
    return error.get("code") if isinstance(error, dict) else None


def _error_message(exc: openai.APIStatusError) -> str:
    """The server's own error message when it sent an OpenAI-style body, else the status text."""
    body = exc.body
    if isinstance(body, dict):
        error = body.get("error", body)
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
    return str(exc.message)
