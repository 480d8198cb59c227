"""The static decoder's decode step on other Llama-family layouts (grouped-query attention,
biases, qwen3's per-head norms) against the engine's dynamic loop, and its fused Triton
kernels (decode_kernels, run by Triton's interpreter on the CPU) against its torch ops."""

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from rlcore.policy.local import LocalEngine
from rlcore.types import SamplingParams

SHAPE = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=512, initializer_range=0.3,
)  # fmt: skip


def model_of(config_class, **extra):
    torch.manual_seed(0)
    config = config_class(**{**SHAPE, **extra}, vocab_size=300)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # transformers starts biases at 0, which would test nothing
        for name, parameter in model.named_parameters():
            if name.endswith(".bias"):
                parameter.normal_(0.0, 0.3)
    return model


MODELS = {
    # An MLP 4x as wide as the stream: the fused step's down projection in slices of its
    # reduction (static_decode.SPLIT, at any depth and row count here), summed by the next
    # norm's kernel.
    "qwen2 (grouped-query, q/k/v bias)": lambda: model_of(Qwen2Config, intermediate_size=256),
    # One query head a kv head: the attention kernel's CUDA-core path in float32.
    "llama (attention and MLP biases)": lambda: model_of(
        LlamaConfig, attention_bias=True, mlp_bias=True, num_key_value_heads=4
    ),
    "qwen3 (per-head query/key norms)": lambda: model_of(Qwen3Config),
}


def engines(model, tokenizer):
    dynamic = LocalEngine(model=model, tokenizer=tokenizer, name="dynamic", decode="dynamic")
    static = LocalEngine(model=model, tokenizer=tokenizer, name="static", decode="static")
    for engine in (dynamic, static):
        engine.eos_token_ids = set()  # every reply runs its full length
    return dynamic, static


def replies(engine, count=6, temperature=0.0):
    async def run():
        return await asyncio.gather(
            *(
                engine.generate(
                    [{"role": "user", "content": f"Board {i}: " + "X.O" * (i % 5)}],
                    SamplingParams(temperature=temperature, max_tokens=6 + 2 * i, seed=i),
                )
                for i in range(count)
            )
        )

    return asyncio.run(run())


@pytest.fixture(scope="module")
def tokenizer(default_tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_tiny_model)


@pytest.mark.parametrize("name", list(MODELS))
def test_the_decode_step_matches_the_dynamic_loop_on_other_layouts(name, tokenizer):
    dynamic, static = engines(MODELS[name](), tokenizer)
    expected, got = replies(dynamic), replies(static)
    assert static._static is not None and not static._static.kernels
    assert [g.completion_ids for g in got] == [g.completion_ids for g in expected]
    for mine, theirs in zip(got, expected, strict=True):
        assert mine.logprobs == pytest.approx(theirs.logprobs, abs=1e-4)


def compare_kernels_with_torch_ops(name: str, tiny_path: str) -> dict:
    """Greedy and seeded replies of the static decoder with the Triton kernels and with its
    torch ops, and the dynamic loop's. Runs in a process started with TRITON_INTERPRET=1
    (the interpreter must be chosen before Triton is first imported)."""
    from transformers import AutoTokenizer

    from rlcore.policy import decode_kernels, static_decode

    # The interpreter runs programs one at a time: attention split over a few parts a row,
    # not over the card's worth of programs (each path alone: check_kernels_one_by_one).
    decode_kernels.ATTENTION_PROGRAMS = 8
    decode_kernels.ATTENTION_TILES = {True: (128, 1), False: (32, 1)}
    static_decode.SPLIT_ROWS = static_decode.SPLIT_DEPTH = 1  # the down projection's slices
    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    dynamic, static = engines(MODELS[name](), tokenizer)
    expected, got = replies(dynamic, count=4), replies(static, count=4)
    # One row alone takes the gemv kernels.
    one_expected, one_got = replies(dynamic, count=1), replies(static, count=1)
    kernels, kernel_attention = static._static.kernels, static._static.kernel_attention
    split = all(fused.down is not None for fused in static._static._fused)
    sampled_kernels = replies(static, count=4, temperature=1.0)
    static._static.kernels = static._static.kernel_attention = False
    sampled_torch = replies(static, count=4, temperature=1.0)
    gap = max(
        abs(a - b)
        for mine, theirs in zip(got, expected, strict=True)
        for a, b in zip(mine.logprobs, theirs.logprobs, strict=True)
    )
    return {
        "kernels": kernels,
        "kernel_attention": kernel_attention,
        "split": split,
        "greedy_same": [g.completion_ids for g in got] == [g.completion_ids for g in expected],
        "one_row_same": one_got[0].completion_ids == one_expected[0].completion_ids,
        "one_row_gap": max(
            abs(a - b) for a, b in zip(one_got[0].logprobs, one_expected[0].logprobs, strict=True)
        ),
        "greedy_tokens": sum(len(g.completion_ids) for g in got),
        "logprob_gap": gap,
        "sampled_same": [g.completion_ids for g in sampled_kernels]
        == [g.completion_ids for g in sampled_torch],
    }


@pytest.mark.parametrize(
    "name", ["qwen2 (grouped-query, q/k/v bias)", "llama (attention and MLP biases)"]
)
def test_the_fused_kernels_give_the_torch_ops_results(name, default_tiny_model):
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    child = subprocess.run(
        [sys.executable, __file__, name, default_tiny_model],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert child.returncode == 0, child.stderr[-3000:]
    result = json.loads(child.stdout.strip().splitlines()[-1])
    assert result["kernels"]  # the interpreter made them available on the CPU
    # The attention kernel runs where it pays: one query head a kv head in float32.
    assert result["kernel_attention"] == (name.startswith("llama"))
    assert result["split"] == name.startswith("qwen2")  # its MLP is 4x the stream
    assert result["greedy_same"] and result["greedy_tokens"] > 0
    assert result["logprob_gap"] < 1e-4
    assert result["one_row_same"] and result["one_row_gap"] < 1e-4
    assert result["sampled_same"]  # the same seeds draw the same tokens either way


def check_kernels_one_by_one() -> dict:
    """The largest gap between each kernel and the torch ops it replaces, on random
    float32 inputs (Triton's interpreter cannot multiply bfloat16 tiles; it multiplies
    float32 tiles exactly, where a GPU's tl.dot would round them to tf32)."""
    from rlcore.policy import decode_kernels

    torch.manual_seed(0)
    gaps = {}
    # Attention: grouped and plain heads, split over several parts and in one program.
    cases = {"split, grouped": (1, 14, 2, 64, 300, 288, 256), "split, plain": (3, 4, 4, 32, 300,
             270, 256), "one part, grouped": (40, 8, 2, 16, 128, 96, 8)}  # fmt: skip
    # Parts of one block (of 128 slots on tensor cores, 32 on the CUDA cores): short widths
    # split too.
    decode_kernels.ATTENTION_TILES = {True: (128, 1), False: (32, 1)}
    for case, (rows, heads, kv_heads, dim, length, width, programs) in cases.items():
        decode_kernels.ATTENTION_PROGRAMS = programs
        for dot in (True, False):
            parts, _ = decode_kernels.attention_parts(rows * kv_heads, width, dot)
            assert (parts > 1) == case.startswith("split"), case
        query = torch.randn(rows, heads, dim)
        keys, values = torch.randn(2, rows + 1, kv_heads, length, dim)
        mask = torch.full((rows + 1, length), float("-inf"))
        # The slots in use end at `newest`, inside the width (the graph's bucket): the slots
        # after it are open in the mask but hold NaN, so reading one would show.
        newest = width - 1 - width // 5
        for row in range(rows + 1):  # each row's tokens: a stretch ending at the newest slot
            mask[row, int(torch.randint(0, newest, ())) : width] = 0.0
        keys[:, :, newest + 1 :] = values[:, :, newest + 1 :] = float("nan")
        got = {
            dot: decode_kernels.decode_attention(
                query, keys, values, mask, width, torch.tensor([newest]), dot=dot
            )
            for dot in (True, False)
        }
        used = slice(0, newest + 1)
        scores = torch.einsum("rhd,rhsd->rhs", query, keys[:rows, :, used].repeat_interleave(
            heads // kv_heads, dim=1)) + mask[:rows, None, used]  # fmt: skip
        expected = torch.einsum(
            "rhs,rhsd->rhd", scores.softmax(-1),
            values[:rows, :, used].repeat_interleave(heads // kv_heads, dim=1),
        )  # fmt: skip
        for dot, out in got.items():
            where = "tensor cores" if dot else "CUDA cores"
            gaps[f"attention, {case}, {where}"] = (out - expected.flatten(1)).abs().max().item()
        if rows == 1:  # one row's parts left uncombined, combined by the o projection's gemv
            weight = torch.randn(70, heads * dim)
            for dot in (True, False):
                parts = decode_kernels.decode_attention(
                    query, keys, values, mask, width, torch.tensor([newest]), dot=dot,
                    combine=False,
                )  # fmt: skip
                assert isinstance(parts, decode_kernels.AttentionParts) and parts.parts > 1
                out = decode_kernels.gemv_after_attention(weight, parts)
                where = "tensor cores" if dot else "CUDA cores"
                gaps[f"gemv after attention's parts ({parts.parts}), {where}"] = (
                    (out - expected.flatten(1) @ weight.T).abs().max().item()
                )
    # The residual addition with a bias and the next norm.
    norm = torch.nn.RMSNorm(48, eps=1e-6)
    norm.variance_epsilon = norm.eps
    with torch.no_grad():
        norm.weight.normal_()
    x, bias, residual = torch.randn(5, 48), torch.randn(48), torch.randn(5, 48)
    expected_residual = residual + (x + bias)
    normed = decode_kernels.add_rms_norm(x, bias, residual, norm)
    gaps["add_rms_norm, residual"] = (residual - expected_residual).abs().max().item()
    gaps["add_rms_norm, norm"] = (normed - norm(expected_residual)).abs().max().item()
    # A product's output in slices of its reduction, summed on the way in.
    parts, residual = torch.randn(4, 5, 48), torch.randn(5, 48)
    expected_residual = residual + (parts.sum(0) + bias)
    normed = decode_kernels.add_rms_norm(parts, bias, residual, norm)
    gaps["add_rms_norm of parts, residual"] = (residual - expected_residual).abs().max().item()
    gaps["add_rms_norm of parts, norm"] = (normed - norm(expected_residual)).abs().max().item()
    # One row's projections with the work before them (K not a multiple of the block).
    weight, x, bias, residual = (
        torch.randn(70, 300),
        torch.randn(1, 300),
        torch.randn(300),
        torch.randn(1, 300),
    )
    norm300 = torch.nn.RMSNorm(300, eps=1e-6)
    norm300.variance_epsilon = norm300.eps
    with torch.no_grad():
        norm300.weight.normal_()
    gaps["gemv"] = (decode_kernels.gemv(weight, x) - x @ weight.T).abs().max().item()
    out, stream = decode_kernels.gemv_after_norm(weight, x, bias, residual, norm300)
    gaps["gemv after the norm"] = (
        (out - norm300(residual + (x + bias)) @ weight.T).abs().max().item()
    )
    gaps["gemv after the norm, stream"] = (stream - (residual + (x + bias))).abs().max().item()
    out, _ = decode_kernels.gemv_after_norm(weight, None, None, residual, norm300)
    gaps["gemv after the norm alone"] = (out - norm300(residual) @ weight.T).abs().max().item()
    # The q/k/v gemv with the rotary embedding and the cache writes on its outputs, against
    # gemv_after_norm then rope_and_cache (with and without the projection's bias).
    for heads, kv_heads, dim, hidden, with_bias in ((4, 2, 16, 300, True), (14, 2, 64, 128, False)):
        n = (heads + 2 * kv_heads) * dim
        qkv_weight, x, bias, residual = torch.randn(n, hidden), *torch.randn(3, 1, hidden)
        normed = torch.nn.RMSNorm(hidden, eps=1e-6)
        normed.variance_epsilon = normed.eps
        qkv_bias = torch.randn(n) if with_bias else None
        cos, sin = torch.randn(2, 9, heads + kv_heads, dim)
        positions, slot = torch.tensor([5]), torch.tensor([3])
        caches = {name: torch.zeros(2, 2, kv_heads, 7, dim) for name in ("fused", "apart")}
        query, stream = decode_kernels.gemv_rope_after_norm(
            qkv_weight, x, bias[0], residual, normed, qkv_bias, cos, sin, positions, slot,
            *caches["fused"], heads, kv_heads,
        )  # fmt: skip
        qkv, expected_stream = decode_kernels.gemv_after_norm(
            qkv_weight, x, bias[0], residual, normed
        )
        expected_query = decode_kernels.rope_and_cache(
            qkv, qkv_bias, cos, sin, positions, slot, *caches["apart"], heads, kv_heads
        )
        name = f"gemv with the rotary embedding, {heads} heads of {dim}"
        gaps[f"{name}, queries"] = (query - expected_query).abs().max().item()
        gaps[f"{name}, stream"] = (stream - expected_stream).abs().max().item()
        gaps[f"{name}, cache"] = (caches["fused"] - caches["apart"]).abs().max().item()
        assert caches["apart"][:, 0, :, 3].abs().sum() > 0  # the reference wrote slot 3
    # The prefill's rotary embedding and cache writes: a block of 5 prompt tokens a row
    # from slot 3, each at its own position; padding tokens (`valid` False) leave the cache.
    heads, kv_heads, dim, per_row, batch = 4, 2, 16, 5, 3
    qkv = torch.randn(batch * per_row, (heads + 2 * kv_heads) * dim)
    cos, sin = torch.randn(2, 20, heads + kv_heads, dim)
    positions = torch.randint(0, 20, (batch * per_row,))
    valid = torch.rand(batch * per_row) > 0.3
    keys, values = torch.zeros(2, batch, kv_heads, 9, dim)
    query = decode_kernels.rope_and_cache(
        qkv, None, cos, sin, positions, torch.tensor([3]), keys, values, heads, kv_heads,
        per_row=per_row, valid=valid,
    )  # fmt: skip
    x = qkv[:, : (heads + kv_heads) * dim].unflatten(-1, (heads + kv_heads, dim))
    rotated = x * cos[positions] + x.roll(dim // 2, dims=-1) * sin[positions]
    expected_keys, expected_values = torch.zeros(2, batch, kv_heads, 9, dim)
    for token in torch.nonzero(valid)[:, 0].tolist():
        row, slot = token // per_row, 3 + token % per_row
        expected_keys[row, :, slot] = rotated[token, heads:]
        expected_values[row, :, slot] = qkv[token, (heads + kv_heads) * dim :].view(kv_heads, dim)
    gaps["prefill rotary, queries"] = (query - rotated[:, :heads]).abs().max().item()
    gaps["prefill rotary, keys"] = (keys - expected_keys).abs().max().item()
    gaps["prefill rotary, values"] = (values - expected_values).abs().max().item()
    assert keys[:, :, 3:8].ne(0).any(-1).sum() == valid.sum() * kv_heads  # only valid tokens
    gate_up, bias = torch.randn(1, 600), torch.randn(600)
    gate, up = (gate_up + bias).chunk(2, dim=-1)
    expected = (torch.nn.functional.silu(gate) * up) @ weight.T
    got = decode_kernels.gemv_after_silu(weight, gate_up, bias)
    gaps["gemv after silu"] = (got - expected).abs().max().item()
    gate_up, bias = torch.randn(3, 40), torch.randn(40)
    gate, up = (gate_up + bias).chunk(2, dim=-1)
    got = decode_kernels.silu_and_mul(gate_up, bias)
    gaps["silu_and_mul, bias"] = (got - torch.nn.functional.silu(gate) * up).abs().max().item()
    # Sampling: greedy and tempered rows, a vocabulary ending in a partial block.
    from types import SimpleNamespace

    from rlcore.policy.static_decode import StaticDecoder, _Workspace, sample_tokens

    temperature = torch.tensor([0.0, 0.5, 1.0, 1.7] * 12)
    for dtype in (torch.float32, torch.bfloat16):
        logits = (torch.randn(48, 5000) * 3).to(dtype)
        uniforms = torch.rand(48)
        ws = _Workspace(48, 3, 1, 1, 16, torch.float32, torch.device("cpu"), eos=[])
        ws.temperature.copy_(temperature)
        ws.uniforms[:, 1], ws.max_new[:] = uniforms, 3
        ws.step.fill_(1)
        decode_kernels.sample_and_record(logits, ws, 48)
        tokens, logprobs = ws.out_tokens[:, 1], ws.out_logprobs[:, 1]
        expected_tokens, expected_logprobs = sample_tokens(logits, temperature, None, uniforms)
        name = f"sample, {str(dtype).split('.')[-1]}"
        # Each draw is the token where the uniform falls in the float64 cumulative sum, up
        # to float32 rounding (a uniform that close to a bound may give either token, here
        # as in the torch path); greedy rows the first argmax.
        off = 0
        for row in range(48):
            if temperature[row] <= 0:
                off += int(tokens[row] != logits[row].float().argmax())
                continue
            cdf = torch.softmax(logits[row].double() / float(temperature[row]), -1).cumsum(0)
            token, u = int(tokens[row]), float(uniforms[row])
            off += int(not (cdf[token - 1] if token else 0.0) - 1e-6 <= u < cdf[token] + 1e-6)
        gaps[f"{name}, draws off the float64 ones"] = off
        assert (tokens == expected_tokens).sum() >= 46  # the torch path's, but at a bound
        gaps[f"{name}, logprobs"] = (
            (logprobs - expected_logprobs)[tokens == expected_tokens].abs().max().item()
        )

    # The decoder's step bookkeeping in the sampling kernel, against its torch ops: rows
    # that draw an end token (live or already done), reach max_new, or go on.
    def workspace():
        ws = _Workspace(10, 6, 1, 1, 16, torch.float32, torch.device("cpu"), eos=[3, 7])
        generator = torch.Generator().manual_seed(1)
        ws.uniforms.uniform_(generator=generator)
        ws.temperature.copy_(torch.tensor([0.0, 1.0] * 5))
        ws.max_new.copy_(torch.tensor([6, 6, 2, 2, 6, 6, 6, 6, 1, 6]))
        ws.lengths.copy_(torch.tensor([0, 1, 1, 1, 0, 1, 0, 0, 0, 0]))
        ws.done.copy_(torch.tensor([False, False, False, False, True, True] + [False] * 4))
        ws.step.fill_(2)
        return ws

    logits = torch.randn(8, 50)
    logits[[0, 1, 4, 5], 3] = 30.0  # an end token, greedy and sampled, live and done rows
    logits[2, 7] = 30.0
    mine, theirs = workspace(), workspace()
    decode_kernels.sample_and_record(logits, mine, 8)
    mine.step.add_(1)
    StaticDecoder._sample_and_record(SimpleNamespace(kernels=False), theirs, 8, logits,
                                     False, True)  # fmt: skip
    assert theirs.stopped.any() and theirs.done[2:4].all()  # the cases happened
    gaps["sample_and_record, state not the torch path's"] = sum(
        (getattr(mine, name).float() != getattr(theirs, name).float()).sum().item()
        for name in (*_Workspace.STATE, "out_tokens")
    )
    gaps["sample_and_record, logprobs"] = (
        (mine.out_logprobs - theirs.out_logprobs).abs().max().item()
    )
    return gaps


def test_each_kernel_gives_its_torch_ops_result():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    root = Path(__file__).resolve().parent.parent
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    child = subprocess.run(
        [sys.executable, __file__, "one by one"], env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert child.returncode == 0, child.stderr[-3000:]
    gaps = json.loads(child.stdout.strip().splitlines()[-1])
    assert len(gaps) == 33
    for name, gap in gaps.items():
        assert gap < 1e-4, name


def test_the_kernels_are_refused_where_they_cannot_run():
    from rlcore.policy.static_decode import StaticDecoder

    with pytest.raises(ValueError, match="decode kernels cannot run"):
        StaticDecoder(model_of(Qwen2Config), [0], 0, use_graphs=False, kernels=True)
    # Dependent launch (its wait and trigger are inline PTX) only for compiled kernels on a
    # card: never on the CPU, and never under Triton's interpreter, which runs no PTX.
    from rlcore.policy import decode_kernels

    assert decode_kernels.dependent_launch(torch.device("cpu")) == {"PDL": False}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "1")
        assert decode_kernels.dependent_launch(torch.device("cuda", 0)) == {"PDL": False}


if __name__ == "__main__":  # the child of the tests above that need Triton's interpreter
    if sys.argv[1] == "one by one":
        print(json.dumps(check_kernels_one_by_one()))
    else:
        print(json.dumps(compare_kernels_with_torch_ops(sys.argv[1], sys.argv[2])))
