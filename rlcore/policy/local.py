"""The local transformers engine: any Hugging Face causal LM as a `Policy`, with concurrent
requests batched into one generation.

Rollouts call `await engine.generate(...)` many at a time. Each call renders its prompt
with the model's chat template and queues it; a background task on the event loop takes
everything queued (up to `max_batch_size`) and runs one batched generation on the engine's
worker thread, so the loop keeps collecting the next batch meanwhile. Temperature, top-p,
max_tokens and seed are per row, so requests with different sampling settings still share
a batch. The worker thread lives as long as the engine: on CUDA the first generation in a
new thread pays about two seconds of set-up, which a thread per batch would pay each time.

Generation is a hand-written KV-cache sampling loop rather than `model.generate`. In steady
state the two run at the same speed (bench/local_engine.py measures both, on CPU and GPU);
the loop is chosen because it takes per-row sampling settings in one batch, drops finished
rows as it goes, and computes each token's logprob as it samples, where generate's
`output_logits` would keep every step's full logits (steps x rows x vocabulary floats:
gigabytes for a 150k vocabulary). It returns what a trainer needs: the exact prompt ids,
the sampled ids including the final eos (so a policy learns to stop), and each sampled
token's log-probability under the temperature-scaled distribution it was drawn from.

On a GPU that loop is Python- and launch-bound (a few milliseconds a token whatever the
batch), so there generation goes through `StaticDecoder` (rlcore/policy/static_decode.py):
a preallocated KV cache and the decode step replayed as a CUDA graph, same outputs. The
CPU keeps the loop here, and so does any architecture the static decoder does not cover.
`decode=` picks explicitly ("static" on a CPU runs the static code eagerly, for tests).
"""

from __future__ import annotations

import asyncio
import inspect
import re
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlcore.policy.base import ContextExceeded, Policy, PolicyError, StopRequested
from rlcore.policy.kv_cache import DEFAULT_MAX_BYTES, PrefixCache, growing_cache, plain_layers
from rlcore.policy.prompts import PrefixTokenizer, PromptRenderer, plain_fast_decode
from rlcore.policy.static_decode import (
    DecodeRequest,
    StaticDecoder,
    sample_tokens,
    unsupported_reason,
)
from rlcore.types import Generation, Message, SamplingParams

# The batch size a dynamic-loop generation shrinks in steps of as rows finish.
ROW_BUCKET = 8
# Default batch caps: on a GPU one step of a large RL batch (1,024 tic-tac-toe games) is
# served in one batch, which costs little more than 64 rows there; a CPU's step costs in
# proportion to its rows, so it keeps smaller batches.
MAX_BATCH_GPU = 1024
MAX_BATCH_CPU = 64
# Below this many parameters a GPU prefills a whole prompt faster than the prefix store
# finds and copies its stored part: the tiny model's 1,024-game tic-tac-toe step rolled out
# ~0.1 s faster without the store on an H100, its 64-game step ~0.03 s (three pairs each,
# docs/BENCHMARKS.md). A 0.5 B model's prefill of the same prompts costs tenths of a second.
GPU_PREFIX_STORE_MIN_PARAMETERS = 50_000_000
DECODE_LOOPS = ("auto", "static", "dynamic")
# A Hugging Face hub id: "name" or "owner/name", letters, digits, dots, dashes, underscores.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


@dataclass
class _Request:
    text: str  # the rendered prompt; tokenized with its batch
    sampling: SamplingParams
    future: asyncio.Future
    # Called on the engine's thread with each token id and logprob as it is sampled.
    on_token: Callable[[int, float], None] | None = None
    prompt_ids: list[int] = field(default_factory=list)
    max_new_tokens: int = 0


class _LoopQueue:
    """Requests waiting on one event loop, and the task that drains them."""

    def __init__(self) -> None:
        self.pending: list[_Request] = []
        self.drainer: asyncio.Task | None = None


def _on_loop(loop: asyncio.AbstractEventLoop, callback: Callable[[int, float], None]):
    """`callback`, called from another thread, runs on `loop` (where its caller awaits)."""

    def call(token: int, logprob: float) -> None:
        loop.call_soon_threadsafe(callback, token, logprob)

    return call


def default_prefix_bytes(model, gpu: str | None, sharers: int = 1) -> int:
    """The prefix store's bound when none is given: DEFAULT_MAX_BYTES where the dynamic loop
    runs; on `gpu` (the static decoder) a quarter of the card's memory split among the
    processes sharing it, or no store for a model too small to gain from one."""
    if gpu is None:
        return DEFAULT_MAX_BYTES
    if sum(p.numel() for p in model.parameters()) < GPU_PREFIX_STORE_MIN_PARAMETERS:
        return 0
    import torch

    total = torch.cuda.get_device_properties(torch.device(gpu)).total_memory
    return total // 4 // max(sharers, 1)


def resolve_device(device: str) -> str:
    """'auto' -> 'cuda' when a GPU is visible, else 'cpu'; checks explicit names."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" or re.fullmatch(r"cuda(:\d+)?", device or ""):
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise PolicyError(f"device {device!r} requested but no CUDA GPU is visible; use 'cpu'")
        return device
    raise PolicyError(f"unknown device {device!r}; accepted: auto, cpu, cuda, cuda:N")


def _load_pretrained(path: str, device: str):
    """Model and tokenizer from a local directory or hub id, or a PolicyError saying why not."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    location = Path(path).expanduser()
    if location.exists():
        if not (location / "config.json").is_file():
            raise PolicyError(
                f"model path {str(location)!r} is not a Hugging Face model directory (no "
                "config.json); accepted: a directory written by save_pretrained, a hub id, "
                "or 'tiny'"
            )
        source = str(location)
    elif _HUB_ID.match(path):
        source = path
    else:
        raise PolicyError(
            f"model path {path!r} does not exist; accepted: a Hugging Face model directory, "
            "a hub id such as 'Qwen/Qwen2.5-0.5B-Instruct', or 'tiny'"
        )
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    except (OSError, ValueError, KeyError) as exc:
        raise PolicyError(f"could not load model {path!r}: {type(exc).__name__}: {exc}") from exc
    return model.to(device), tokenizer


class LocalEngine(Policy):
    """A transformers causal LM that batches concurrent `generate` calls.

    Give `path` (a model directory or hub id) or the live `model` and `tokenizer` objects
    (the RL trainer shares its model so rollouts always sample the current weights).
    `should_stop`, when given, is asked before every sampled token (from the worker
    thread): once it says True the batch is abandoned and each of its requests fails with
    StopRequested, so a cancelled run does not wait for a long generation to finish.
    `batches_run`, `requests_served` and `tokens_generated` count the work done.
    `decode`: "auto" (the static decoder on CUDA when the architecture allows, else the
    dynamic loop), "static" or "dynamic". `max_batch_size` None: 1024 with the static
    decoder on a GPU, 64 otherwise. `prefix_cache_bytes`: what the engine may keep of
    earlier prompts and replies to start later ones from (kv_cache.py); 0 turns it off, None
    is 512 MiB for the dynamic loop and a quarter of the GPU's memory for the static decoder
    (a step of 1,024 tic-tac-toe games keeps ~3 GB of the tiny model's keys and values),
    divided among `gpu_sharers` engines (the processes of a run that share the GPU).
    """

    def __init__(
        self,
        path: str | None = None,
        *,
        device: str = "auto",
        name: str | None = None,
        model: Any = None,
        tokenizer: Any = None,
        max_batch_size: int | None = None,
        should_stop: Callable[[], bool] | None = None,
        decode: str = "auto",
        prefix_cache_bytes: int | None = None,
        gpu_sharers: int = 1,
    ):
        if max_batch_size is not None and max_batch_size < 1:
            raise PolicyError(f"max_batch_size must be at least 1, got {max_batch_size}")
        if decode not in DECODE_LOOPS:
            raise PolicyError(f"decode must be one of {', '.join(DECODE_LOOPS)}; got {decode!r}")
        if model is not None or tokenizer is not None:
            if model is None or tokenizer is None:
                raise PolicyError("pass both model= and tokenizer= (or a path), not only one")
            self.model, self.tokenizer = model, tokenizer
            # A shared model stays where its owner put it unless a device is named.
            self.device = (
                str(next(model.parameters()).device) if device == "auto" else resolve_device(device)
            )
            if device != "auto":
                self.model.to(self.device)
        elif path is None:
            raise PolicyError("LocalEngine needs a model path or hub id, or model= and tokenizer=")
        else:
            self.device = resolve_device(device)
            self.model, self.tokenizer = _load_pretrained(path, self.device)
        if not getattr(self.tokenizer, "chat_template", None):
            raise PolicyError(
                f"the tokenizer of {path or 'the given model'!r} has no chat template; accepted: "
                "a chat/instruct checkpoint whose tokenizer_config.json has chat_template"
            )
        self.name = name or (Path(path).name if path else None) or "local"
        self.path = path
        self.should_stop = should_stop
        self.eos_token_ids = self._stop_token_ids()
        self.pad_token_id = (
            self.tokenizer.pad_token_id
            if self.tokenizer.pad_token_id is not None
            else min(self.eos_token_ids)
        )
        self.context_length = getattr(self.model.config, "max_position_embeddings", None)
        # transformers 5 renamed the forward argument `past_key_values` to `cache`.
        forward_params = inspect.signature(self.model.forward).parameters
        self._cache_argument = "cache" if "cache" in forward_params else "past_key_values"
        on_gpu = self.device.startswith("cuda")
        reason = unsupported_reason(self.model)
        if decode == "static" and reason is not None:
            raise PolicyError(f"decode='static' cannot run {self.name!r}: {reason}")
        if decode == "auto":
            decode = "static" if on_gpu and reason is None else "dynamic"
        self.decode = decode
        self._static: StaticDecoder | None = None
        self._plain_layers = decode == "dynamic" and plain_layers(self.model.config)
        if prefix_cache_bytes is None:
            prefix_cache_bytes = default_prefix_bytes(
                self.model, self.device if decode == "static" and on_gpu else None, gpu_sharers
            )
        self.prefix_cache = (
            PrefixCache(prefix_cache_bytes)
            if prefix_cache_bytes > 0 and (self._plain_layers or decode == "static")
            else None
        )
        if max_batch_size is None:
            max_batch_size = MAX_BATCH_GPU if on_gpu and decode == "static" else MAX_BATCH_CPU
        self.max_batch_size = max_batch_size
        # Keep the text and ids of earlier prompts: enough for every conversation of a few
        # batches to find its previous turn's.
        kept = max(8192, 4 * max_batch_size)
        self._renderer = PromptRenderer(self.tokenizer, max_entries=kept)
        self._prompt_tokenizer = PrefixTokenizer(self.tokenizer, max_entries=kept)
        self._batch_decode = plain_fast_decode(self.tokenizer)
        self._generation_lock = threading.Lock()
        self._worker: ThreadPoolExecutor | None = None
        self._queues: dict[asyncio.AbstractEventLoop, _LoopQueue] = {}
        self.batches_run = 0
        self.requests_served = 0
        self.tokens_generated = 0

    async def aclose(self) -> None:
        """Stop the worker thread (a later `generate` starts a new one); the model stays."""
        if self._worker is not None:
            self._worker.shutdown(wait=False)
            self._worker = None

    def _stop_token_ids(self) -> set[int]:
        """Every id that ends a reply: the tokenizer's eos, the generation config's eos
        (Qwen's lists two), and <|im_end|> when the vocabulary has it (ChatML turns end there)."""
        ids: set[int] = set()
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        generation_config = getattr(self.model, "generation_config", None)
        configured = getattr(generation_config, "eos_token_id", None)
        if isinstance(configured, int):
            ids.add(configured)
        elif configured:
            ids.update(int(i) for i in configured)
        im_end = self.tokenizer.get_vocab().get("<|im_end|>")
        if im_end is not None:
            ids.add(int(im_end))
        if not ids:
            raise PolicyError(
                f"model {self.name!r} has no eos token; cannot tell where a reply ends"
            )
        return ids

    # -- prompts ---------------------------------------------------------------------------
    def render_prompt(self, messages: list[Message], tools: list[dict] | None = None) -> str:
        """The chat template's text of `messages`, with a generation prompt (rendering only
        what a conversation gained since an earlier prompt, where the template allows:
        prompts.py)."""
        try:
            return self._renderer.render(messages, tools)
        except Exception as exc:  # jinja raises many kinds; the caller needs the message
            raise PolicyError(
                f"chat template of {self.name!r} failed on these messages: "
                f"{type(exc).__name__}: {exc}"
            ) from exc

    def encode_prompt(self, messages: list[Message], tools: list[dict] | None = None) -> list[int]:
        """The ids the model is conditioned on: the chat template with a generation prompt."""
        return list(
            self.tokenizer(self.render_prompt(messages, tools), add_special_tokens=False)[
                "input_ids"
            ]
        )

    def _room(self, prompt_ids: list[int], sampling: SamplingParams) -> int:
        """How many tokens the reply may have, or ContextExceeded."""
        if not self.context_length:
            return sampling.max_tokens
        room = self.context_length - len(prompt_ids)
        if room < 1:
            raise ContextExceeded(
                f"prompt is {len(prompt_ids)} tokens but {self.name!r} has a context of "
                f"{self.context_length}; shorten the conversation or use a longer-context model"
            )
        return min(sampling.max_tokens, room)

    def _check_sampling(self, sampling: SamplingParams) -> None:
        if not sampling.temperature >= 0:
            raise PolicyError(f"temperature must be >= 0 (0 = greedy), got {sampling.temperature}")
        if not 0 < sampling.top_p <= 1:
            raise PolicyError(f"top_p must be in (0, 1], got {sampling.top_p}")
        if sampling.max_tokens < 1:
            raise PolicyError(f"max_tokens must be at least 1, got {sampling.max_tokens}")

    def prepare(
        self, messages: list[Message], sampling: SamplingParams, tools: list[dict] | None = None
    ) -> tuple[list[int], int]:
        """The prompt's ids and how many tokens the reply may have, or the PolicyError
        (ContextExceeded for a prompt the context cannot hold) saying why not."""
        self._check_sampling(sampling)
        prompt_ids = self.encode_prompt(messages, tools)
        max_new_tokens = self._room(prompt_ids, sampling)
        return prompt_ids, max_new_tokens

    # -- the asyncio side ------------------------------------------------------------------
    async def generate(
        self,
        messages: list[Message],
        sampling: SamplingParams,
        *,
        tools: list[dict] | None = None,
        state: dict | None = None,
        on_token: Callable[[int, float], None] | None = None,
    ) -> Generation:
        """The reply to `messages`. `on_token(token_id, logprob)`, when given, is called on
        the caller's event loop with each token as the dynamic loop samples it (the static
        decoder hands over a reply's tokens together, when the reply is done)."""
        self._check_sampling(sampling)
        # Rendered here, tokenized with the rest of its batch on the engine's thread (one
        # call for the batch; per prompt it was most of a large batch's host time).
        text = self.render_prompt(messages, tools)
        loop = asyncio.get_running_loop()
        request = _Request(
            text,
            sampling,
            loop.create_future(),
            None if on_token is None else _on_loop(loop, on_token),
        )
        queue = self._queues.setdefault(loop, _LoopQueue())
        queue.pending.append(request)
        if queue.drainer is None or queue.drainer.done():
            queue.drainer = loop.create_task(self._drain(loop, queue))
        return await request.future

    async def _drain(self, loop: asyncio.AbstractEventLoop, queue: _LoopQueue) -> None:
        """Run batches until nothing is queued on this loop."""
        try:
            while queue.pending:
                await self._let_arrivals_gather(queue)
                batch = [r for r in queue.pending[: self.max_batch_size] if not r.future.done()]
                del queue.pending[: self.max_batch_size]
                if not batch:
                    continue
                if self._worker is None:
                    self._worker = ThreadPoolExecutor(1, thread_name_prefix=f"engine-{self.name}")
                try:
                    generations = await loop.run_in_executor(self._worker, self._run_batch, batch)
                except Exception as exc:  # every caller in the batch must hear about it
                    error = (
                        exc
                        if isinstance(exc, PolicyError)
                        else PolicyError(
                            f"local engine {self.name!r} failed on a batch of {len(batch)}: "
                            f"{type(exc).__name__}: {exc}"
                        )
                    )
                    for request in batch:
                        if not request.future.done():
                            request.future.set_exception(error)
                    continue
                for request, generation in zip(batch, generations, strict=True):
                    if request.future.done():
                        continue
                    if isinstance(generation, PolicyError):  # this request's own error
                        request.future.set_exception(generation)
                    else:
                        request.future.set_result(generation)
        finally:
            if not queue.pending:
                self._queues.pop(loop, None)

    @staticmethod
    async def _let_arrivals_gather(queue: _LoopQueue) -> None:
        """Yield to the loop until no new request arrives in a round: rollouts started
        together (or woken together by the previous batch) all join this batch."""
        for _ in range(8):
            waiting = len(queue.pending)
            await asyncio.sleep(0)
            if len(queue.pending) == waiting:
                return

    # -- the torch side --------------------------------------------------------------------
    def _run_batch(self, batch: list[_Request]) -> list[Generation | PolicyError]:
        """One batched generation (blocking; runs on the worker thread): the batch's prompts
        tokenized in one call (reusing the ids of earlier prompts they extend: prompts.py),
        then generated together, one batch at a time (the model and its memory are shared
        with whoever else holds this engine). A request whose prompt
        the context cannot hold gets its ContextExceeded in its place and is not generated."""
        import torch

        tokenized = self._prompt_tokenizer.encode([r.text for r in batch])
        results: list[Generation | PolicyError | None] = [None] * len(batch)
        requests = []
        for index, (request, ids) in enumerate(zip(batch, tokenized, strict=True)):
            request.prompt_ids = ids
            try:
                request.max_new_tokens = self._room(request.prompt_ids, request.sampling)
            except ContextExceeded as exc:
                results[index] = exc
                continue
            requests.append(request)
        if not requests:
            return results
        with self._generation_lock:
            was_training = self.model.training
            self.model.eval()
            try:
                with torch.no_grad():
                    completions = self._sample(requests)
            finally:
                self.model.train(was_training)
            self.batches_run += 1
            self.requests_served += len(requests)
            self.tokens_generated += sum(len(ids) for ids, _, _ in completions)
        generations = iter(zip(completions, self._decode_replies(completions), strict=True))
        for index, request in enumerate(batch):
            if results[index] is not None:
                continue
            (completion_ids, logprobs, finish_reason), text = next(generations)
            results[index] = Generation(
                text=text,
                finish_reason=finish_reason,
                prompt_ids=request.prompt_ids,
                completion_ids=completion_ids,
                logprobs=logprobs,
                prompt_tokens=len(request.prompt_ids),
                completion_tokens=len(completion_ids),
            )
        return results

    def _decode_replies(self, completions) -> list[str]:
        """Each completion's text, special tokens skipped: `tokenizer.decode` of each, in
        one call to the fast tokenizer's batch decoder where decode does nothing more
        (no space clean-up, no decode of the tokenizer's own), which skips transformers'
        per-token type checks."""
        ids = [completion_ids for completion_ids, _, _ in completions]
        if self._batch_decode:
            return self.tokenizer.backend_tokenizer.decode_batch(ids, skip_special_tokens=True)
        return [self.tokenizer.decode(reply, skip_special_tokens=True) for reply in ids]

    def _forward(self, input_ids, attention_mask, position_ids, cache):
        output = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_argument: cache},
        )
        return output.logits[:, -1, :].float()

    def _sample(self, requests: list[_Request]) -> list[tuple[list[int], list[float], str]]:
        """(completion ids, logprobs, finish reason) per request, from the engine's loop."""
        if self.decode == "dynamic":
            return self._sample_dynamic(requests)
        if self._static is None:
            self._static = StaticDecoder(
                self.model,
                self.eos_token_ids,
                self.pad_token_id,
                use_graphs=self.device.startswith("cuda"),
                prefixes=self.prefix_cache,
            )
        rows = [
            DecodeRequest(
                r.prompt_ids,
                r.sampling.temperature,
                r.sampling.top_p,
                r.sampling.seed,
                r.max_new_tokens,
            )
            for r in requests
        ]
        results = self._static.generate(rows, self.should_stop)
        for request, (ids, token_logprobs, _) in zip(requests, results, strict=True):
            if request.on_token is not None:  # a graph's tokens arrive when the reply is done
                for token, logprob in zip(ids, token_logprobs, strict=True):
                    request.on_token(token, logprob)
        return results

    def _sample_dynamic(self, requests: list[_Request]) -> list[tuple[list[int], list[float], str]]:
        """The KV-cache sampling loop over a left-padded batch; finished rows leave the batch.
        Each row's cache starts from the longest stored prefix of its prompt (see
        kv_cache.py): the batch's columns are [cached prefix | prompt rest | replies],
        each part left-padded per row, the padding masked out."""
        import torch
        from transformers import DynamicCache

        device = self.device
        batch_size = len(requests)
        if self.prefix_cache is not None:
            self.prefix_cache.check_weights(self.model)
            prefixes = self.prefix_cache.lookup_many([r.prompt_ids for r in requests])
        else:
            prefixes = [(None, 0)] * batch_size
        cached = max(reused for _, reused in prefixes)
        rests = [r.prompt_ids[reused:] for r, (_, reused) in zip(requests, prefixes, strict=True)]
        longest = max(len(rest) for rest in rests)
        prompt_columns = cached + longest
        input_ids = torch.full((batch_size, longest), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((batch_size, prompt_columns), dtype=torch.long)
        for row, (rest, (_, reused)) in enumerate(zip(rests, prefixes, strict=True)):
            input_ids[row, longest - len(rest) :] = torch.tensor(rest)
            attention_mask[row, cached - reused : cached] = 1
            attention_mask[row, prompt_columns - len(rest) :] = 1
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)[:, cached:]
        temperature = torch.tensor([r.sampling.temperature for r in requests], device=device)
        # No nucleus work (a sort per step) unless some request asks for it.
        top_p = (
            torch.tensor([r.sampling.top_p for r in requests], device=device)
            if any(r.sampling.top_p < 1 for r in requests)
            else None
        )
        generators = [self._row_generator(r.sampling.seed) for r in requests]
        eos = torch.tensor(sorted(self.eos_token_ids), device=device)
        shrink_at = 0.75 if device == "cpu" else 0.5

        # Rows with the same prompt (a group's first turn: its rollouts start from one
        # example) are prefilled once; the copies take its keys, values and logits.
        seen: dict[tuple[int, ...], int] = {}  # prompt -> its index among the distinct ones
        firsts: list[int] = []  # each distinct prompt's first row
        copy_of: list[int] = []  # each row's distinct prompt
        for row, request in enumerate(requests):
            key = tuple(request.prompt_ids)
            if key not in seen:
                seen[key] = len(firsts)
                firsts.append(row)
            copy_of.append(seen[key])
        if self._plain_layers:
            prefix = (
                self._cached_keys_values([prefixes[row] for row in firsts], cached)
                if cached
                else None
            )
            cache = growing_cache(self.model.config, prefix)
        else:
            cache = DynamicCache(config=self.model.config)
        if len(firsts) < batch_size:
            pick = torch.tensor(firsts, device=device)
            logits = self._forward(input_ids[pick], attention_mask[pick], position_ids[pick], cache)
            spread = torch.tensor(copy_of, device=device)
            cache.batch_select_indices(spread)
            logits = logits[spread]
        else:
            logits = self._forward(input_ids, attention_mask, position_ids, cache)
        next_position = position_ids[:, -1:] + 1
        rows = list(range(batch_size))  # batch row -> request index
        finished = [False] * batch_size
        sampled: list[list[int]] = [[] for _ in requests]
        logprobs: list[list[float]] = [[] for _ in requests]
        finish: list[str] = ["length"] * batch_size

        def remember(batch_rows: list[int]) -> None:
            """Store these rows' prompts and replies (all but the last token: never fed)."""
            if self.prefix_cache is None:
                return
            tokens, kvs = [], []
            for batch_row in batch_rows:
                index = rows[batch_row]
                fed = len(sampled[index]) - 1
                columns = torch.cat(
                    [
                        attention_mask[batch_row, :prompt_columns].nonzero().squeeze(-1),
                        torch.arange(prompt_columns, prompt_columns + fed, device=device),
                    ]
                )
                tokens.append(requests[index].prompt_ids + sampled[index][:fed])
                kvs.append(
                    [
                        (layer.keys[batch_row][:, columns], layer.values[batch_row][:, columns])
                        for layer in cache.layers
                    ]
                )
            self.prefix_cache.add_many(tokens, kvs)

        while True:
            if self.should_stop is not None and self.should_stop():
                raise StopRequested(
                    f"stop requested: generation of {batch_size} replies abandoned after "
                    f"{max(len(ids) for ids in sampled)} tokens"
                )
            tokens, token_logprobs = sample_tokens(
                logits, temperature, top_p, draw_uniforms([generators[i] for i in rows], device)
            )
            # One device-to-host copy per step: on a GPU every sync costs a round trip.
            step = torch.stack(
                [tokens.double(), token_logprobs.double(), torch.isin(tokens, eos).double()]
            ).tolist()
            for request_index, token, logprob, stopped in zip(rows, *step, strict=True):
                if finished[request_index]:
                    continue
                sampled[request_index].append(int(token))
                logprobs[request_index].append(logprob)
                if requests[request_index].on_token is not None:
                    requests[request_index].on_token(int(token), logprob)
                if stopped:
                    finish[request_index] = "stop"
                    finished[request_index] = True
                elif len(sampled[request_index]) >= requests[request_index].max_new_tokens:
                    finished[request_index] = True
            live = [batch_row for batch_row, i in enumerate(rows) if not finished[i]]
            if not live:
                remember(list(range(len(rows))))
                break
            # Finished rows ride along (their samples ignored) until dropping them shrinks the
            # batch enough to pay for copying the whole cache: by a quarter on CPU, where a
            # step costs in proportion to its rows, by half on GPU, where a small batch's step
            # costs about the same at any size. The batch shrinks to a multiple of 8 (topped
            # up with riders) so few distinct shapes occur: CUDA pays a first-use cost for
            # each new matrix shape.
            bucket = -(-len(live) // ROW_BUCKET) * ROW_BUCKET
            if bucket <= len(rows) * shrink_at:
                riders = [batch_row for batch_row, i in enumerate(rows) if finished[i]]
                keep = sorted(live + riders[: bucket - len(live)])
                remember(riders[bucket - len(live) :])
                index = torch.tensor(keep, device=device)
                cache.batch_select_indices(index)
                tokens, attention_mask, next_position = (
                    tokens[index],
                    attention_mask[index],
                    next_position[index],
                )
                temperature = temperature[index]
                top_p = top_p[index] if top_p is not None else None
                rows = [rows[batch_row] for batch_row in keep]
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones((len(rows), 1))], 1)
            logits = self._forward(tokens[:, None], attention_mask, next_position, cache)
            next_position = next_position + 1
        return [(sampled[i], logprobs[i], finish[i]) for i in range(batch_size)]

    def _cached_keys_values(self, prefixes, cached: int) -> list[tuple]:
        """Per layer, the batch's keys and values for its first `cached` columns: each row's
        reused prefix right-aligned, zeros (masked) before it."""
        import torch

        layers = []
        first = next(entry for entry, _ in prefixes if entry is not None)
        for layer, (like, _) in enumerate(first.kv):
            keys = like.new_zeros((len(prefixes), like.shape[0], cached, like.shape[2]))
            values = torch.zeros_like(keys)
            for row, (entry, reused) in enumerate(prefixes):
                if entry is not None:
                    keys[row, :, cached - reused :] = entry.kv[layer][0][:, :reused]
                    values[row, :, cached - reused :] = entry.kv[layer][1][:, :reused]
            layers.append((keys, values))
        return layers

    def _row_generator(self, seed: int | None):
        """A private generator for a seeded request, so its draws do not depend on which
        other requests share its batch; unseeded rows use torch's global generator."""
        import torch

        if seed is None:
            return None
        generator = torch.Generator(device=self.device)
        generator.manual_seed(int(seed))
        return generator


def draw_uniforms(generators, device):
    """One uniform per row: from the row's own generator when it has one (a seeded
    request), else from torch's global generator."""
    import torch

    uniforms = torch.rand(len(generators), device=device)
    for row, generator in enumerate(generators):
        if generator is not None:
            uniforms[row] = torch.rand(1, generator=generator, device=device)[0]
    return uniforms
