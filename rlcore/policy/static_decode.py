"""Decoding without launch overhead: a static KV cache and the per-token step captured as a
CUDA graph, for the local engine on a GPU.

The engine's dynamic loop (`LocalEngine._sample_dynamic`) calls the model's forward once
per token: a dozen kernel launches per layer plus Python, a few milliseconds a step
whatever the batch, where a small model's work takes microseconds. Here the KV cache is
preallocated ([rows, kv heads, length, head dim] per layer), prompts are left-padded to one
length so every row writes its next token to the same slot, and one decode step (forward,
sampling, bookkeeping, all on the device) is captured once per (row bucket, length bucket,
nucleus on/off) and replayed. Finished rows stay in the batch, masked, until the live ones
fit a smaller row bucket; the host reads the device only every `CHECK_EVERY` steps.
A prefix every prompt of a round begins with (a system turn) is prefilled once and copied
to the other rows, where that saves more arithmetic than the extra prefill costs.

Sampling takes its uniforms from a counter-based hash of (row seed, token index), so a
seeded request draws the same tokens whatever shares its batch, with no generator object
per row (a graph cannot hold one). Greedy rows take the argmax as the dynamic loop does,
and every token's logprob is the log-softmax of the temperature-scaled logits, the same
`sample_tokens` arithmetic (on CUDA with Triton, rows without a nucleus are drawn by
decode_kernels' two sampling kernels: the same draw up to float32 rounding at a token's
bound).

The forward is written out over the model's own submodules (embeddings, norms,
projections, MLPs) for the Llama family without sliding windows (llama, mistral, qwen2,
qwen3), so the graphs read the trainer's parameters in place: an optimizer step is seen by
the next generation without re-capture (a parameter that moved to new memory drops the
graphs). A captured step is bound by its kernel count, not its bytes, so the decode step
takes few kernels a layer: q, k and v projected by one matrix and gate and up by another
(copies of the layer's weights, refreshed in place before each generation), one fused
RMSNorm, the rotary embedding from a table (attention's scaling folded into the query's
rows) applied to queries and keys at once, residual additions inside the output
projections' matrix products, and the attention mask an additive bias; on CUDA with
Triton, two fused kernels (decode_kernels) take the rotary embedding with the cache writes
and the silu gate, in the step and in the prefill, and attention reads the cache only up to
the step's slot (the graph's length bucket is an upper bound). Other architectures keep the
dynamic loop. Without CUDA the same code
runs eagerly, which is how the CPU tests check it against the dynamic loop.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from rlcore.policy import decode_kernels
from rlcore.policy.base import StopRequested
from rlcore.policy.kv_cache import PrefixCache, PrefixEntry, common_prefix

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# Row counts a graph is captured for: a batch runs in the smallest bucket that holds it, so
# a handful of graphs cover every batch size (beyond the last, multiples of 256).
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
# Attention reads the cache up to the next multiple of this many slots, not all of it.
LENGTH_STEP = 128
# Decode steps between two looks at the device (finished rows, stop requests).
CHECK_EVERY = 8
# Prompt tokens (rows x length) in one prefill chunk, bounding its activations.
PREFILL_TOKENS = 1 << 16
# The MLP's down projection in this many slices of its reduction, run side by side (a
# batched product) and summed by the next norm's kernel, where a step has at least
# SPLIT_ROWS rows and each slice is still at least SPLIT_DEPTH deep: its output is narrow
# (the hidden size) and its reduction deep (the MLP's width), so one product leaves most of
# the card idle (0.5 B model, 256 rows, H100: 9.3 us as one product, 5.8 us in 4 slices;
# the tiny model's shallow products were slower sliced: 0.37 -> 0.44 ms a step).
SPLIT = 4
SPLIT_ROWS = 64
SPLIT_DEPTH = 1024
# A round's prompts that all begin with the same tokens (a system prompt, a group's shared
# example) prefill them once, in one row, and copy its keys and values to the others, where
# that saves at least this many floating-point operations: about what the extra one-row
# prefill costs in launches (a 0.5 B model's ~15 kernels a layer over 24 layers, ~1.8 ms on an
# H100, against its products at ~560 TFLOP/s). The tiny model's prefill is launch-bound on a
# card, so it never shares (a shared 200-token prompt over 1,024 rows saves 0.5 TFLOP).
SHARED_PREFILL_FLOPS = 1e12
# Tokens per block of the two-level draw over large vocabularies (inverse_cdf).
SAMPLE_BLOCK = 128
# Share of the free GPU memory a generation's static buffers may take; larger batches are
# served in several rounds.
MEMORY_SHARE = 0.5
_MASK32 = 0xFFFFFFFF


def row_bucket(rows: int) -> int:
    """The smallest row bucket holding `rows`."""
    for bucket in ROW_BUCKETS:
        if rows <= bucket:
            return bucket
    return -(-rows // 256) * 256


def length_bucket(slots: int, capacity: int) -> int:
    """How many cache slots attention reads when `slots` are in use."""
    return min(capacity, -(-slots // LENGTH_STEP) * LENGTH_STEP)


def unsupported_reason(model) -> str | None:
    """Why the static decoder cannot run `model` (None: it can)."""
    config = model.config
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        return f"model type {config.model_type!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
    if getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None):
        return "sliding-window attention"
    layer_types = getattr(config, "layer_types", None) or []
    if any(kind != "full_attention" for kind in layer_types):
        return f"layer types {sorted(set(layer_types))}"
    inner = getattr(model, "model", None)
    if not all(hasattr(inner, name) for name in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return "not a decoder of the Llama layout (model.embed_tokens, layers, norm, rotary_emb)"
    rope = getattr(inner.rotary_emb, "rope_type", "default")
    if rope in ("dynamic", "longrope"):
        return f"rope type {rope!r} (its frequencies depend on the sequence length)"
    return None


def _fmix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer on int64 values below 2**32 (products stay below 2**63)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _MASK32
    return x ^ (x >> 16)


def counter_uniforms(seeds: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """One uniform in [0, 1) per row, a pure function of (row seed, counter): float32 with
    24 random bits, the same on CPU and GPU."""
    low, high = seeds & _MASK32, (seeds >> 32) & _MASK32
    mixed = _fmix(low ^ _fmix(high ^ _fmix((counter + 0x9E3779B9) & _MASK32)))
    return (mixed >> 8).to(torch.float32) * (1.0 / (1 << 24))


def inverse_cdf(probabilities: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row ([rows, 1]), the first token whose cumulative probability exceeds the row's
    uniform times the row's total. A vocabulary of many blocks of SAMPLE_BLOCK tokens is
    searched in two levels, block totals then one block's tokens, so no full-width
    cumulative sum is written (over 151,936 tokens at 256 rows the sum alone took 0.3 ms of
    a 3 ms decode step on an H200); the same draw up to float rounding."""
    rows, vocab = probabilities.shape
    if vocab % SAMPLE_BLOCK or vocab < 64 * SAMPLE_BLOCK:
        cumulative = probabilities.cumsum(dim=-1)
        targets = (uniforms * cumulative[:, -1])[:, None]
        return torch.searchsorted(cumulative, targets, right=True).clamp(max=vocab - 1)
    blocks = probabilities.view(rows, vocab // SAMPLE_BLOCK, SAMPLE_BLOCK)
    totals = blocks.sum(dim=-1).cumsum(dim=-1)
    targets = (uniforms * totals[:, -1])[:, None]
    block = torch.searchsorted(totals, targets, right=True).clamp(max=totals.shape[1] - 1)
    before = torch.where(block > 0, totals.gather(1, (block - 1).clamp(min=0)), 0.0)
    inside = blocks.gather(1, block[:, :, None].expand(-1, -1, SAMPLE_BLOCK))[:, 0]
    within = torch.searchsorted(inside.cumsum(dim=-1) + before, targets, right=True)
    return block * SAMPLE_BLOCK + within.clamp(max=SAMPLE_BLOCK - 1)


def sample_tokens(logits, temperature, top_p, uniforms, greedy: bool = True):
    """One token per row and its log-probability, given one uniform per row.

    Rows with temperature 0 take the argmax and report the log-softmax of the raw logits;
    the others sample from softmax(logits / temperature) restricted to the top-p nucleus and
    report the log-softmax of the temperature-scaled logits (before the nucleus cut, as
    vLLM does), which is what a trainer's forward pass recomputes. `top_p` None means no
    row uses a nucleus; `greedy` False that no row is greedy (the argmax is skipped). Logits
    of a half-precision model are divided into float32 (`temperature` is float32)."""
    greedy_rows = temperature <= 0
    scale = torch.where(greedy_rows, torch.ones_like(temperature), temperature)
    scaled_logprobs = torch.log_softmax(logits / scale[:, None], dim=-1)
    probabilities = scaled_logprobs.exp()
    if top_p is not None:
        probabilities, order = probabilities.sort(dim=-1, descending=True)
        # Drop a token when the mass before it already reaches top_p (the first always stays).
        outside = (probabilities.cumsum(dim=-1) - probabilities) >= top_p[:, None]
        probabilities = probabilities.masked_fill(outside, 0.0)
    else:
        order = None
    choice = inverse_cdf(probabilities, uniforms)
    tokens = (order.gather(1, choice) if order is not None else choice)[:, 0]
    if greedy:
        tokens = torch.where(greedy_rows, logits.argmax(dim=-1), tokens)
    return tokens, scaled_logprobs.gather(1, tokens[:, None])[:, 0]


@dataclass
class DecodeRequest:
    """One row to generate: its prompt and sampling settings (seed None: drawn from torch's
    global generator, so `torch.manual_seed` still makes a run repeatable)."""

    prompt_ids: list[int]
    temperature: float
    top_p: float
    seed: int | None
    max_new_tokens: int


@dataclass(eq=False)
class _Snapshot:
    """A copy of some rows' keys and values taken when they left the workspace
    ([layers, rows, kv heads, slots, head dim]); prefix-store entries point into it, and it
    lives as long as one of them does."""

    keys: torch.Tensor
    values: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


@dataclass
class _Stored:
    """A prefix-store entry's keys and values: `snapshot` row `row`, from slot `start`."""

    snapshot: _Snapshot
    row: int
    start: int


@dataclass
class _Round:
    """One round's requests and where their rows are: prompts end at slot `prompt` (the
    first reply token's), a row's begins at `first[row]`; `owner[row]` is the request a
    workspace row serves (None: a rider), `results` what was collected so far."""

    requests: list[DecodeRequest]
    prompt: int
    first: torch.Tensor
    owner: list[int | None]
    results: list


class _Workspace:
    """The static buffers one or more graphs read and write: KV cache, attention mask, the
    rotary table, per-row state and outputs. Graphs hold their addresses, so they live as
    long as the workspace does."""

    def __init__(self, rows: int, length: int, layers: int, kv_heads: int, head_dim: int,
                 dtype, device, eos: list[int]):  # fmt: skip
        self.rows, self.length = rows, length
        cache = (layers, rows, kv_heads, length, head_dim)
        # Zeros, not empty: masked slots are multiplied by 0 in attention, and 0 * NaN is NaN.
        self.keys = torch.zeros(cache, dtype=dtype, device=device)
        self.values = torch.zeros(cache, dtype=dtype, device=device)
        # Added to attention scores: 0 where a row's slot holds a token, -inf elsewhere.
        self.mask = torch.full((rows, length), float("-inf"), dtype=dtype, device=device)
        # The round's uniforms, one per row and token (counter_uniforms of its seed).
        self.uniforms = torch.zeros((rows, length), dtype=torch.float32, device=device)
        self.out_tokens = torch.zeros((rows, length), dtype=torch.long, device=device)
        self.out_logprobs = torch.zeros((rows, length), dtype=torch.float32, device=device)
        self.tokens = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.temperature = torch.zeros(rows, dtype=torch.float32, device=device)
        self.top_p = torch.ones(rows, dtype=torch.float32, device=device)
        self.max_new = torch.zeros(rows, dtype=torch.long, device=device)
        self.done = torch.zeros(rows, dtype=torch.bool, device=device)
        self.stopped = torch.zeros(rows, dtype=torch.bool, device=device)
        self.lengths = torch.zeros(rows, dtype=torch.long, device=device)
        self.slot = torch.zeros(1, dtype=torch.long, device=device)  # cache slot written next
        self.step = torch.zeros(1, dtype=torch.long, device=device)  # index of the next token
        self.eos = torch.tensor(sorted(eos), dtype=torch.long, device=device)
        # Rotary cos and sin by position for the query heads then the key heads, set by
        # the decoder ([length, heads + kv heads, head dim]).
        self.rope_cos = self.rope_sin = None

    # What one decode step changes besides the slot it overwrites anyway.
    STATE = ("tokens", "positions", "done", "stopped", "lengths", "slot", "step")
    PER_ROW = ("mask", "uniforms", "out_tokens", "out_logprobs", "tokens", "positions",
               "temperature", "top_p", "max_new", "done", "stopped", "lengths")  # fmt: skip

    def save(self) -> dict:
        return {name: getattr(self, name).clone() for name in self.STATE}

    def restore(self, saved: dict) -> None:
        for name, value in saved.items():
            getattr(self, name).copy_(value)

    def compact(self, keep: torch.Tensor, used_slots: int) -> None:
        """Move rows `keep` to the front, in that order (cache up to `used_slots`)."""
        rows = len(keep)
        for name in self.PER_ROW:
            tensor = getattr(self, name)
            tensor[:rows] = tensor.index_select(0, keep)
        for cache in (self.keys, self.values):
            for layer in cache:  # one layer at a time bounds the temporary copy
                layer[:rows, :, :used_slots] = layer[:, :, :used_slots].index_select(0, keep)


@dataclass
class _FusedLayer:
    """What the decode step reads of one decoder layer besides the layer's own modules:
    its q, k and v projections stacked into one matrix and its gate and up projections
    into another, and where its reduction is deep (`SPLIT`) the down projection's weight as
    [SPLIT, intermediate / SPLIT, hidden] slices of its reduction. Copies:
    `StaticDecoder._check_weights` rewrites them in place before each generation, so graphs
    holding their addresses see the trainer's latest weights."""

    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor | None

    @staticmethod
    def sources(layer) -> tuple[list, list]:
        attention, mlp = layer.self_attn, layer.mlp
        return (
            [attention.q_proj, attention.k_proj, attention.v_proj],
            [mlp.gate_proj, mlp.up_proj],
        )

    @classmethod
    def of(cls, layer, sliced: bool) -> _FusedLayer:
        """The layer's copies; `sliced`: the down projection's too, where it is deep enough
        (the fused kernels' step slices it)."""
        stacked = [_stack(linears) for linears in cls.sources(layer)]
        hidden, intermediate = layer.mlp.down_proj.weight.shape
        down = None
        deep = intermediate % SPLIT == 0 and intermediate // SPLIT >= max(SPLIT_DEPTH, hidden)
        if sliced and deep:
            with torch.no_grad():
                down = _split_reduction(layer.mlp.down_proj.weight).contiguous()
        return cls(*stacked[0], *stacked[1], down)

    def refresh(self, layer) -> None:
        if self.down is not None:
            self.down.copy_(_split_reduction(layer.mlp.down_proj.weight))
        for (weight, bias), linears in zip(
            ((self.qkv, self.qkv_bias), (self.gate_up, self.gate_up_bias)),
            self.sources(layer),
            strict=True,
        ):
            torch.cat([linear.weight for linear in linears], out=weight)
            if bias is not None:
                torch.cat([_bias(linear) for linear in linears], out=bias)


def _split_reduction(weight: torch.Tensor) -> torch.Tensor:
    """A [out, in] weight as SPLIT slices of its input, [SPLIT, in / SPLIT, out] (a view)."""
    out, width = weight.shape
    return weight.view(out, SPLIT, width // SPLIT).permute(1, 2, 0)


def _bias(linear) -> torch.Tensor:
    if linear.bias is not None:
        return linear.bias
    return linear.weight.new_zeros(linear.out_features)


def _stack(linears) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One matrix (and bias, None when no projection has one) for `linears` side by side."""
    with torch.no_grad():
        weight = torch.cat([linear.weight for linear in linears])
        if all(linear.bias is None for linear in linears):
            return weight, None
        return weight, torch.cat([_bias(linear) for linear in linears])


def _rms_norm(norm, hidden: torch.Tensor) -> torch.Tensor:
    """`norm(hidden)` as one fused kernel (the Llama family's RMSNorm)."""
    return F.rms_norm(hidden, norm.weight.shape, norm.weight, norm.variance_epsilon)


def _add_linear(hidden: torch.Tensor, x: torch.Tensor, linear) -> torch.Tensor:
    """hidden + linear(x), the addition inside the matrix product."""
    out = torch.addmm(hidden, x, linear.weight.t())
    return out if linear.bias is None else out.add_(linear.bias)


class StaticDecoder:
    """Batched generation over a static KV cache, the decode step replayed as a CUDA graph
    (`use_graphs`; eager otherwise). `kernels`: the step's rotary/cache writes and silu-gate
    through decode_kernels' fused kernels (None: wherever they can run, i.e. on CUDA with
    Triton installed). `prefixes`: a store of earlier prompts and replies (kv_cache.
    PrefixCache) whose keys and values start later prompts that extend them, so a
    conversation's next turn prefills only what it added. `captures`, `compactions` and
    `rounds` count what it did, for tests and benchmarks."""

    def __init__(self, model, eos_token_ids, pad_token_id: int, *, use_graphs: bool,
                 kernels: bool | None = None, prefixes: PrefixCache | None = None):  # fmt: skip
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"the static decoder cannot run this model: {reason}")
        self.model = model
        self.eos_token_ids = sorted(eos_token_ids)
        self.pad_token_id = pad_token_id
        self.use_graphs = use_graphs
        config = model.config
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        why_not = self._kernels_problem()
        if kernels and why_not:
            raise ValueError(f"the decode kernels cannot run this model: {why_not}")
        self.kernels = why_not is None if kernels is None else kernels
        # The attention kernel where it beat the torch ops (decode_kernels.attention_pays).
        self.kernel_attention = self.kernels and decode_kernels.attention_pays(
            model.dtype, self.heads // self.kv_heads
        )
        self.prefixes = prefixes
        self._snapshots: weakref.WeakSet[_Snapshot] = weakref.WeakSet()  # those still held
        self.workspace: _Workspace | None = None
        self._fused: list[_FusedLayer] = []
        self.graphs: dict[tuple[int, int, bool, bool], torch.cuda.CUDAGraph] = {}
        self._pool = None
        self._weights: tuple | None = None
        # A forward pass's floating-point operations a token, about (2 a parameter).
        self.flops_per_token = 2 * sum(p.numel() for p in model.parameters())
        self.captures = self.compactions = self.rounds = self.shared_prefills = 0

    def _kernels_problem(self) -> str | None:
        """Why decode_kernels cannot serve this model's decode step (None: they can)."""
        config = self.model.config
        if not decode_kernels.available(self.model.model.embed_tokens.weight.device):
            return "Triton is not installed or the model is not on a GPU"
        if not decode_kernels.supported_head_dim(self.head_dim):
            return f"head dim {self.head_dim} (a power of two from 16 is needed)"
        if hasattr(self.model.model.layers[0].self_attn, "q_norm"):
            return "per-head query/key norms (qwen3)"
        if getattr(config, "hidden_act", None) not in ("silu", "swish"):
            return f"activation {getattr(config, 'hidden_act', None)!r} (silu is needed)"
        return None

    # -- the forward, over the model's own modules -------------------------------------
    def _rotated_heads(self, attention, qkv, cos, sin):
        """Queries then keys ([..., heads + kv heads, dim]) of a q/k/v projection `qkv`
        ([..., (heads + 2 kv heads) x dim]), rotated by table rows `cos`/`sin`: x cos +
        roll(x, dim / 2) sin, rotate_half's sign and the queries' scaling in the table."""
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        qk = qkv[..., : (heads + kv_heads) * dim].unflatten(-1, (heads + kv_heads, dim))
        if hasattr(attention, "q_norm"):  # qwen3 normalizes heads before the rotation
            qk = torch.cat(
                (_rms_norm(attention.q_norm, qk[..., :heads, :]),
                 _rms_norm(attention.k_norm, qk[..., heads:, :])), dim=-2,
            )  # fmt: skip
        return torch.addcmul(qk * cos, qk.roll(dim // 2, dims=-1), sin)

    def _prefill(self, ws: _Workspace, start: int, ids, valid, first, width: int,
                 keep: bool):  # fmt: skip
        """Run prompt rows `start:start + len(ids)` into the cache. `ids` (valid mask [B, S])
        are the prompts' last S tokens, left-padded, for slots width - S to width; a row's
        prompt begins at slot `first` ([B]) and its slots before the block already hold
        keys and values (a stored prefix). `keep`: the block's padding slots may hold such
        keys too, so only valid tokens are written. Runs on the decode step's fused
        weights; returns the last position's logits and each row's next position."""
        inner = self.model.model
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        batch, length = ids.shape
        rows = slice(start, start + batch)
        base = width - length
        slots = torch.arange(base, width, device=ids.device)
        positions = (slots[None] - first[:, None]).clamp(min=0)  # [B, S]
        if self.kernels:  # the rotary embedding and the cache writes in one kernel a layer
            block_start = torch.full((1,), base, dtype=torch.long, device=ids.device)
            token_positions, token_valid = positions.flatten(), valid.flatten()
        else:
            cos, sin = ws.rope_cos[positions], ws.rope_sin[positions]  # [B, S, heads + kv, dim]
        cached = torch.arange(width, device=ids.device)
        mask = (cached[None, None] >= first[:, None, None]) & (
            cached[None, None] <= slots[None, :, None]
        )  # [B, S, width]: the row's own slots up to the query's
        # A padding query attends to its own slot alone (never read later), so no row is
        # all -inf.
        mask = (mask & valid[:, :, None]) | (cached[None, None] == slots[None, :, None])
        mask = mask[:, None]
        hidden = inner.embed_tokens(ids).flatten(0, 1)  # [B x S, hidden]
        for index, (layer, fused) in enumerate(zip(inner.layers, self._fused, strict=True)):
            attention = layer.self_attn
            qkv = F.linear(_rms_norm(layer.input_layernorm, hidden), fused.qkv, fused.qkv_bias)
            if self.kernels:
                query = decode_kernels.rope_and_cache(
                    qkv, None, ws.rope_cos, ws.rope_sin, token_positions, block_start,
                    ws.keys[index, rows], ws.values[index, rows], heads, kv_heads,
                    per_row=length, valid=token_valid if keep else None,
                ).view(batch, length, heads, dim).transpose(1, 2)  # fmt: skip
            else:
                qkv = qkv.view(batch, length, -1)
                qk = self._rotated_heads(attention, qkv, cos, sin).transpose(1, 2)
                query, key = qk[:, :heads], qk[:, heads:]
                value = qkv[..., (heads + kv_heads) * dim :].unflatten(-1, (kv_heads, dim))
                value = value.transpose(1, 2)
                for cache, new in ((ws.keys, key), (ws.values, value)):
                    block = cache[index, rows, :, base:width]
                    block.copy_(torch.where(valid[:, None, :, None], new, block) if keep else new)
            out = F.scaled_dot_product_attention(
                query, ws.keys[index, rows, :, :width], ws.values[index, rows, :, :width],
                attn_mask=mask, scale=1.0, enable_gqa=heads != kv_heads,
            )  # fmt: skip
            hidden = _add_linear(
                hidden, out.transpose(1, 2).flatten(0, 1).flatten(1), attention.o_proj
            )
            gate_up = F.linear(
                _rms_norm(layer.post_attention_layernorm, hidden), fused.gate_up, fused.gate_up_bias
            )
            if self.kernels:
                gated = decode_kernels.silu_and_mul(gate_up)
            else:
                gate, up = gate_up.chunk(2, dim=-1)
                gated = layer.mlp.act_fn(gate) * up
            hidden = _add_linear(hidden, gated, layer.mlp.down_proj)
        last = hidden.view(batch, length, -1)[:, -1]
        return self.model.lm_head(_rms_norm(inner.norm, last)), width - first

    def _decode_step(self, ws: _Workspace, rows: int, width: int, nucleus: bool,
                     greedy: bool) -> None:  # fmt: skip
        """One token for the first `rows` rows, attention over the first `width` slots:
        everything read and written lives in `ws` (and the fused weights), so the step can
        be captured and replayed. The layers run as torch ops, as fused kernels, or for
        one row as gemv kernels (decode_kernels)."""
        ws.mask[:rows].index_fill_(1, ws.slot, 0.0)
        hidden = self.model.model.embed_tokens(ws.tokens[:rows])  # the residual stream
        if not self.kernels:
            normed = self._layers_torch(ws, rows, width, hidden)
        elif rows == 1:
            normed = self._layers_one_row(ws, width, hidden)
        else:
            normed = self._layers_fused(ws, rows, width, hidden)
        logits = self.model.lm_head(normed)
        self._sample_and_record(ws, rows, logits, nucleus, greedy)
        ws.positions[:rows].add_(1)
        ws.slot.add_(1)

    def _layers_torch(self, ws: _Workspace, rows: int, width: int, hidden) -> torch.Tensor:
        """The decoder layers as torch ops (the CPU's path); returns the final norm."""
        inner = self.model.model
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        rotated = (heads + kv_heads) * dim
        cos = ws.rope_cos.index_select(0, ws.positions[:rows])
        sin = ws.rope_sin.index_select(0, ws.positions[:rows])
        mask = self._attention_mask(ws, rows, width)
        for index, (layer, fused) in enumerate(zip(inner.layers, self._fused, strict=True)):
            attention, mlp = layer.self_attn, layer.mlp
            qkv = F.linear(_rms_norm(layer.input_layernorm, hidden), fused.qkv, fused.qkv_bias)
            qk = self._rotated_heads(attention, qkv, cos, sin)
            ws.keys[index, :rows].index_copy_(2, ws.slot, qk[:, heads:, None])
            ws.values[index, :rows].index_copy_(
                2, ws.slot, qkv[:, rotated:].view(rows, kv_heads, 1, dim)
            )
            attended = self._attention(ws, index, qk[:, :heads], rows, width, mask)
            hidden = _add_linear(hidden, attended, attention.o_proj)
            gate_up = F.linear(
                _rms_norm(layer.post_attention_layernorm, hidden), fused.gate_up, fused.gate_up_bias
            )
            gate, up = gate_up.chunk(2, dim=-1)
            hidden = _add_linear(hidden, mlp.act_fn(gate) * up, mlp.down_proj)
        return _rms_norm(inner.norm, hidden)

    def _layers_fused(self, ws: _Workspace, rows: int, width: int, hidden) -> torch.Tensor:
        """The layers with decode_kernels' fused kernels around cuBLAS's products: each
        projection's output goes into the stream with its bias, and the new stream is
        normed for the next projection, in one kernel (`hidden` is updated in place)."""
        layers = self.model.model.layers
        mask = self._attention_mask(ws, rows, width)
        normed = _rms_norm(layers[0].input_layernorm, hidden)
        for index, (layer, fused) in enumerate(zip(layers, self._fused, strict=True)):
            attention, mlp = layer.self_attn, layer.mlp
            query = self._rope_and_cache(ws, index, rows, F.linear(normed, fused.qkv), fused)
            attended = self._attention(ws, index, query, rows, width, mask)
            normed = decode_kernels.add_rms_norm(
                F.linear(attended, attention.o_proj.weight), attention.o_proj.bias, hidden,
                layer.post_attention_layernorm,
            )  # fmt: skip
            gated = decode_kernels.silu_and_mul(F.linear(normed, fused.gate_up), fused.gate_up_bias)
            if fused.down is not None and rows >= SPLIT_ROWS:  # [SPLIT, rows, hidden], summed next
                down = torch.bmm(gated.view(rows, SPLIT, -1).transpose(0, 1), fused.down)
            else:
                down = F.linear(gated, mlp.down_proj.weight)
            normed = decode_kernels.add_rms_norm(
                down, mlp.down_proj.bias, hidden, self._norm_after(index)
            )  # fmt: skip
        return normed

    def _layers_one_row(self, ws: _Workspace, width: int, hidden) -> torch.Tensor:
        """One row's layers: each projection a gemv kernel that does the norm or the silu
        gate on its input as it reads it (the q/k/v one the rotary embedding and the cache
        writes on its output, the o one the combining of attention's parts on its input).
        `pending` is the last projection's output (and bias), which the next one adds into
        the stream (a new tensor each time)."""
        layers = self.model.model.layers
        mask = self._attention_mask(ws, 1, width)
        pending = (None, None)
        for index, (layer, fused) in enumerate(zip(layers, self._fused, strict=True)):
            attention, mlp = layer.self_attn, layer.mlp
            query, hidden = decode_kernels.gemv_rope_after_norm(
                fused.qkv, *pending, hidden, layer.input_layernorm, fused.qkv_bias,
                ws.rope_cos, ws.rope_sin, ws.positions[:1], ws.slot, ws.keys[index],
                ws.values[index], self.heads, self.kv_heads,
            )  # fmt: skip
            if self.kernel_attention:  # a split width's parts combined in the o gemv
                attended = decode_kernels.decode_attention(
                    query, ws.keys[index], ws.values[index], ws.mask, width, ws.slot,
                    combine=False,
                )  # fmt: skip
            else:
                attended = self._attention(ws, index, query, 1, width, mask)
            gate_up, hidden = decode_kernels.gemv_after_norm(
                fused.gate_up, decode_kernels.gemv_after_attention(attention.o_proj.weight, attended),
                attention.o_proj.bias, hidden, layer.post_attention_layernorm,
            )  # fmt: skip
            down = decode_kernels.gemv_after_silu(mlp.down_proj.weight, gate_up, fused.gate_up_bias)
            pending = (down, mlp.down_proj.bias)
        return decode_kernels.add_rms_norm(*pending, hidden, self.model.model.norm)

    def _norm_after(self, index: int):
        """The norm the stream gets after layer `index`: the next layer's, or the last."""
        layers = self.model.model.layers
        return (
            self.model.model.norm if index + 1 == len(layers) else layers[index + 1].input_layernorm
        )

    def _rope_and_cache(self, ws: _Workspace, index: int, rows: int, qkv, fused) -> torch.Tensor:
        return decode_kernels.rope_and_cache(
            qkv, fused.qkv_bias, ws.rope_cos, ws.rope_sin, ws.positions[:rows], ws.slot,
            ws.keys[index], ws.values[index], self.heads, self.kv_heads,
        )  # fmt: skip

    def _attention_mask(self, ws: _Workspace, rows: int, width: int) -> torch.Tensor | None:
        """The additive mask of `_attention`'s torch ops, for each (row, kv head) pair: the
        query heads sharing a kv head become that head's "sequence" of queries, so
        grouped-query attention reads each cached key and value once, in two batched
        matrix products (not SDPA: its fused kernels tile for long queries and ran several
        times slower than the bytes allow on one-token queries, H200). None where the
        attention kernel runs."""
        if self.kernel_attention:
            return None
        return ws.mask[:rows, None, :width].repeat_interleave(self.kv_heads, dim=0)

    def _attention(self, ws: _Workspace, index: int, query, rows: int, width: int, mask):
        """Layer `index`'s attention of `query` ([rows, heads, dim]) over the first `width`
        slots: decode_kernels.decode_attention where it pays, else torch ops."""
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        if self.kernel_attention:
            return decode_kernels.decode_attention(
                query, ws.keys[index], ws.values[index], ws.mask, width, ws.slot
            )
        query = query.reshape(rows * kv_heads, heads // kv_heads, dim)
        keys = ws.keys[index, :rows, :, :width].reshape(rows * kv_heads, width, dim)
        values = ws.values[index, :rows, :, :width].reshape(rows * kv_heads, width, dim)
        weights = torch.softmax(torch.baddbmm(mask, query, keys.transpose(1, 2)), dim=-1)
        return torch.bmm(weights, values).view(rows, heads * dim)

    def _sample_and_record(self, ws: _Workspace, rows: int, logits, nucleus: bool,
                           greedy: bool) -> None:  # fmt: skip
        if self.kernels and not nucleus:  # two kernels where torch runs two dozen
            decode_kernels.sample_and_record(logits, ws, rows)
            ws.step.add_(1)
            return
        uniforms = ws.uniforms[:rows].index_select(1, ws.step)[:, 0]
        tokens, logprobs = sample_tokens(
            logits, ws.temperature[:rows], ws.top_p[:rows] if nucleus else None, uniforms, greedy
        )
        ws.out_tokens[:rows].index_copy_(1, ws.step, tokens[:, None])
        ws.out_logprobs[:rows].index_copy_(1, ws.step, logprobs[:, None])
        stop = torch.isin(tokens, ws.eos)
        live = ~ws.done[:rows]
        ws.stopped[:rows].logical_or_(live & stop)
        ws.lengths[:rows].add_(live)  # a row's length: the steps it was live
        ws.done[:rows].logical_or_(stop | (ws.lengths[:rows] >= ws.max_new[:rows]))
        ws.tokens[:rows].copy_(tokens)
        ws.step.add_(1)

    # -- graphs ------------------------------------------------------------------------
    def _run_step(self, ws: _Workspace, rows: int, width: int, nucleus: bool, greedy: bool):
        if not self.use_graphs:
            self._decode_step(ws, rows, width, nucleus, greedy)
            return
        key = (rows, width, nucleus, greedy)
        graph = self.graphs.get(key)
        if graph is None:
            graph = self._capture(ws, key)
        graph.replay()

    def _capture(self, ws: _Workspace, key: tuple[int, int, bool, bool]):
        """Capture the step for `key`. The eager warm-up (lazy initialisations stay out of
        the graph) runs the real step; the state it advanced is put back, and the cache
        slot and output column it wrote are rewritten identically by the first replay."""
        saved = ws.save()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._decode_step(ws, *key)
        torch.cuda.current_stream().wait_stream(side)
        ws.restore(saved)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # One pool for all graphs: each step's temporaries die inside it and replays never
        # overlap, so the graphs can share their scratch memory.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            self._decode_step(ws, *key)
        self.graphs[key] = graph
        self.captures += 1
        return graph

    def _drop_graphs(self) -> None:
        self.graphs.clear()
        self._pool = None

    def _check_weights(self) -> None:
        """Graphs read parameters by address: if any moved (reloaded, cast, re-placed),
        the graphs are stale. In-place updates (optimizer steps) keep them valid; the fused
        copies are rewritten in place from the layers either way."""
        addresses = tuple(t.data_ptr() for t in self.model.parameters()) + tuple(
            t.data_ptr() for t in self.model.buffers()
        )
        layers = self.model.model.layers
        if addresses != self._weights:
            self._drop_graphs()
            self._weights = addresses
            self._fused = []  # the old copies go before the new ones are made
            self._fused = [_FusedLayer.of(layer, self.kernels) for layer in layers]
            if self.workspace is not None:
                self._fill_rope_table(self.workspace)
        else:
            with torch.no_grad():
                for fused, layer in zip(self._fused, layers, strict=True):
                    fused.refresh(layer)

    # -- the workspace -----------------------------------------------------------------
    def _bytes_per_row(self, length: int) -> int:
        config = self.model.config
        element = self.model.model.embed_tokens.weight.element_size()
        cache = 2 * config.num_hidden_layers * self.kv_heads * self.head_dim * length * element
        # Per-row buffers, and the sampling temporaries over the vocabulary in the graph pool.
        return cache + length * (20 + element) + 8 * 4 * config.vocab_size

    def _rows_per_round(self, rows: int, length: int) -> int:
        """How many rows one round may hold within MEMORY_SHARE of the free GPU memory."""
        device = self.model.model.embed_tokens.weight.device
        if device.type != "cuda":
            return rows
        free, _ = torch.cuda.mem_get_info(device)
        held = 0
        if self.workspace is not None:
            held = self.workspace.rows * self._bytes_per_row(self.workspace.length)
        fit = int((free + held) * MEMORY_SHARE) // self._bytes_per_row(length)
        if fit < 1:
            raise MemoryError(
                f"not enough GPU memory for one row of {length} tokens "
                f"({self._bytes_per_row(length)} bytes; {free} free)"
            )
        return min(rows, fit)

    def _workspace_for(self, rows: int, length: int) -> _Workspace:
        """The current workspace if it holds `rows` x `length`, else a larger one (graphs
        of the old one are dropped)."""
        ws = self.workspace
        if ws is not None and ws.rows >= rows and ws.length >= length:
            return ws
        if ws is not None:
            rows, length = max(rows, ws.rows), max(length, ws.length)
        self._drop_graphs()
        self.workspace = None  # free the old buffers before the new ones are allocated
        config = self.model.config
        weight = self.model.model.embed_tokens.weight
        self.workspace = _Workspace(
            rows, length, config.num_hidden_layers, self.kv_heads, self.head_dim,
            weight.dtype, weight.device, self.eos_token_ids,
        )  # fmt: skip
        self._fill_rope_table(self.workspace)
        return self.workspace

    def _fill_rope_table(self, ws: _Workspace) -> None:
        """The rotary embedding of every cache position, from the model's own rotary module,
        for the query heads (times attention's scaling) then the key heads; `sin` carries
        rotate_half's sign so that the rotation is x cos + roll(x, dim / 2) sin."""
        positions = torch.arange(ws.length, device=ws.keys.device)[None]
        with torch.no_grad():
            cos, sin = self.model.model.rotary_emb(ws.keys, positions)
        half = self.head_dim // 2
        sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        scale = torch.ones(self.heads + self.kv_heads, dtype=cos.dtype, device=cos.device)
        scale[: self.heads] = self.model.model.layers[0].self_attn.scaling
        ws.rope_cos = cos[0, :, None, :] * scale[:, None]
        ws.rope_sin = sin[0, :, None, :] * scale[:, None]

    def release(self) -> None:
        """Free the cache and graphs (the next generation allocates and captures again)."""
        self._drop_graphs()
        self.workspace = None

    # -- generation --------------------------------------------------------------------
    def generate(
        self, requests: list[DecodeRequest], should_stop: Callable[[], bool] | None = None
    ) -> list[tuple[list[int], list[float], str]]:
        """(completion ids, logprobs, finish reason) per request, in order."""
        self._check_weights()
        drawn = torch.randint(0, 2**62, (len(requests),)).tolist()
        seeds = [r.seed if r.seed is not None else d for r, d in zip(requests, drawn, strict=True)]
        if self.prefixes is not None:
            self.prefixes.check_weights(self.model)
            found = self.prefixes.lookup_many([r.prompt_ids for r in requests])
        else:
            found = [(None, 0)] * len(requests)
        longest = max(len(r.prompt_ids) for r in requests) + max(r.max_new_tokens for r in requests)
        length = -(-longest // LENGTH_STEP) * LENGTH_STEP
        per_round = self._rows_per_round(len(requests), length)
        # Similar prompt lengths share a round, so less of each round is padding.
        order = sorted(range(len(requests)), key=lambda i: len(requests[i].prompt_ids))
        results: list = [None] * len(requests)
        for start in range(0, len(order), per_round):
            chosen = order[start : start + per_round]
            round_results = self._generate_round(
                [requests[i] for i in chosen],
                [seeds[i] for i in chosen],
                [found[i] for i in chosen],
                should_stop,
            )
            for index, result in zip(chosen, round_results, strict=True):
                results[index] = result
        return results

    def _generate_round(self, requests, seeds, found, should_stop):
        batch = len(requests)
        prompt = max(len(r.prompt_ids) for r in requests)
        most_new = max(r.max_new_tokens for r in requests)
        length = -(-(prompt + most_new) // LENGTH_STEP) * LENGTH_STEP
        rows = row_bucket(batch)
        ws = self._workspace_for(rows, length)
        device = ws.keys.device
        self.rounds += 1

        # Per-row settings; rows past the batch are riders from the start.
        def column(values, dtype, fill):
            return torch.tensor(values + [fill] * (rows - batch), dtype=dtype, device=device)

        tokens = torch.arange(most_new, device=device)[None]
        ws.uniforms[:rows, :most_new] = counter_uniforms(
            column(seeds, torch.long, 0)[:, None], tokens
        )
        ws.temperature[:rows] = column([r.temperature for r in requests], torch.float32, 0.0)
        ws.top_p[:rows] = column([r.top_p for r in requests], torch.float32, 1.0)
        ws.max_new[:rows] = column([r.max_new_tokens for r in requests], torch.long, 1)
        ws.done[:rows] = column([False] * batch, torch.bool, True)
        ws.stopped[:rows].zero_()
        ws.lengths[:rows].zero_()
        ws.step.zero_()
        nucleus = any(r.top_p < 1 for r in requests)
        greedy = any(r.temperature <= 0 for r in requests)

        # Prompts are right-aligned at slot `prompt`; a row's stored prefix goes into its
        # first slots and the rest of its prompt is prefilled in chunks of rows (left-padded
        # to the round's longest rest), then the first token of every row from the prompt's
        # last logits. Riders read one pad token.
        first = [prompt - len(r.prompt_ids) for r in requests] + [prompt - 1] * (rows - batch)
        found = self._share_prefix(ws, requests, found, first)
        reused = [n for _, n in found]
        self._load_prefixes(ws, found, first)
        rest = max(len(r.prompt_ids) - n for r, n in zip(requests, reused, strict=True))
        ids = np.full((rows, rest), self.pad_token_id, dtype=np.int64)
        valid = np.zeros((rows, rest), dtype=bool)
        for row, (request, n) in enumerate(zip(requests, reused, strict=True)):
            count = len(request.prompt_ids) - n
            ids[row, rest - count :] = request.prompt_ids[n:]
            valid[row, rest - count :] = True
        valid[batch:, -1] = True
        ids, valid = torch.from_numpy(ids).to(device), torch.from_numpy(valid).to(device)
        first = torch.tensor(first, dtype=torch.long, device=device)
        chunk = max(1, PREFILL_TOKENS // rest)
        logits, positions = [], []
        for start in range(0, rows, chunk):
            part = slice(start, start + chunk)
            chunk_logits, chunk_positions = self._prefill(
                ws, start, ids[part], valid[part], first[part], prompt, any(reused)
            )
            logits.append(chunk_logits)
            positions.append(chunk_positions)
        slots = torch.arange(ws.length, device=device)
        ws.mask[:rows] = torch.where(
            (slots[None] >= first[:, None]) & (slots[None] < prompt), 0.0, float("-inf")
        )
        ws.positions[:rows] = torch.cat(positions)
        ws.slot.fill_(prompt)
        self._sample_and_record(ws, rows, torch.cat(logits), nucleus, greedy)

        # Decode: replay steps; every CHECK_EVERY steps look at which rows are done, stop
        # when all are, and move the live ones into a smaller bucket when they fit one.
        state = _Round(
            requests, prompt, first, list(range(batch)) + [None] * (rows - batch), [None] * batch
        )
        for step in range(1, most_new + 1):
            if step % CHECK_EVERY == 1 or step == most_new:
                if should_stop is not None and should_stop():
                    raise StopRequested(
                        f"stop requested: generation of {batch} replies abandoned after "
                        f"{step} tokens"
                    )
                done = ws.done[:rows].tolist()
                live = [row for row in range(rows) if not done[row]]
                if not live or step == most_new:
                    break
                smaller = row_bucket(len(live))
                if smaller < rows:
                    self._collect(ws, state, rows, step, done)
                    riders = [row for row in range(rows) if done[row]][: smaller - len(live)]
                    keep = sorted(live + riders)
                    kept = torch.tensor(keep, device=device)
                    ws.compact(kept, prompt + step)
                    # Riders were collected just now: nobody owns their tokens any more.
                    state.owner = [None if done[row] else state.owner[row] for row in keep]
                    state.first = state.first[kept]
                    rows = smaller
                    self.compactions += 1
            self._run_step(ws, rows, length_bucket(prompt + step, ws.length), nucleus, greedy)
        self._collect(ws, state, rows, most_new, None)
        return state.results

    def _share_prefix(self, ws: _Workspace, requests, found, first: list[int]) -> list:
        """The rows' `found` (stored prefix, tokens reused) after sharing the first tokens
        every prompt of the round begins with: where the rows that lack them (a stored prefix
        shorter) would prefill at least SHARED_PREFILL_FLOPS of them between them, they are
        prefilled once, into the first such row, and the others load a copy from there as
        from a stored prefix. Every row keeps at least one token of its own to prefill."""
        head = requests[0].prompt_ids
        shared = min(len(r.prompt_ids) for r in requests) - 1
        if (len(requests) - 1) * shared * self.flops_per_token < SHARED_PREFILL_FLOPS:
            return found  # not worth even looking (the tiny model's rounds: no host cost)
        for request in requests[1:]:
            if shared == 0:
                return found
            shared = common_prefix(head[:shared], request.prompt_ids[:shared])
        lacking = [row for row, (_, reused) in enumerate(found) if reused < shared]
        saved = sum(shared - found[row][1] for row in lacking) - shared
        if len(lacking) < 2 or saved * self.flops_per_token < SHARED_PREFILL_FLOPS:
            return found
        source, device = lacking[0], ws.keys.device
        self._prefill(
            ws, source, torch.tensor([head[:shared]], device=device),
            torch.ones((1, shared), dtype=torch.bool, device=device),
            torch.tensor([first[source]], device=device), first[source] + shared, False,
        )  # fmt: skip
        here = _Stored(_Snapshot(ws.keys, ws.values), source, first[source])
        copy = PrefixEntry(head[:shared], here, 0, [])
        found = list(found)
        found[source] = (None, shared)  # already in place
        for row in lacking[1:]:
            found[row] = (copy, shared)
        self.shared_prefills += 1
        return found

    def _load_prefixes(self, ws: _Workspace, found, first: list[int]) -> None:
        """Copy each row's stored prefix (`found`: (entry, tokens reused) per row) into its
        first slots: one gather per layer for all the rows whose entries share a snapshot."""
        by_snapshot: dict[int, list] = {}
        for row, (entry, reused) in enumerate(found):
            if entry is not None:
                by_snapshot.setdefault(id(entry.kv.snapshot), []).append((row, entry.kv, reused))
        device = ws.keys.device
        for items in by_snapshot.values():
            snapshot = items[0][1].snapshot
            counts = np.array([reused for _, _, reused in items])
            # Token k of the gather is token (k - offset) of its row's prefix.
            within = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
            dst_rows, dst_slots, src_rows, src_slots = (
                torch.from_numpy(array).to(device)
                for array in (
                    np.repeat([row for row, _, _ in items], counts),
                    within + np.repeat([first[row] for row, _, _ in items], counts),
                    np.repeat([stored.row for _, stored, _ in items], counts),
                    within + np.repeat([stored.start for _, stored, _ in items], counts),
                )
            )
            for cache, source in ((ws.keys, snapshot.keys), (ws.values, snapshot.values)):
                for layer, stored in zip(cache, source, strict=True):
                    layer[dst_rows, :, dst_slots] = stored[src_rows, :, src_slots]

    def _collect(self, ws: _Workspace, state: _Round, rows: int, steps: int, done) -> None:
        """Copy out the finished rows (all rows when `done` is None) not yet collected, and
        store their prompts and replies in the prefix store."""
        tokens = ws.out_tokens[:rows, :steps].tolist()
        logprobs = ws.out_logprobs[:rows, :steps].tolist()
        lengths = ws.lengths[:rows].tolist()
        stopped = ws.stopped[:rows].tolist()
        collected = []
        for row in range(rows):
            request = state.owner[row]
            if request is None or state.results[request] is not None:
                continue
            if done is not None and not done[row]:
                continue
            count = lengths[row]
            state.results[request] = (
                tokens[row][:count],
                logprobs[row][:count],
                "stop" if stopped[row] else "length",
            )
            collected.append(row)
        if self.prefixes is not None and collected:
            self._remember(ws, state, collected)

    def _remember(self, ws: _Workspace, state: _Round, collected: list[int]) -> None:
        """Store rows `collected`: their prompts and replies but the last token (never fed),
        whose keys and values are copied out of the workspace in one snapshot."""
        requests = [state.owner[row] for row in collected]
        fed = [max(len(state.results[request][0]) - 1, 0) for request in requests]
        index = torch.tensor(collected, device=ws.keys.device)
        width = state.prompt + max(fed)
        snapshot = _Snapshot(
            ws.keys[:, :, :, :width].index_select(1, index),
            ws.values[:, :, :, :width].index_select(1, index),
        )
        share = snapshot.nbytes // len(collected)
        first = state.first[index].tolist()
        self.prefixes.add_many(
            [
                state.requests[request].prompt_ids + state.results[request][0][:count]
                for request, count in zip(requests, fed, strict=True)
            ],
            [_Stored(snapshot, place, start) for place, start in enumerate(first)],
            [share] * len(requests),
        )
        # The store counts each entry's share of its snapshot, but a snapshot is freed only
        # with its last entry: a few entries left of many snapshots (games that ended at
        # different turns) would hold far more than the store counts. So the oldest entries
        # go until the snapshots still held fit the store's bound too.
        self._snapshots.add(snapshot)
        while self.prefixes.entries and (
            sum(held.nbytes for held in self._snapshots) > self.prefixes.max_bytes
        ):
            self.prefixes.drop_oldest()
