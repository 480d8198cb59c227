"""vLLM in the trainer's process: RL rollouts sampled by `vllm.LLM`, with the trainer's
weights loaded into it after each optimizer step.

`rollout_engine("vllm", model=..., tokenizer=..., path=...)` returns a `VLLMEngine` where
vLLM can run (installed, and torch sees a CUDA GPU), and otherwise the local engine that
shares the trainer's model, with a warning saying why; `rollout_engine("local", ...)` is
the local engine. After each optimizer step the trainer calls `sync_weights(engine,
model)`: a no-op for the local engine (it samples the trainer's own model), a
`load_weights` of every parameter for vLLM (its own copy of the model).

The engine renders prompts with the same chat template as the local engine and returns
what the trainer needs: the prompt ids, the sampled ids (the final stop token included),
and each sampled token's logprob after temperature and top-p (vLLM's
`logprobs_mode="processed_logprobs"`), the distribution it was drawn from. vLLM computes
them in its own kernels, so they differ from the trainer's recomputation by numerical
noise; runs that need exact old logprobs set `num_iterations > 1` or a KL term, which
recompute them in the trainer.

Requests from concurrent rollouts are gathered into one `LLM.generate` call (run on a
worker thread so the event loop keeps collecting the next batch), as the local engine
batches its own. The model lives in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`),
which is what lets `load_weights` reach it.

vLLM cannot be installed on the machines this was written on: everything up to the
`vllm` calls is tested (the fallback, the output conversion); the calls themselves follow
vLLM's documented offline API and have not yet run (docs/DEPLOY.md).
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rlcore.policy.base import Policy, PolicyError, StopRequested
from rlcore.policy.local import LocalEngine
from rlcore.policy.prompts import PromptRenderer
from rlcore.types import Generation, Message, SamplingParams

logger = logging.getLogger(__name__)

# Where vLLM keeps the model object of an in-process engine, newest layout first.
_MODEL_PATHS = (
    ("llm_engine", "model_executor", "driver_worker", "worker", "model_runner", "model"),
    ("llm_engine", "engine_core", "engine_core", "model_executor", "driver_worker", "worker",
     "model_runner", "model"),
    ("llm_engine", "model_executor", "driver_worker", "model_runner", "model"),
)  # fmt: skip


def vllm_unavailable_reason() -> str | None:
    """Why vLLM cannot run in this process (not installed, no CUDA GPU), or None."""
    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed here (GPU nodes install it from requirements-gpu.txt)"
    import torch

    if not torch.cuda.is_available():
        return "vllm needs a CUDA GPU and torch sees none here"
    return None


def rollout_engine(
    engine: str,
    *,
    model: Any,
    tokenizer: Any,
    path: str | None = None,
    should_stop: Callable[[], bool] | None = None,
    warn: Callable[[str], None] | None = None,
    gpu_sharers: int = 1,
    **vllm_options,
) -> tuple[Policy, str]:
    """The policy RL rollouts sample from and the name of the engine it is: `engine`
    "vllm" where vLLM can run (initialised from `path`, then the trainer's weights), else
    the local engine on the trainer's own `model`, after `warn` (default: the logger) was
    told why. `gpu_sharers`: the run's processes on the local engine's GPU, which split
    what it may keep of earlier prompts."""
    if engine not in ("local", "vllm"):
        raise PolicyError(f"unknown engine {engine!r}; accepted: local, vllm")
    if engine == "vllm":
        reason = vllm_unavailable_reason()
        if reason is None:
            vllm_engine = VLLMEngine(
                path, tokenizer=tokenizer, should_stop=should_stop, **vllm_options
            )
            vllm_engine.load_weights(model)
            return vllm_engine, "vllm"
        (warn or logger.warning)(f"engine vllm asked for, running on the local engine: {reason}")
    local = LocalEngine(
        None,
        model=model,
        tokenizer=tokenizer,
        name="policy",
        should_stop=should_stop,
        gpu_sharers=gpu_sharers,
    )
    return local, "local"


def sync_weights(engine: Policy, model: Any) -> None:
    """After an optimizer step: the rollout engine samples the updated weights."""
    if isinstance(engine, VLLMEngine):
        engine.load_weights(model)


def generation_from_output(prompt_ids: list[int], output: Any) -> Generation:
    """A `Generation` from one vLLM `RequestOutput` (its first completion)."""
    completion = output.outputs[0]
    ids = list(completion.token_ids)
    logprobs = []
    for token, by_token in zip(ids, completion.logprobs or [], strict=False):
        logprobs.append(float(by_token[token].logprob))
    if len(logprobs) != len(ids):
        raise PolicyError(
            f"vllm returned {len(logprobs)} logprobs for {len(ids)} sampled tokens; the engine "
            "must be created with logprobs for every sampled token"
        )
    return Generation(
        text=completion.text,
        finish_reason="length" if completion.finish_reason == "length" else "stop",
        prompt_ids=list(prompt_ids),
        completion_ids=ids,
        logprobs=logprobs,
        prompt_tokens=len(prompt_ids),
        completion_tokens=len(ids),
    )


class VLLMEngine(Policy):
    """`vllm.LLM` on the model at `path`, batching concurrent `generate` calls; the
    trainer's weights replace its own with `load_weights`."""

    name = "vllm"
    # The same rendering of a conversation as the local engine's (chat template plus the
    # generation prompt), so both engines condition on identical ids.
    render_prompt = LocalEngine.render_prompt
    encode_prompt = LocalEngine.encode_prompt

    @functools.cached_property
    def _renderer(self) -> PromptRenderer:
        """The local engine's renderer of conversations (render_prompt reads it)."""
        return PromptRenderer(self.tokenizer, max_entries=8192)

    def __init__(
        self,
        path: str,
        *,
        tokenizer: Any,
        should_stop: Callable[[], bool] | None = None,
        gpu_memory_utilization: float = 0.3,
        max_model_len: int | None = None,
        seed: int = 0,
        dtype: str = "auto",
    ):
        reason = vllm_unavailable_reason()
        if reason is not None:
            raise PolicyError(f"VLLMEngine cannot start: {reason}")
        # The engine must live in this process for load_weights to reach its model.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        import vllm

        self._vllm = vllm
        self.tokenizer = tokenizer
        self.should_stop = should_stop
        self.llm = vllm.LLM(
            model=path,
            tokenizer=path,
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len,
            # The trainer's model shares the card: vLLM takes only this share of it.
            gpu_memory_utilization=gpu_memory_utilization,
            enable_prefix_caching=True,
            logprobs_mode="processed_logprobs",
        )
        self.stop_token_ids = sorted(
            {tokenizer.eos_token_id, tokenizer.get_vocab().get("<|im_end|>")} - {None}
        )
        self._pending: list[tuple[list[int], SamplingParams, asyncio.Future]] = []
        self._drainer: asyncio.Task | None = None
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm")

    def _model(self):
        for path in _MODEL_PATHS:
            target = self.llm
            for attribute in path:
                target = getattr(target, attribute, None)
                if target is None:
                    break
            if target is not None:
                return target
        raise PolicyError(
            "cannot reach the model inside vllm.LLM to load the trainer's weights (tried "
            + "; ".join(".".join(p) for p in _MODEL_PATHS)
            + "); this vLLM version keeps it elsewhere"
        )

    def load_weights(self, model: Any) -> None:
        """Copy every parameter of the trainer's `model` into vLLM's copy, then drop the
        prefix cache (its keys and values were computed with the old weights)."""
        self._model().load_weights(
            weights=((name, tensor.detach()) for name, tensor in model.state_dict().items())
        )
        self.llm.reset_prefix_cache()

    def _sampling_params(self, sampling: SamplingParams):
        return self._vllm.SamplingParams(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            max_tokens=sampling.max_tokens,
            seed=sampling.seed,
            logprobs=0,  # the sampled token's own logprob
            stop_token_ids=self.stop_token_ids,
            skip_special_tokens=False,
        )

    async def generate(
        self,
        messages: list[Message],
        sampling: SamplingParams,
        *,
        tools: list[dict] | None = None,
        state: dict | None = None,
    ) -> Generation:
        prompt_ids = self.encode_prompt(messages, tools)
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._pending.append((prompt_ids, sampling, future))
        if self._drainer is None or self._drainer.done():
            self._drainer = loop.create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        while self._pending:
            await asyncio.sleep(0)  # let the rollouts that run now queue their requests
            batch, self._pending = self._pending, []
            if self.should_stop is not None and self.should_stop():
                for _, _, future in batch:
                    future.set_exception(StopRequested("stop requested before generation"))
                continue
            prompts = [{"prompt_token_ids": ids} for ids, _, _ in batch]
            params = [self._sampling_params(sampling) for _, sampling, _ in batch]
            try:
                outputs = await loop.run_in_executor(
                    self._worker,
                    functools.partial(self.llm.generate, prompts, params, use_tqdm=False),
                )
            except Exception as exc:
                for _, _, future in batch:
                    future.set_exception(PolicyError(f"vllm generate failed: {exc}"))
                continue
            for (ids, _, future), output in zip(batch, outputs, strict=True):
                try:
                    future.set_result(generation_from_output(ids, output))
                except PolicyError as exc:
                    future.set_exception(exc)

    async def aclose(self) -> None:
        self._worker.shutdown(wait=False)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm")
