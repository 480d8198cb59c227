"""The one interface every policy backend implements.

A policy answers a conversation with one assistant reply. Backends: the OpenAI-compatible
client (`openai_client.py`), the local transformers engine (`local.py`, which batches
concurrent requests into one `generate`), and the environments' built-in players (oracle,
random-valid, constant string). Built-in players read the environment `state` they are
handed; model backends ignore it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from rlcore.types import Generation, Message, SamplingParams


class PolicyError(RuntimeError):
    """A policy could not produce a reply (unreachable endpoint, bad model path...)."""


class ContextExceeded(PolicyError):
    """The conversation no longer fits the model's context window: known before any token
    is generated. A rollout that meets it ends there, truncated, and is scored as it stands
    (OpenAI's servers, vLLM and `rlcore serve` answer it with code
    `context_length_exceeded`)."""

    code = "context_length_exceeded"


class StopRequested(PolicyError):
    """The run was asked to stop, so this reply was not made (or was cut off unfinished);
    the rollout that asked for it ends unfinished."""


class Policy(ABC):
    name: str = "policy"

    @abstractmethod
    async def generate(
        self,
        messages: list[Message],
        sampling: SamplingParams,
        *,
        tools: list[dict] | None = None,
        state: dict | None = None,
    ) -> Generation:
        """One assistant reply to `messages`. `tools` are OpenAI-style JSON tool schemas."""

    async def aclose(self) -> None:  # noqa: B027 - optional hook; most policies hold nothing
        """Release connections, threads or model memory."""


class ConstantPolicy(Policy):
    """Always answers the same string: the trivial exploit a sound verifier must punish."""

    def __init__(self, text: str = "<think>I win.</think><move>4</move>", name: str = "constant"):
        self.text = text
        self.name = name

    async def generate(self, messages, sampling, *, tools=None, state=None) -> Generation:
        return Generation(text=self.text, completion_tokens=len(self.text.split()))
