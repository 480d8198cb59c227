"""The static decoder (a preallocated KV cache, the decode step a CUDA graph on a GPU) run
eagerly on the CPU: the same greedy replies and logprobs as the engine's dynamic loop, sampled
tokens distributed as the model says (checked token by token against a plain forward pass),
uniforms independent across tokens and rows, its bucket choices, finished rows masked then
compacted, rounds split by memory, seeds."""

import asyncio
import math

import pytest
import torch

from rlcore.policy import PolicyError, static_decode
from rlcore.policy.local import LocalEngine
from rlcore.policy.static_decode import (
    CHECK_EVERY,
    LENGTH_STEP,
    counter_uniforms,
    length_bucket,
    row_bucket,
    unsupported_reason,
)
from rlcore.types import SamplingParams


@pytest.fixture(scope="module")
def engines(default_tiny_model):
    dynamic = LocalEngine(default_tiny_model, device="cpu", name="dynamic", decode="dynamic")
    static = LocalEngine(
        model=dynamic.model, tokenizer=dynamic.tokenizer, name="static", decode="static"
    )
    return dynamic, static


def conversation(index: int) -> list[dict]:
    return [
        {"role": "system", "content": "Answer with <move>N</move>."},
        {"role": "user", "content": f"Board {index}: " + "X.O" * (index % 7)},
    ]


def generate_all(engine, samplings):
    async def run():
        return await asyncio.gather(
            *(engine.generate(conversation(i), s) for i, s in enumerate(samplings))
        )

    return asyncio.run(run())


def reference_logprobs(model, prompt_ids, completion_ids, temperature):
    """Log-probabilities of the completion from one plain forward pass, no cache, no padding."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt_ids + completion_ids])).logits[0].float()
    scaled = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    start = len(prompt_ids) - 1
    return [scaled[start + i, token].item() for i, token in enumerate(completion_ids)]


def test_greedy_replies_and_logprobs_are_the_dynamic_loops(engines):
    dynamic, static = engines
    samplings = [SamplingParams(temperature=0.0, max_tokens=10 + 3 * i) for i in range(12)]
    expected = generate_all(dynamic, samplings)
    got = generate_all(static, samplings)
    assert [g.completion_ids for g in got] == [g.completion_ids for g in expected]
    assert [g.finish_reason for g in got] == [g.finish_reason for g in expected]
    for mine, theirs in zip(got, expected, strict=True):
        assert mine.prompt_ids == theirs.prompt_ids
        assert mine.logprobs == pytest.approx(theirs.logprobs, abs=1e-4)


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_sampled_logprobs_match_a_separate_forward_pass(engines, temperature, top_p):
    _, static = engines
    sampling = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=30)
    for generation in generate_all(static, [sampling] * 5):
        assert 1 <= generation.completion_tokens <= 30
        stopped = generation.completion_ids[-1] in static.eos_token_ids
        assert generation.finish_reason == ("stop" if stopped else "length")
        expected = reference_logprobs(
            static.model, generation.prompt_ids, generation.completion_ids, temperature
        )
        assert generation.logprobs == pytest.approx(expected, abs=1e-4)


def transformed_draws(model, generations, temperature, top_p, seed=0) -> torch.Tensor:
    """The randomized probability integral transform of every sampled token: with F the
    model's sampling distribution at that step (temperature, nucleus, tokens in id order),
    F(token - 1) + V * p(token) with V uniform. Exactly uniform on [0, 1) when every token
    was drawn from F, whatever came before it; a biased or stale sampler skews it."""
    width = max(len(g.prompt_ids) + len(g.completion_ids) for g in generations)
    ids = torch.tensor(
        [g.prompt_ids + g.completion_ids + [0] * (width - len(g.prompt_ids) - len(g.completion_ids))
         for g in generations]
    )  # fmt: skip
    with torch.no_grad():
        probabilities = torch.softmax(model(input_ids=ids).logits.float() / temperature, dim=-1)
    if top_p < 1:
        ordered, order = probabilities.sort(dim=-1, descending=True)
        ordered = ordered.masked_fill(ordered.cumsum(-1) - ordered >= top_p, 0.0)
        probabilities = torch.zeros_like(probabilities).scatter(-1, order, ordered)
        probabilities /= probabilities.sum(-1, keepdim=True)
    below = probabilities.cumsum(-1) - probabilities
    jitter = torch.Generator().manual_seed(seed)
    draws = []
    for row, generation in enumerate(generations):
        steps = torch.arange(len(generation.completion_ids)) + len(generation.prompt_ids) - 1
        tokens = torch.tensor(generation.completion_ids)
        chosen = probabilities[row, steps, tokens]
        draws.append(below[row, steps, tokens] + torch.rand(len(tokens), generator=jitter) * chosen)
    return torch.cat(draws)


def kolmogorov_distance(draws: torch.Tensor) -> float:
    """Largest gap between the draws' empirical CDF and the uniform one."""
    ordered, count = draws.sort().values, len(draws)
    above = torch.arange(1, count + 1) / count - ordered
    below = ordered - torch.arange(count) / count
    return max(above.max().item(), below.max().item())


@pytest.mark.parametrize("decode", ["static", "dynamic"])
@pytest.mark.parametrize("temperature, top_p", [(0.7, 1.0), (1.0, 0.8)])
def test_sampled_tokens_follow_the_models_distribution(engines, decode, temperature, top_p):
    dynamic, static = engines
    engine = static if decode == "static" else dynamic
    torch.manual_seed(0)
    sampling = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=24)
    generations = generate_all(engine, [sampling] * 64)
    draws = transformed_draws(engine.model, generations, temperature, top_p)
    assert len(draws) > 1000
    # The Kolmogorov-Smirnov bound at the 1 % level.
    assert kolmogorov_distance(draws) < 1.63 / math.sqrt(len(draws))


def test_the_distribution_check_catches_a_skewed_sampler(engines, monkeypatch):
    """The check above has teeth: uniforms bent towards 0 (low token ids) fail it."""
    _, static = engines
    unbent = static_decode.counter_uniforms
    monkeypatch.setattr(
        static_decode, "counter_uniforms", lambda seeds, counter: unbent(seeds, counter) ** 1.2
    )
    torch.manual_seed(0)
    generations = generate_all(static, [SamplingParams(temperature=0.7, max_tokens=24)] * 64)
    draws = transformed_draws(static.model, generations, 0.7, 1.0)
    assert kolmogorov_distance(draws) > 1.63 / math.sqrt(len(draws))


def test_finished_rows_are_masked_then_compacted_without_disturbing_the_rest(engines):
    _, static = engines
    decoder_before = static._static.compactions if static._static else 0
    short, long = SamplingParams(max_tokens=2), SamplingParams(max_tokens=3 * CHECK_EVERY)
    generations = generate_all(static, [short] * 20 + [long] * 5)
    assert static._static.compactions > decoder_before  # 25 rows (bucket 32) -> 5 (bucket 8)
    assert all(g.completion_tokens <= 2 for g in generations[:20])
    for generation in generations[20:]:
        stopped = generation.completion_ids[-1] in static.eos_token_ids
        assert stopped or generation.completion_tokens == 3 * CHECK_EVERY
        expected = reference_logprobs(
            static.model, generation.prompt_ids, generation.completion_ids, 1.0
        )
        assert generation.logprobs == pytest.approx(expected, abs=1e-4)


def test_a_seeded_request_samples_the_same_alone_or_in_a_batch(engines):
    _, static = engines
    seeded = SamplingParams(temperature=1.0, max_tokens=16, seed=1234)

    async def run():
        alone = await static.generate(conversation(3), seeded)
        crowd = await asyncio.gather(
            static.generate(conversation(0), SamplingParams(max_tokens=30)),
            static.generate(conversation(3), seeded),
            static.generate(conversation(5), SamplingParams(max_tokens=8)),
        )
        return alone, crowd

    alone, crowd = asyncio.run(run())
    assert crowd[1].completion_ids == alone.completion_ids


def test_rounds_split_by_memory_give_the_same_replies(engines, monkeypatch):
    dynamic, static = engines
    samplings = [SamplingParams(temperature=0.0, max_tokens=12)] * 10
    expected = generate_all(dynamic, samplings)
    decoder = static._static
    monkeypatch.setattr(decoder, "_rows_per_round", lambda rows, length: 3)
    rounds_before = decoder.rounds
    got = generate_all(static, samplings)
    assert decoder.rounds - rounds_before == 4
    assert [g.completion_ids for g in got] == [g.completion_ids for g in expected]


@pytest.mark.parametrize("store", [False, True])
def test_a_prefix_every_prompt_shares_is_prefilled_once_with_the_same_replies(
    engines, monkeypatch, store
):
    """Every prompt starts with the same system turn: prefilled in one row and copied to the
    others (the threshold lowered so the tiny model shares), the replies and logprobs are the
    dynamic loop's. With the prefix store, the second call's rows (second turns, new
    conversations) all load stored keys that hold the shared part: nothing to share again;
    rows the store cannot serve share beside rows it can."""
    dynamic, _ = engines
    monkeypatch.setattr(static_decode, "SHARED_PREFILL_FLOPS", 0)
    static = LocalEngine(
        model=dynamic.model,
        tokenizer=dynamic.tokenizer,
        decode="static",
        prefix_cache_bytes=None if store else 0,
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=12)

    def compare(conversations):
        async def run(engine):
            return await asyncio.gather(*(engine.generate(c, greedy) for c in conversations))

        expected, got = asyncio.run(run(dynamic)), asyncio.run(run(static))
        assert [g.completion_ids for g in got] == [g.completion_ids for g in expected]
        for mine, theirs in zip(got, expected, strict=True):
            assert mine.logprobs == pytest.approx(theirs.logprobs, abs=1e-4)
        return got

    first_turns = [conversation(i) for i in range(6)]
    replies = compare(first_turns)
    assert static._static.shared_prefills == 1
    second_turns = [
        [*c, {"role": "assistant", "content": r.text}, {"role": "user", "content": "Again."}]
        for c, r in zip(first_turns, replies, strict=True)
    ]
    hits_before = static.prefix_cache.hits if store else 0
    compare(second_turns + [conversation(i) for i in range(6, 12)])
    if store:
        assert static.prefix_cache.hits - hits_before == 12
        assert static._static.shared_prefills == 1
        # Rows the store serves beside rows it cannot (another system turn, sharing only
        # its first tokens with the stored ones): the latter share those between them.
        others = [
            [{"role": "system", "content": "Play."}, {"role": "user", "content": f"Board {i}"}]
            for i in range(4)
        ]
        hits_before = static.prefix_cache.hits
        compare(second_turns[:3] + others)
        assert static.prefix_cache.hits - hits_before == 3
        assert static._static.shared_prefills == 2
    else:
        assert static._static.shared_prefills == 2


def test_weights_changed_in_place_are_seen_by_the_next_generation(tmp_path):
    from rlcore.policy.tiny import build_tiny_model

    small = {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "intermediate_size": 256}
    dynamic = LocalEngine(build_tiny_model(tmp_path / "m", **small), device="cpu", decode="dynamic")
    static = LocalEngine(model=dynamic.model, tokenizer=dynamic.tokenizer, decode="static")
    greedy = [SamplingParams(temperature=0.0, max_tokens=12)] * 3
    generate_all(static, greedy)
    workspace = static._static.workspace
    with torch.no_grad():
        for parameter in dynamic.model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    got = generate_all(static, greedy)
    assert static._static.workspace is workspace  # reused, not rebuilt
    assert [g.completion_ids for g in got] == [
        g.completion_ids for g in generate_all(dynamic, greedy)
    ]


def test_buckets_cover_every_batch_with_few_shapes():
    assert [row_bucket(n) for n in (1, 2, 3, 5, 9, 33, 65, 100, 256, 1000, 1025)] == [
        1, 2, 4, 8, 16, 64, 96, 128, 256, 1024, 1280,
    ]  # fmt: skip
    assert len({row_bucket(n) for n in range(1, 1025)}) == 15
    assert length_bucket(1, 1024) == LENGTH_STEP
    assert length_bucket(LENGTH_STEP + 1, 1024) == 2 * LENGTH_STEP
    assert length_bucket(1000, 896) == 896


def test_counter_uniforms_depend_on_seed_and_counter_only():
    seeds = torch.tensor([0, 1, 2**40 + 7, 2**62 - 1] * 2500)
    first = counter_uniforms(seeds, torch.tensor([3]))
    assert torch.equal(first, counter_uniforms(seeds, torch.tensor([3])))
    assert torch.equal(first[:4], first[4:8])
    assert len(set(first[:4].tolist())) == 4
    assert not torch.equal(first, counter_uniforms(seeds, torch.tensor([4])))
    draws = counter_uniforms(torch.arange(10_000), torch.tensor([0]))
    assert draws.min() >= 0 and draws.max() < 1
    assert abs(draws.mean().item() - 0.5) < 0.02
    assert abs((draws < 0.1).float().mean().item() - 0.1) < 0.02


def pair_chi_square(first: torch.Tensor, second: torch.Tensor, cells: int = 16) -> float:
    """Pearson's chi-square of the pairs (first, second) on a cells x cells grid of the unit
    square: cells**2 - 1 degrees of freedom when the pairs are independent uniforms."""
    index = (first * cells).long() * cells + (second * cells).long()
    counts = torch.bincount(index, minlength=cells * cells).float()
    expected = len(first) / cells**2
    return ((counts - expected) ** 2 / expected).sum().item()


def test_counter_uniforms_are_independent_across_tokens_and_rows():
    torch.manual_seed(0)
    seeds = torch.randint(0, 2**62, (200_000,))  # as the decoder draws them
    token, next_token = (counter_uniforms(seeds, torch.tensor([t])) for t in (7, 8))
    # 255 degrees of freedom: 330 is the 99.9 % quantile.
    assert pair_chi_square(token, next_token) < 330
    assert pair_chi_square(token[0::2], token[1::2]) < 330
    assert abs(torch.corrcoef(torch.stack([token, next_token]))[0, 1].item()) < 0.01
    assert pair_chi_square(token, token**2 % 1) > 330  # a dependent pair is caught


def test_other_architectures_keep_the_dynamic_loop():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    assert "gpt2" in unsupported_reason(gpt2)


def test_an_unknown_decode_loop_is_named(engines):
    dynamic, _ = engines
    with pytest.raises(PolicyError, match="decode must be one of auto, static, dynamic"):
        LocalEngine(model=dynamic.model, tokenizer=dynamic.tokenizer, decode="graph")
    assert dynamic.max_batch_size == 64  # the CPU keeps small batches


def test_the_two_level_draw_over_a_large_vocabulary_is_the_full_cumulative_draw():
    """inverse_cdf over 16,384 tokens (blocks, then one block) picks what a full cumulative
    sum picks, but for float rounding at a boundary, and draws from the distribution."""
    generator = torch.Generator().manual_seed(0)
    vocab = 16_384
    assert vocab % static_decode.SAMPLE_BLOCK == 0 and vocab >= 64 * static_decode.SAMPLE_BLOCK
    agree = total = 0
    for _ in range(40):
        probabilities = torch.softmax(torch.randn(64, vocab, generator=generator) * 3, dim=-1)
        uniforms = torch.rand(64, generator=generator)
        cumulative = probabilities.cumsum(-1)
        full = torch.searchsorted(cumulative, (uniforms * cumulative[:, -1])[:, None], right=True)
        agree += (static_decode.inverse_cdf(probabilities, uniforms) == full).sum().item()
        total += 64
    assert agree >= 0.995 * total
    # One distribution, 20,000 draws: the randomized probability integral transform is
    # uniform (Kolmogorov-Smirnov at the 1 % level).
    probabilities = torch.softmax(torch.randn(vocab, generator=generator) * 2, dim=-1)
    draws = 20_000
    tokens = static_decode.inverse_cdf(
        probabilities.expand(draws, vocab), torch.rand(draws, generator=generator)
    )[:, 0]
    below = probabilities.cumsum(-1) - probabilities
    transformed = below[tokens] + torch.rand(draws, generator=generator) * probabilities[tokens]
    assert kolmogorov_distance(transformed) < 1.63 / math.sqrt(draws)
    skewed = static_decode.inverse_cdf(
        probabilities.expand(draws, vocab), torch.rand(draws, generator=generator) ** 1.1
    )[:, 0]
    transformed = below[skewed] + torch.rand(draws, generator=generator) * probabilities[skewed]
    assert kolmogorov_distance(transformed) > 1.63 / math.sqrt(draws)  # the check has teeth
