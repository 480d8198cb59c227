"""Two fused kernels (Triton) for the static decoder's captured step on a GPU.

A captured decode step costs about its kernel count (a few microseconds each), so the two
stretches of a layer that torch runs as several small kernels are one kernel each here:
- `rope_and_cache`: the rotary embedding of the step's queries and keys (from the
  decoder's table, by each row's position), the queries written out contiguous for
  attention, the keys and values written into the KV cache at the step's slot. In torch:
  two table lookups a step, then a multiply, a roll, a fused multiply-add, a copy of the
  queries and two cache writes a layer.
- `silu_and_mul`: the MLP's silu(gate) * up from the stacked gate/up projection (two
  kernels in torch).
Arithmetic in float32, rounded once to the model's dtype. Where Triton is missing (the CPU
build of torch) the decoder keeps its torch ops; with TRITON_INTERPRET=1 these kernels run
on the CPU, which is how the tests check them against the torch ops.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: the decoder's torch ops run instead
    triton = None


def available(device: torch.device) -> bool:
    """Whether the kernels can run on tensors of `device`."""
    if triton is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def supported_head_dim(dim: int) -> bool:
    """The rotary kernel loads a head in one block: a power of two."""
    return dim >= 16 and dim & (dim - 1) == 0


if triton is not None:

    @triton.jit
    def _rope_and_cache_kernel(
        qkv, qkv_row_stride, cos, sin, positions, slot, query, keys, values,
        cache_row_stride, cache_head_stride,
        HEADS: tl.constexpr, KV_HEADS: tl.constexpr, DIM: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        head = tl.program_id(1)  # query heads, then key heads, then value heads
        offsets = tl.arange(0, DIM)
        source = qkv + row * qkv_row_stride + head * DIM
        x = tl.load(source + offsets).to(tl.float32)
        place = tl.load(slot) * DIM + offsets
        if head < HEADS + KV_HEADS:
            rolled = tl.load(source + (offsets + DIM // 2) % DIM).to(tl.float32)
            table = (tl.load(positions + row) * (HEADS + KV_HEADS) + head) * DIM + offsets
            rotated = x * tl.load(cos + table).to(tl.float32) + rolled * tl.load(sin + table).to(
                tl.float32
            )
            if head < HEADS:
                out = query + (row * HEADS + head) * DIM + offsets
                tl.store(out, rotated.to(query.dtype.element_ty))
            else:
                out = keys + row * cache_row_stride + (head - HEADS) * cache_head_stride + place
                tl.store(out, rotated.to(keys.dtype.element_ty))
        else:
            kv_head = head - HEADS - KV_HEADS
            out = values + row * cache_row_stride + kv_head * cache_head_stride + place
            tl.store(out, x.to(values.dtype.element_ty))

    @triton.jit
    def _silu_and_mul_kernel(gate_up, row_stride, out, width, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offsets = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < width
        gate = tl.load(gate_up + row * row_stride + offsets, mask=inside).to(tl.float32)
        up = tl.load(gate_up + row * row_stride + width + offsets, mask=inside).to(tl.float32)
        value = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out + row * width + offsets, value.to(out.dtype.element_ty), mask=inside)


def rope_and_cache(qkv, cos, sin, positions, slot, keys, values, heads: int, kv_heads: int):
    """Queries [rows, heads, dim] of `qkv` ([rows, (heads + 2 kv heads) x dim], query then
    key then value heads) rotated by `cos`/`sin` ([positions, heads + kv heads, dim], the
    rotate-half sign in `sin`) at each row's position; keys rotated and values written
    into `keys`/`values` ([rows, kv heads, slots, dim]) at `slot` (a one-element tensor)."""
    rows, dim = qkv.shape[0], keys.shape[-1]
    query = torch.empty((rows, heads, dim), dtype=qkv.dtype, device=qkv.device)
    _rope_and_cache_kernel[(rows, heads + 2 * kv_heads)](
        qkv, qkv.stride(0), cos, sin, positions, slot, query, keys, values,
        keys.stride(0), keys.stride(1), HEADS=heads, KV_HEADS=kv_heads, DIM=dim,
    )  # fmt: skip
    return query


def silu_and_mul(gate_up):
    """silu(gate) * up for `gate_up` = [gate | up] ([rows, 2 x width])."""
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, width), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_and_mul_kernel[(rows, triton.cdiv(width, block))](
        gate_up, gate_up.stride(0), out, width, BLOCK=block
    )
    return out
