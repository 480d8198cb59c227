"""Fused kernels (Triton) for the static decoder's captured step on a GPU.

A captured decode step costs about its kernel count (a few microseconds each), so the
stretches of a layer that torch runs as several small kernels are one kernel each here:
- `rope_and_cache`: the q/k/v projection's bias, the rotary embedding of the step's
  queries and keys (from the decoder's table, by each token's position), the queries
  written out contiguous for attention, the keys and values written into the KV cache at
  the step's slot (or, in the prefill, at each prompt token's slot, padding left alone).
  One program a token, all its heads. In torch: the bias inside the product (a copy, then
  the product), two table lookups a step, then a multiply, a roll, a fused multiply-add, a
  copy of the queries and two cache writes a layer.
- `silu_and_mul`: the MLP's bias and silu(gate) * up from the stacked gate/up projection
  (two or three kernels in torch).
- `add_rms_norm`: a projection's output (and bias) added into the residual stream in
  place, and the sum's RMSNorm for the next projection: the residual addition inside the
  product costs a copy and the product, the norm one more kernel.
- `gemv`: one row's projection (rows of 1: a Play move, one user's chat), with the work
  before it done as it reads its input: the residual sum and the norm (`add_rms_norm`) or
  silu(gate) * up (`silu_and_mul`). Two kernels a projection become one; cuBLAS keeps the
  products of several rows.
- `gemv_rope_after_norm`: one row's q/k/v gemv with `rope_and_cache` on its outputs (each
  program takes output pairs half a head apart, so a pair's rotation stays in it).
- `sample_and_record`: sampling and the step's bookkeeping in two kernels (per block of
  logits its max, exp-sum and argmax; per row the draw, its logprob, the output tables,
  stops and lengths), where torch runs about two dozen over the vocabulary's width.
- `decode_attention`: one query token's attention over the static cache (flash-decoding:
  the cache's width split over programs when rows are few, each with its own online
  softmax, then one kernel combining the parts; a single kernel when rows fill the card),
  reading the slots up to the step's own (on the device), not the graph's whole width.
  In torch: the mask's copy, two batched products and a softmax a layer.
On Hopper and later the gemv, attention and norm kernels take programmatic dependent
launch (`dependent_launch`): each lets the next kernel start while it runs, and a gemv
reads its first blocks of weights before waiting for the previous kernel's writes.
Arithmetic in float32, rounded to the model's dtype where the model's own layers round (a
projection's output with its bias, the residual sum, the normalised stream). Where Triton is missing (the CPU
build of torch) the decoder keeps its torch ops; with TRITON_INTERPRET=1 these kernels run
on the CPU, which is how the tests check them against the torch ops.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: the decoder's torch ops run instead
    triton = None
try:  # programmatic dependent launch (Hopper and later): Triton 3.3 and later
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:
    gdc_launch_dependents = gdc_wait = None


def available(device: torch.device) -> bool:
    """Whether the kernels can run on tensors of `device`."""
    if triton is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


_DEPENDENT_LAUNCH: dict[int, bool] = {}


def dependent_launch(device: torch.device) -> dict:
    """Launch options for a kernel on `device`: where the card allows it (compute
    capability 9 and later, compiled kernels), programmatic dependent launch. Each such
    kernel lets the next one start as soon as its own programs are running, and waits for
    the previous one's writes before reading anything they may touch: a one-row decode
    step is ~130 short kernels in a row, and the next kernel's launch and its reads of
    weights (which nothing in the step writes) overlap the previous kernel's work."""
    if gdc_wait is None or device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return {"PDL": False}
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _DEPENDENT_LAUNCH:
        _DEPENDENT_LAUNCH[index] = torch.cuda.get_device_capability(index)[0] >= 9
    if not _DEPENDENT_LAUNCH[index]:
        return {"PDL": False}
    return {"PDL": True, "launch_pdl": True}


def supported_head_dim(dim: int) -> bool:
    """The rotary kernel loads a head in one block: a power of two."""
    return dim >= 16 and dim & (dim - 1) == 0


if triton is not None:

    @triton.jit
    def _rope_and_cache_kernel(
        qkv, qkv_row_stride, bias, cos, sin, positions, slot, query, keys, values,
        cache_row_stride, cache_head_stride, per_row, valid,
        HEADS: tl.constexpr, KV_HEADS: tl.constexpr, DIM: tl.constexpr,
        HEADS_PAD: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_VALID: tl.constexpr,
    ):  # fmt: skip
        """One token's heads in one program: query heads, then key heads, then value heads
        (a program a head was ~4.6 us a layer at 256 rows on an H100, launch-bound)."""
        token = tl.program_id(0)
        heads = tl.arange(0, HEADS_PAD)[:, None]
        dims = tl.arange(0, DIM)[None, :]
        real = heads < HEADS + 2 * KV_HEADS
        rotates = heads < HEADS + KV_HEADS
        # Token t is cache row t // per_row's slot `slot` + t % per_row (one token a row
        # when decoding, a prompt's block when prefilling).
        row = token // per_row
        write = real & (heads >= HEADS)
        if HAS_VALID:  # padding tokens leave the cache as it is
            write = write & (tl.load(valid + token) != 0)
        partner = (dims + DIM // 2) % DIM
        source = qkv + token * qkv_row_stride + heads * DIM
        x = tl.load(source + dims, mask=real, other=0.0)
        rolled = tl.load(source + partner, mask=rotates, other=0.0)
        if HAS_BIAS:  # the projection's bias, rounded with its output as a linear layer's is
            dtype = qkv.dtype.element_ty
            x = x.to(tl.float32) + tl.load(bias + heads * DIM + dims, mask=real).to(tl.float32)
            rolled = rolled.to(tl.float32) + tl.load(
                bias + heads * DIM + partner, mask=rotates
            ).to(tl.float32)  # fmt: skip
            x, rolled = x.to(dtype), rolled.to(dtype)
        x, rolled = x.to(tl.float32), rolled.to(tl.float32)
        table = (tl.load(positions + token) * (HEADS + KV_HEADS) + heads) * DIM + dims
        rotated = x * tl.load(cos + table, mask=rotates, other=0.0).to(tl.float32) + rolled * (
            tl.load(sin + table, mask=rotates, other=0.0).to(tl.float32)
        )
        tl.store(
            query + (token * HEADS + heads) * DIM + dims, rotated.to(query.dtype.element_ty),
            mask=heads < HEADS,
        )  # fmt: skip
        place = (tl.load(slot) + token % per_row) * DIM + dims
        cache_heads = tl.where(heads >= HEADS + KV_HEADS, heads - HEADS - KV_HEADS, heads - HEADS)
        at = row * cache_row_stride + cache_heads * cache_head_stride + place
        tl.store(keys + at, rotated.to(keys.dtype.element_ty), mask=write & rotates)
        tl.store(
            values + at, x.to(values.dtype.element_ty), mask=write & (heads >= HEADS + KV_HEADS)
        )

    @triton.jit
    def _silu_and_mul_kernel(
        gate_up, row_stride, bias, out, width, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr
    ):
        row = tl.program_id(0)
        offsets = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < width
        gate = tl.load(gate_up + row * row_stride + offsets, mask=inside)
        up = tl.load(gate_up + row * row_stride + width + offsets, mask=inside)
        if HAS_BIAS:
            dtype = gate_up.dtype.element_ty
            gate_bias = tl.load(bias + offsets, mask=inside).to(tl.float32)
            up_bias = tl.load(bias + width + offsets, mask=inside).to(tl.float32)
            gate = (gate.to(tl.float32) + gate_bias).to(dtype)
            up = (up.to(tl.float32) + up_bias).to(dtype)
        gate, up = gate.to(tl.float32), up.to(tl.float32)
        value = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out + row * width + offsets, value.to(out.dtype.element_ty), mask=inside)

    @triton.jit
    def _add_rms_norm_kernel(
        x, x_row_stride, x_part_stride, bias, residual, weight, normed, width, eps,
        BLOCK: tl.constexpr, PARTS: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        if PDL:
            gdc_launch_dependents()
            gdc_wait()
        row = tl.program_id(0)
        offsets = tl.arange(0, BLOCK)
        inside = offsets < width
        dtype = residual.dtype.element_ty
        if PARTS == 1:
            value = tl.load(x + row * x_row_stride + offsets, mask=inside, other=0.0)
        else:  # a product's slices of its reduction, summed in float32 and rounded once
            value = tl.zeros((BLOCK,), dtype=tl.float32)
            for part in tl.static_range(PARTS):
                value += tl.load(
                    x + part * x_part_stride + row * x_row_stride + offsets, mask=inside, other=0.0
                ).to(tl.float32)
            value = value.to(dtype)
        if HAS_BIAS:
            added = tl.load(bias + offsets, mask=inside, other=0.0).to(tl.float32)
            value = (value.to(tl.float32) + added).to(dtype)
        stream = residual + row * width + offsets
        # The sum rounded to the stream's dtype, as the layer's `residual + out` is.
        total = (tl.load(stream, mask=inside, other=0.0).to(tl.float32) + value.to(tl.float32)).to(
            dtype
        )
        tl.store(stream, total, mask=inside)
        total = total.to(tl.float32)
        scale = 1.0 / tl.sqrt(tl.sum(total * total, axis=0) / width + eps)
        # As the Llama family's RMSNorm: normalised in float32, rounded, times the weight.
        out = (total * scale).to(dtype).to(tl.float32) * tl.load(
            weight + offsets, mask=inside, other=0.0
        ).to(tl.float32)
        tl.store(normed + row * width + offsets, out.to(dtype), mask=inside)

    @triton.jit
    def _sample_block_kernel(
        logits, row_stride, temperature, block_max, block_sum, block_arg, vocab,
        BLOCK: tl.constexpr,
    ):  # fmt: skip
        # One block of one row's logits, divided by the row's temperature (1 for greedy
        # rows): its max, the sum of exp(logit - max) and its first argmax.
        row, block = tl.program_id(0), tl.program_id(1)
        offsets = block * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < vocab
        t = tl.load(temperature + row)
        scale = tl.where(t <= 0, 1.0, t)
        x = tl.load(logits + row * row_stride + offsets, mask=inside, other=-float("inf"))
        x = x.to(tl.float32) / scale
        top = tl.max(x, axis=0)
        at = row * tl.num_programs(1) + block
        tl.store(block_max + at, top)
        tl.store(block_sum + at, tl.sum(tl.exp(x - top), axis=0))
        tl.store(block_arg + at, tl.argmax(x, axis=0))

    @triton.jit
    def _sample_pick_kernel(
        logits, row_stride, temperature, uniforms, block_max, block_sum, block_arg, tokens,
        logprobs, vocab, blocks, step, record_stride, eos, eos_count, done, stopped, lengths,
        max_new, next_tokens, BLOCK: tl.constexpr, BLOCKS_PAD: tl.constexpr,
        EOS_PAD: tl.constexpr,
    ):  # fmt: skip
        # The row's token: the block where u x total falls in the blocks' running sums, then
        # the token inside it (or the argmax, for a greedy row), and its log-softmax; the
        # uniform is the row's at `step` of a [rows, steps] table, and the token is recorded
        # as the static decoder's step does (see `sample_and_record`).
        row = tl.program_id(0)
        column = tl.load(step)
        t = tl.load(temperature + row)
        scale = tl.where(t <= 0, 1.0, t)
        ids = tl.arange(0, BLOCKS_PAD)
        valid = ids < blocks
        tops = tl.load(block_max + row * blocks + ids, mask=valid, other=-float("inf"))
        top = tl.max(tops, axis=0)
        totals = tl.where(
            valid, tl.load(block_sum + row * blocks + ids, mask=valid, other=0.0) * tl.exp(tops - top), 0.0
        )  # fmt: skip
        running = tl.cumsum(totals, axis=0)
        total = tl.sum(totals, axis=0)
        target = tl.load(uniforms + row * record_stride + column) * total
        block = tl.minimum(tl.sum(((running <= target) & valid).to(tl.int32), axis=0), blocks - 1)
        before = tl.sum(tl.where(ids == block - 1, running, 0.0), axis=0)
        offsets = block * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < vocab
        x = tl.load(logits + row * row_stride + offsets, mask=inside, other=-float("inf"))
        inner = tl.cumsum(tl.exp(x.to(tl.float32) / scale - top), axis=0) + before
        within = tl.minimum(
            tl.sum(((inner <= target) & inside).to(tl.int32), axis=0),
            tl.sum(inside.to(tl.int32), axis=0) - 1,
        )
        token = block * BLOCK + within
        greedy_block = tl.argmax(tops, axis=0)
        greedy_token = greedy_block * BLOCK + tl.load(block_arg + row * blocks + greedy_block)
        token = tl.where(t <= 0, greedy_token, token)
        chosen = tl.load(logits + row * row_stride + token).to(tl.float32) / scale
        tl.store(tokens + row * record_stride + column, token)
        tl.store(logprobs + row * record_stride + column, chosen - top - tl.log(total))
        stops = tl.load(
            eos + tl.arange(0, EOS_PAD), mask=tl.arange(0, EOS_PAD) < eos_count, other=-1
        )
        stop = tl.sum((stops == token).to(tl.int32), axis=0) > 0
        live = tl.load(done + row) == 0
        tl.store(stopped + row, (tl.load(stopped + row) != 0) | (live & stop))
        length = tl.load(lengths + row) + live.to(tl.int64)
        tl.store(lengths + row, length)
        tl.store(done + row, (~live) | stop | (length >= tl.load(max_new + row)))
        tl.store(next_tokens + row, token)

    @triton.jit
    def _store_heads(
        out, row, heads, groups, dims, result,
        KV_HEADS: tl.constexpr, GROUPS: tl.constexpr, DIM: tl.constexpr,
    ):  # fmt: skip
        """A (row, kv head)'s query heads of the attention's output (padding rows left out)."""
        tl.store(
            out + (row * KV_HEADS * GROUPS + heads)[:, None] * DIM + dims[None, :],
            result.to(out.dtype.element_ty), mask=(groups < GROUPS)[:, None],
        )  # fmt: skip

    @triton.jit
    def _attention_part_kernel(
        query, keys, values, mask, out, part_max, part_sum, part_acc, width, last_slot, chunk,
        cache_row_stride, cache_head_stride, mask_row_stride,
        KV_HEADS: tl.constexpr, GROUPS: tl.constexpr, GROUPS_PAD: tl.constexpr,
        DIM: tl.constexpr, BLOCK: tl.constexpr, SPLIT: tl.constexpr, DOT: tl.constexpr,
        PDL: tl.constexpr,
    ):  # fmt: skip
        if PDL:
            gdc_launch_dependents()
            gdc_wait()
        pair = tl.program_id(0)  # row x kv head
        part = tl.program_id(1)
        row, head = pair // KV_HEADS, pair % KV_HEADS
        groups = tl.arange(0, GROUPS_PAD)
        dims = tl.arange(0, DIM)
        heads = head * GROUPS + groups  # the query heads reading this kv head
        q = tl.load(
            query + (row * KV_HEADS * GROUPS + heads)[:, None] * DIM + dims[None, :],
            mask=(groups < GROUPS)[:, None], other=0.0,
        )  # fmt: skip
        best = tl.full([GROUPS_PAD], float("-inf"), tl.float32)
        total = tl.zeros([GROUPS_PAD], tl.float32)
        acc = tl.zeros([GROUPS_PAD, DIM], tl.float32)
        cache = row * cache_row_stride + head * cache_head_stride
        begin = part * chunk
        # Only the slots up to the newest are read: the graph's `width` is a bucket, the
        # slots in use are on the device. A while loop: Triton's interpreter (the tests on
        # the CPU) cannot run a for loop to a bound given at run time.
        used = tl.minimum(width, tl.load(last_slot) + 1)
        end = tl.minimum(begin + chunk, used)
        start = begin
        while start < end:
            slots = start + tl.arange(0, BLOCK)
            inside = slots < used
            place = cache + slots[:, None] * DIM + dims[None, :]
            k = tl.load(keys + place, mask=inside[:, None], other=0.0)
            if DOT:
                scores = tl.dot(q, tl.trans(k))
            else:
                scores = tl.sum(q[:, None, :].to(tl.float32) * k[None, :, :].to(tl.float32), axis=2)
            bias = tl.load(mask + row * mask_row_stride + slots, mask=inside, other=float("-inf"))
            scores = scores + bias.to(tl.float32)[None, :]
            newest = tl.maximum(best, tl.max(scores, axis=1))
            # Nothing seen yet in this part: keep exp() away from -inf - -inf.
            anchor = tl.where(newest == float("-inf"), 0.0, newest)
            weights = tl.exp(scores - anchor[:, None])
            fade = tl.exp(best - anchor)
            total = total * fade + tl.sum(weights, axis=1)
            v = tl.load(values + place, mask=inside[:, None], other=0.0)
            if DOT:
                acc = acc * fade[:, None] + tl.dot(weights.to(v.dtype), v)
            else:
                acc = acc * fade[:, None] + tl.sum(
                    weights[:, :, None] * v[None, :, :].to(tl.float32), axis=1
                )
            best = newest
            start += BLOCK
        if SPLIT:
            parts = tl.num_programs(1)
            at = pair * parts + part
            tl.store(part_max + at * GROUPS_PAD + groups, best)
            tl.store(part_sum + at * GROUPS_PAD + groups, total)
            tl.store(part_acc + (at * GROUPS_PAD + groups)[:, None] * DIM + dims[None, :], acc)
        else:
            _store_heads(out, row, heads, groups, dims, acc / total[:, None], KV_HEADS, GROUPS, DIM)

    @triton.jit
    def _attention_combine_kernel(
        part_max, part_sum, part_acc, out, parts,
        KV_HEADS: tl.constexpr, GROUPS: tl.constexpr, GROUPS_PAD: tl.constexpr,
        DIM: tl.constexpr, PARTS_PAD: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        if PDL:
            gdc_launch_dependents()
            gdc_wait()
        pair = tl.program_id(0)
        row, head = pair // KV_HEADS, pair % KV_HEADS
        groups = tl.arange(0, GROUPS_PAD)
        dims = tl.arange(0, DIM)
        index = tl.arange(0, PARTS_PAD)
        there = index < parts
        at = (pair * parts + index)[:, None] * GROUPS_PAD + groups[None, :]  # [parts, groups]
        best = tl.load(part_max + at, mask=there[:, None], other=float("-inf"))
        overall = tl.max(best, axis=0)
        scale = tl.exp(best - overall[None, :])  # a part that saw nothing: exp(-inf) = 0
        total = tl.sum(scale * tl.load(part_sum + at, mask=there[:, None], other=0.0), axis=0)
        acc = tl.load(
            part_acc + at[:, :, None] * DIM + dims[None, None, :],
            mask=there[:, None, None], other=0.0,
        )  # fmt: skip
        result = tl.sum(scale[:, :, None] * acc, axis=0) / total[:, None]
        heads = head * GROUPS + groups
        _store_heads(out, row, heads, groups, dims, result, KV_HEADS, GROUPS, DIM)

    @triton.jit
    def _stream_value(
        x, bias, residual, ks, inside, dtype, HAS_ADD: tl.constexpr, HAS_BIAS: tl.constexpr
    ):
        """The residual stream plus a projection's output (and bias), as add_rms_norm."""
        total = tl.load(residual + ks, mask=inside, other=0.0).to(tl.float32)
        if HAS_ADD:
            value = tl.load(x + ks, mask=inside, other=0.0)
            if HAS_BIAS:
                added = tl.load(bias + ks, mask=inside, other=0.0).to(tl.float32)
                value = (value.to(tl.float32) + added).to(dtype)
            total = (total + value.to(tl.float32)).to(dtype).to(tl.float32)
        return total

    @triton.jit
    def _rope_epilogue(
        acc, outputs, lanes, out_bias, cos, sin, positions, slot, query, keys, values,
        cache_head_stride, dtype, HAS_OUT_BIAS: tl.constexpr, HEADS: tl.constexpr,
        KV_HEADS: tl.constexpr, DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        """`rope_and_cache` for one row on a gemv program's outputs of the q/k/v projection:
        lanes [0, BLOCK_N / 2) hold dims of the first half of their heads, the other lanes
        their rotary partners, DIM / 2 further on."""
        value = acc.to(dtype).to(tl.float32)  # the projection's output, rounded
        if HAS_OUT_BIAS:
            value = (value + tl.load(out_bias + outputs).to(tl.float32)).to(dtype).to(tl.float32)
        # Each lane's partner (lane ^ BLOCK_N / 2), through a BLOCK_N x BLOCK_N selection.
        partner_of = (lanes ^ (BLOCK_N // 2))[:, None] == lanes[None, :]
        partner = tl.sum(tl.where(partner_of, value[None, :], 0.0), axis=1)
        head, dim = outputs // DIM, outputs % DIM
        table = (tl.load(positions) * (HEADS + KV_HEADS) + head) * DIM + dim
        rotated = value * tl.load(cos + table, mask=head < HEADS + KV_HEADS, other=0.0).to(
            tl.float32
        ) + partner * tl.load(sin + table, mask=head < HEADS + KV_HEADS, other=0.0).to(tl.float32)
        place = tl.load(slot) * DIM + dim
        tl.store(query + outputs, rotated.to(dtype), mask=head < HEADS)
        key_head = head - HEADS
        tl.store(
            keys + key_head * cache_head_stride + place, rotated.to(dtype),
            mask=(head >= HEADS) & (key_head < KV_HEADS),
        )  # fmt: skip
        value_head = head - HEADS - KV_HEADS
        tl.store(
            values + value_head * cache_head_stride + place, value.to(dtype), mask=value_head >= 0
        )

    @triton.jit
    def _combined_parts(
        part_acc, part_max, part_sum, parts, ks, inside, dtype, HEADS: tl.constexpr,
        KV_HEADS: tl.constexpr, DIM: tl.constexpr, GROUPS_PAD: tl.constexpr,
        PARTS_PAD: tl.constexpr,
    ):  # fmt: skip
        """One row's attention output at inputs `ks` (head x DIM + dim) from the parts of
        a split width, as `_attention_combine_kernel` writes it (rounded to `dtype`)."""
        head = ks // DIM
        groups = HEADS // KV_HEADS
        first = ((head // groups) * parts) * GROUPS_PAD + head % groups  # part 0's entry
        overall = tl.full(ks.shape, float("-inf"), tl.float32)
        for part in tl.static_range(PARTS_PAD):
            there = inside & (part < parts)
            at = first + part * GROUPS_PAD
            overall = tl.maximum(overall, tl.load(part_max + at, mask=there, other=float("-inf")))
        total = tl.zeros(ks.shape, tl.float32)
        acc = tl.zeros(ks.shape, tl.float32)
        for part in tl.static_range(PARTS_PAD):
            there = inside & (part < parts)
            at = first + part * GROUPS_PAD
            # A part that saw nothing: exp(-inf) = 0; lanes past K read nothing at all.
            scale = tl.exp(tl.load(part_max + at, mask=there, other=float("-inf")) - overall)
            scale = tl.where(there, scale, 0.0)
            total += scale * tl.load(part_sum + at, mask=there, other=0.0)
            acc += scale * tl.load(part_acc + at * DIM + ks % DIM, mask=there, other=0.0)
        value = (acc / tl.where(inside, total, 1.0)).to(dtype).to(tl.float32)
        return tl.where(inside, value, 0.0)

    @triton.jit
    def _gemv_kernel(
        x, bias, residual, residual_out, norm_weight, eps, weight, out, n,
        out_bias, cos, sin, positions, slot, query, keys, values, cache_head_stride, parts,
        K: tl.constexpr, PROLOGUE: tl.constexpr, HAS_ADD: tl.constexpr,
        HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        ROPE: tl.constexpr, HAS_OUT_BIAS: tl.constexpr, HEADS: tl.constexpr,
        KV_HEADS: tl.constexpr, DIM: tl.constexpr, GROUPS_PAD: tl.constexpr,
        PARTS_PAD: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        if PDL:
            gdc_launch_dependents()
        lanes = tl.arange(0, BLOCK_N)
        if ROPE:  # pairs of dims DIM / 2 apart, so the rotation stays in the program
            pair = tl.program_id(0) * (BLOCK_N // 2) + lanes % (BLOCK_N // 2)
            second = (lanes >= BLOCK_N // 2).to(tl.int32)
            outputs = (pair // (DIM // 2)) * DIM + pair % (DIM // 2) + second * (DIM // 2)
        else:
            outputs = tl.program_id(0) * BLOCK_N + lanes
        rows_inside = outputs < n
        dtype = out.dtype.element_ty
        # Nothing in a decode step writes the weights: the first two blocks of them are
        # read before waiting for the kernel before (dependent launch), the rest after.
        first = tl.arange(0, BLOCK_K)
        tiles = (
            tl.load(
                weight + outputs[:, None] * K + first[None, :],
                mask=rows_inside[:, None] & (first < K)[None, :], other=0.0,
            ),
            tl.load(
                weight + outputs[:, None] * K + (BLOCK_K + first)[None, :],
                mask=rows_inside[:, None] & (BLOCK_K + first < K)[None, :], other=0.0,
            ),
        )  # fmt: skip
        if PDL:
            gdc_wait()
        if PROLOGUE == 1:  # the input is norm(residual + x (+ bias)): its scale first
            squares = tl.zeros([BLOCK_K], tl.float32)
            for start in tl.static_range(0, K, BLOCK_K):
                ks = start + tl.arange(0, BLOCK_K)
                inside = ks < K
                total = _stream_value(x, bias, residual, ks, inside, dtype, HAS_ADD, HAS_BIAS)
                squares += total * total
                if tl.program_id(0) == 0:  # one program writes the new stream
                    tl.store(residual_out + ks, total.to(dtype), mask=inside)
            scale = 1.0 / tl.sqrt(tl.sum(squares, axis=0) / K + eps)
        acc = tl.zeros([BLOCK_N], tl.float32)
        for start in tl.static_range(0, K, BLOCK_K):
            ks = start + tl.arange(0, BLOCK_K)
            inside = ks < K
            if PROLOGUE == 1:
                total = _stream_value(x, bias, residual, ks, inside, dtype, HAS_ADD, HAS_BIAS)
                value = (total * scale).to(dtype).to(tl.float32) * tl.load(
                    norm_weight + ks, mask=inside, other=0.0
                ).to(tl.float32)
                value = value.to(dtype).to(tl.float32)
            elif PROLOGUE == 2:  # the input is silu(gate) * up of x = [gate | up] (+ bias)
                gate = tl.load(x + ks, mask=inside, other=0.0)
                up = tl.load(x + K + ks, mask=inside, other=0.0)
                if HAS_BIAS:
                    gate_bias = tl.load(bias + ks, mask=inside, other=0.0).to(tl.float32)
                    up_bias = tl.load(bias + K + ks, mask=inside, other=0.0).to(tl.float32)
                    gate = (gate.to(tl.float32) + gate_bias).to(dtype)
                    up = (up.to(tl.float32) + up_bias).to(dtype)
                gate, up = gate.to(tl.float32), up.to(tl.float32)
                value = (gate / (1.0 + tl.exp(-gate)) * up).to(dtype).to(tl.float32)
            elif PROLOGUE == 3:  # the input is attention's parts: combined as they are read
                value = _combined_parts(
                    x, bias, residual, parts, ks, inside, dtype, HEADS, KV_HEADS, DIM,
                    GROUPS_PAD, PARTS_PAD,
                )  # fmt: skip
            else:
                value = tl.load(x + ks, mask=inside, other=0.0).to(tl.float32)
            if start < 2 * BLOCK_K:
                tile = tiles[start // BLOCK_K]
            else:
                tile = tl.load(
                    weight + outputs[:, None] * K + ks[None, :],
                    mask=rows_inside[:, None] & inside[None, :], other=0.0,
                )  # fmt: skip
            acc += tl.sum(tile.to(tl.float32) * value[None, :], axis=1)
        if ROPE:
            _rope_epilogue(
                acc, outputs, lanes, out_bias, cos, sin, positions, slot, query, keys, values,
                cache_head_stride, dtype, HAS_OUT_BIAS, HEADS, KV_HEADS, DIM, BLOCK_N,
            )  # fmt: skip
        else:
            tl.store(out + outputs, acc.to(dtype), mask=rows_inside)


def rope_and_cache(
    qkv, bias, cos, sin, positions, slot, keys, values, heads: int, kv_heads: int,
    per_row: int = 1, valid=None,
):  # fmt: skip
    """Queries [tokens, heads, dim] of `qkv` ([tokens, (heads + 2 kv heads) x dim], query
    then key then value heads; plus `bias` unless None) rotated by `cos`/`sin` ([positions,
    heads + kv heads, dim], the rotate-half sign in `sin`) at each token's position
    (`positions`, [tokens]); keys rotated and values written into `keys`/`values` ([rows,
    kv heads, slots, dim]). Token t belongs to row t // `per_row` and goes to its slot
    `slot` (a one-element tensor) + t % `per_row`: one token a row when decoding, a row's
    block of prompt tokens when prefilling. `valid` ([tokens], bool): only those tokens'
    keys and values are written (None: all)."""
    tokens, dim = qkv.shape[0], keys.shape[-1]
    query = torch.empty((tokens, heads, dim), dtype=qkv.dtype, device=qkv.device)
    _rope_and_cache_kernel[(tokens,)](
        qkv, qkv.stride(0), qkv if bias is None else bias, cos, sin, positions, slot, query,
        keys, values, keys.stride(0), keys.stride(1), per_row, qkv if valid is None else valid,
        HEADS=heads, KV_HEADS=kv_heads, DIM=dim,
        HEADS_PAD=triton.next_power_of_2(heads + 2 * kv_heads), HAS_BIAS=bias is not None,
        HAS_VALID=valid is not None,
    )  # fmt: skip
    return query


def silu_and_mul(gate_up, bias=None):
    """silu(gate) * up for `gate_up` = [gate | up] ([rows, 2 x width]), plus `bias`
    ([2 x width]) first unless None."""
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, width), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_and_mul_kernel[(rows, triton.cdiv(width, block))](
        gate_up, gate_up.stride(0), gate_up if bias is None else bias, out, width,
        BLOCK=block, HAS_BIAS=bias is not None,
    )  # fmt: skip
    return out


def gemv_blocks(n: int, k: int) -> tuple[int, int, int]:
    """(outputs, inputs, warps) of a gemv program: two outputs on four warps, whole rows of
    up to 1,024 inputs, where outputs are few (up to 2,048); else four outputs on one warp,
    rows read 512 inputs at a time. The fastest of a sweep on an H200 of the decoder's
    own calls (norm or silu prologue, rotary epilogue) with each weight read cold, as a
    decode step reads it (docs/BENCHMARKS.md): Qwen2-0.5B's q/k/v 3.4 us a call and
    gate/up 7.2 us against 4.6 and 8.0 for the tiles chosen earlier with the weights in L2."""
    if n <= 2048:
        return 2, min(1024, triton.next_power_of_2(k)), 4
    return 4, min(512, triton.next_power_of_2(k)), 1


def _gemv(weight, x, prologue: int, *, bias=None, residual=None, norm=None, add=True,
          rope=None, attention=None):  # fmt: skip
    n, k = weight.shape
    out = torch.empty((1, n), dtype=weight.dtype, device=weight.device)
    new_stream = torch.empty_like(residual) if residual is not None else None
    block_n, block_k, warps = gemv_blocks(n, k)
    if rope is None:
        rope_args, rope_shape = (out,) * 8 + (0,), dict(HEADS=1, KV_HEADS=1, DIM=2)
    else:
        rope_args = (rope["bias"] if rope["bias"] is not None else out, *(rope[name] for name in (
            "cos", "sin", "positions", "slot", "query", "keys", "values")),
            rope["keys"].stride(1))  # fmt: skip
        rope_shape = dict(HEADS=rope["heads"], KV_HEADS=rope["kv_heads"], DIM=rope["dim"])
    has_bias = bias is not None
    parts, parts_shape = 1, dict(GROUPS_PAD=1, PARTS_PAD=1)
    if attention is not None:  # x, bias, residual: the parts' accumulators, maxima, sums
        x, bias, residual = attention.acc, attention.max, attention.sum
        parts = attention.parts
        rope_shape = dict(HEADS=attention.heads, KV_HEADS=attention.kv_heads, DIM=attention.dim)
        parts_shape = dict(GROUPS_PAD=attention.max.shape[1],
                           PARTS_PAD=triton.next_power_of_2(parts))  # fmt: skip
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, x if bias is None else bias, x if residual is None else residual,
        out if new_stream is None else new_stream, weight if norm is None else norm.weight,
        0.0 if norm is None else norm.variance_epsilon, weight, out, n, *rope_args, parts, K=k,
        PROLOGUE=prologue, HAS_ADD=add, HAS_BIAS=has_bias, BLOCK_N=block_n,
        BLOCK_K=block_k, ROPE=rope is not None,
        HAS_OUT_BIAS=rope is not None and rope["bias"] is not None, **rope_shape, **parts_shape,
        num_warps=warps, **dependent_launch(weight.device),
    )  # fmt: skip
    return out, new_stream


def gemv(weight, x):
    """x @ weight.T for one row `x` ([1, in]; `weight` [out, in], contiguous)."""
    return _gemv(weight, x, 0)[0]


def gemv_after_norm(weight, x, bias, residual, norm):
    """(norm(residual + x + bias) @ weight.T, residual + x + bias) for one row: the
    residual stream's new value is returned, not written over `residual`. `x` None: the
    norm of `residual` alone; `bias` None: no bias."""
    return _gemv(weight, residual if x is None else x, 1, bias=bias, residual=residual,
                 norm=norm, add=x is not None)  # fmt: skip


def gemv_rope_after_norm(weight, x, bias, residual, norm, qkv_bias, cos, sin, positions,
                         slot, keys, values, heads: int, kv_heads: int):  # fmt: skip
    """`gemv_after_norm` of the q/k/v projection with `rope_and_cache` done on its outputs
    (one row): returns (the rotated queries [1, heads, dim], the new residual stream), the
    keys and values written into `keys`/`values` ([1 or more rows, kv heads, slots, dim];
    row 0) at `slot`."""
    dim = keys.shape[-1]
    query = torch.empty((1, heads, dim), dtype=weight.dtype, device=weight.device)
    rope = dict(bias=qkv_bias, cos=cos, sin=sin, positions=positions, slot=slot, query=query,
                keys=keys, values=values, heads=heads, kv_heads=kv_heads, dim=dim)  # fmt: skip
    _, stream = _gemv(weight, residual if x is None else x, 1, bias=bias, residual=residual,
                      norm=norm, add=x is not None, rope=rope)  # fmt: skip
    return query, stream


def gemv_after_attention(weight, attended):
    """attended @ weight.T for one row, where `attended` is `decode_attention`'s output
    ([1, heads x dim]) or, for a split width, its `AttentionParts`: then the parts are
    combined as the gemv reads them (one kernel, where the combine was one more)."""
    if isinstance(attended, AttentionParts):
        return _gemv(weight, None, 3, attention=attended)[0]
    return _gemv(weight, attended, 0)[0]


def gemv_after_silu(weight, gate_up, bias):
    """silu(gate) * up @ weight.T for one row `gate_up` = [gate | up] (+ `bias` first)."""
    return _gemv(weight, gate_up, 2, bias=bias)[0]


# Attention programs wanted at once: about two per streaming multiprocessor of a large card.
ATTENTION_PROGRAMS = 256
# By where the products run (tensor cores: True): the slots a program reads at once, and
# the fewest such blocks a part of a split width has (a shorter part saves less than the
# combining kernel costs). From sweeps on an H100 (docs/BENCHMARKS.md): on tensor cores,
# blocks of 128 slots took 3.3-6.2 us at one row against 4.4-10.6 us for 32.
ATTENTION_TILES = {True: (128, 1), False: (32, 8)}


def attention_pays(dtype: torch.dtype, groups: int) -> bool:
    """Whether `decode_attention` beat the torch ops on an H100 for `groups` query heads a
    kv head (docs/BENCHMARKS.md): one head a kv head (products on the CUDA cores), or
    several in half precision (tensor cores). Several in float32 lost: tl.dot rounds to
    tf32 or pads to 16 rows, and the CUDA-core products spill."""
    return groups == 1 or dtype in (torch.float16, torch.bfloat16)


def attention_parts(pairs: int, width: int, dot: bool) -> tuple[int, int]:
    """How many parts `decode_attention` splits `width` slots into for `pairs` (row, kv
    head) pairs, and the slots of each: about ATTENTION_PROGRAMS programs in all, parts of
    at least the blocks ATTENTION_TILES gives."""
    block, part_blocks = ATTENTION_TILES[dot]
    blocks = triton.cdiv(width, block)
    parts = max(1, min(blocks // part_blocks, triton.cdiv(ATTENTION_PROGRAMS, pairs)))
    chunk = triton.cdiv(blocks, parts) * block
    return triton.cdiv(width, chunk), chunk


class AttentionParts(NamedTuple):
    """A split width's partial results, for `gemv_after_attention` to combine: per (row x kv
    head x part, query head of the kv head padded to `max.shape[1]`) the running max, the
    exp-sum and (with `dim` more) the weighted values."""

    max: torch.Tensor
    sum: torch.Tensor
    acc: torch.Tensor
    parts: int
    heads: int
    kv_heads: int
    dim: int


def decode_attention(query, keys, values, mask, width: int, last_slot, dot: bool | None = None,
                     combine: bool = True):  # fmt: skip
    """One token's attention: `query` [rows, heads, dim] (scaled) over the first `width`
    slots of `keys`/`values` ([rows, kv heads, slots, dim] or wider in rows) up to the slot
    `last_slot` (a one-element tensor: later slots are not read), `mask` ([rows, slots], added
    to the scores: 0 or -inf). Returns [rows, heads x dim]; with `combine` false and the
    width split (one row only), the parts uncombined (`AttentionParts`), for
    `gemv_after_attention`.
    `dot`: the products on tensor cores (tl.dot, the query heads of a kv head padded to 16
    rows), else on the CUDA cores in float32; None: tensor cores where a kv head serves
    several query heads."""
    rows, heads, dim = query.shape
    kv_heads = keys.shape[1]
    groups = heads // kv_heads
    pairs = rows * kv_heads
    dot = groups > 1 if dot is None else dot
    if not combine and rows != 1:
        raise ValueError("decode_attention: parts are left uncombined for one row only")
    parts, chunk = attention_parts(pairs, width, dot)
    # Query heads a program reads at once: tl.dot's tiles have at least 16 rows.
    groups_pad = max(16 if dot else 1, triton.next_power_of_2(groups))
    out = torch.empty((rows, heads * dim), dtype=query.dtype, device=query.device)
    split = parts > 1
    shape = (pairs * parts, groups_pad) if split else (1, 1)
    part_max = torch.empty(shape, dtype=torch.float32, device=query.device)
    part_sum = torch.empty(shape, dtype=torch.float32, device=query.device)
    part_acc = torch.empty((*shape, dim if split else 1), dtype=torch.float32, device=query.device)
    common = dict(KV_HEADS=kv_heads, GROUPS=groups, GROUPS_PAD=groups_pad, DIM=dim)
    _attention_part_kernel[(pairs, parts)](
        query, keys, values, mask, out, part_max, part_sum, part_acc, width, last_slot, chunk,
        keys.stride(0), keys.stride(1), mask.stride(0), **common, BLOCK=ATTENTION_TILES[dot][0],
        SPLIT=split, DOT=dot, **dependent_launch(query.device),
    )  # fmt: skip
    if split and not combine:
        return AttentionParts(part_max, part_sum, part_acc, parts, heads, kv_heads, dim)
    if split:
        _attention_combine_kernel[(pairs,)](
            part_max, part_sum, part_acc, out, parts, **common,
            PARTS_PAD=triton.next_power_of_2(parts), **dependent_launch(query.device),
        )  # fmt: skip
    return out


def add_rms_norm(x, bias, residual, norm):
    """`residual` += `x` (+ `bias` unless None), in place ([rows, width], contiguous), and
    returns the RMSNorm `norm` (weight and `variance_epsilon`, the Llama family's) of the
    new residual. `x` [parts, rows, width]: a product's slices of its reduction, summed."""
    rows, width = residual.shape
    parts = x if x.dim() == 3 else x[None]
    normed = torch.empty_like(residual)
    _add_rms_norm_kernel[(rows,)](
        parts, parts.stride(1), parts.stride(0), x if bias is None else bias, residual,
        norm.weight, normed, width, norm.variance_epsilon, BLOCK=triton.next_power_of_2(width),
        PARTS=parts.shape[0], HAS_BIAS=bias is not None, **dependent_launch(residual.device),
    )  # fmt: skip
    return normed


SAMPLE_KERNEL_BLOCK = 2048


def _sample_blocks(logits, temperature):
    """Per row and block of SAMPLE_KERNEL_BLOCK logits: max, exp-sum and argmax."""
    rows, vocab = logits.shape
    blocks = triton.cdiv(vocab, SAMPLE_KERNEL_BLOCK)
    stats = torch.empty((2, rows, blocks), dtype=torch.float32, device=logits.device)
    block_arg = torch.empty((rows, blocks), dtype=torch.int32, device=logits.device)
    _sample_block_kernel[(rows, blocks)](
        logits, logits.stride(0), temperature, stats[0], stats[1], block_arg, vocab,
        BLOCK=SAMPLE_KERNEL_BLOCK,
    )  # fmt: skip
    return stats[0], stats[1], block_arg, blocks


def sample_and_record(logits, ws, rows: int) -> None:
    """`static_decode.sample_tokens` without a nucleus for the first `rows` rows of the
    static decoder's workspace `ws`, in two kernels: per block of SAMPLE_KERNEL_BLOCK
    tokens its max, exp-sum and argmax; then per row the block where the row's uniform (at
    column `ws.step` of `ws.uniforms`) falls, the token inside it, and its log-softmax. The
    logits are read once and nothing of the vocabulary's width is written (torch: a scaled
    copy, log-softmax, exp, block sums, the searches). The same tokens as the torch path's
    for the same uniforms, except where a uniform falls within float rounding of a token's
    bound. The second kernel also does the step's bookkeeping: token and logprob written
    at that column of `ws.out_tokens` / `ws.out_logprobs`, a live row that drew an
    end-of-sequence token `stopped`, a live row's length counted, `done` set by a stop or
    the row's `max_new`, `ws.tokens` the next input (torch: a dozen more kernels;
    `ws.step` is advanced by the caller)."""
    vocab = logits.shape[1]
    assert ws.uniforms.stride(0) == ws.out_tokens.stride(0) == ws.out_logprobs.stride(0)
    block_max, block_sum, block_arg, blocks = _sample_blocks(logits, ws.temperature)
    _sample_pick_kernel[(rows,)](
        logits, logits.stride(0), ws.temperature, ws.uniforms, block_max, block_sum,
        block_arg, ws.out_tokens, ws.out_logprobs, vocab, blocks, ws.step,
        ws.uniforms.stride(0), ws.eos, ws.eos.numel(), ws.done, ws.stopped, ws.lengths,
        ws.max_new, ws.tokens, BLOCK=SAMPLE_KERNEL_BLOCK,
        BLOCKS_PAD=triton.next_power_of_2(blocks),
        EOS_PAD=triton.next_power_of_2(max(1, ws.eos.numel())),
    )  # fmt: skip
