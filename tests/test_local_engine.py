"""The local engine: batched concurrent generation on the tiny model, token ids and
logprobs a trainer can use, stopping, determinism and clear load errors."""

import asyncio
import math

import pytest
import torch

from rlcore.policy import PolicyError
from rlcore.policy.local import LocalEngine
from rlcore.policy.tiny import build_tiny_model
from rlcore.types import SamplingParams

SMALL = {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "intermediate_size": 256}


@pytest.fixture(scope="module")
def engine(default_tiny_model):
    return LocalEngine(default_tiny_model, device="cpu", name="tiny")


def conversation(index: int) -> list[dict]:
    return [
        {"role": "system", "content": "Answer with <move>N</move>."},
        {"role": "user", "content": f"Board {index}: " + "X.O" * (index % 5)},
    ]


def reference_logprobs(engine, prompt_ids, completion_ids, temperature):
    """Log-probabilities of the completion from one plain forward pass, no cache, no padding."""
    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        logits = engine.model(input_ids=ids).logits[0].float()
    scaled = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    start = len(prompt_ids) - 1
    return [scaled[start + i, token].item() for i, token in enumerate(completion_ids)]


def teach(engine, messages, reply, steps=200):
    """Fine-tune the engine's model until greedy decoding of `messages` gives `reply` + eos."""
    prompt = engine.encode_prompt(messages)
    target = engine.tokenizer(reply, add_special_tokens=False)["input_ids"]
    target.append(engine.tokenizer.eos_token_id)
    ids = torch.tensor([prompt + target])
    labels = ids.clone()
    labels[0, : len(prompt)] = -100
    optimizer = torch.optim.Adam(engine.model.parameters(), lr=5e-3)
    engine.model.train()
    for _ in range(steps):
        loss = engine.model(input_ids=ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if loss.item() < 0.05:
            break
    return prompt, target


async def test_concurrent_requests_are_batched_and_well_formed(engine):
    batches_before = engine.batches_run
    limits = [3 + i for i in range(12)]
    generations = await asyncio.gather(
        *(
            engine.generate(conversation(i), SamplingParams(temperature=1.0, max_tokens=limit))
            for i, limit in enumerate(limits)
        )
    )
    assert engine.batches_run - batches_before < len(limits)
    for i, (generation, limit) in enumerate(zip(generations, limits, strict=True)):
        assert generation.prompt_ids == engine.encode_prompt(conversation(i))
        assert generation.prompt_tokens == len(generation.prompt_ids)
        assert 1 <= generation.completion_tokens <= limit
        assert len(generation.completion_ids) == len(generation.logprobs)
        assert len(generation.completion_ids) == generation.completion_tokens
        assert generation.text == engine.tokenizer.decode(
            generation.completion_ids, skip_special_tokens=True
        )
        assert all(math.isfinite(lp) and lp <= 0 for lp in generation.logprobs)
        stopped = generation.completion_ids[-1] in engine.eos_token_ids
        assert generation.finish_reason == ("stop" if stopped else "length")
        if not stopped:
            assert generation.completion_tokens == limit


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 1.0), (1.3, 0.9), (0.0, 1.0)])
async def test_logprobs_match_a_separate_forward_pass(engine, temperature, top_p):
    sampling = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=24)
    generations = await asyncio.gather(
        *(engine.generate(conversation(i), sampling) for i in range(4))
    )
    for generation in generations:
        expected = reference_logprobs(
            engine, generation.prompt_ids, generation.completion_ids, temperature
        )
        assert generation.logprobs == pytest.approx(expected, abs=1e-4)


async def test_rows_leaving_the_batch_early_do_not_disturb_the_rest(engine):
    short, long = SamplingParams(max_tokens=2), SamplingParams(max_tokens=12)
    generations = await asyncio.gather(
        *(engine.generate(conversation(i), short if i < 20 else long) for i in range(25))
    )
    for generation in generations[20:]:
        stopped = generation.completion_ids[-1] in engine.eos_token_ids
        assert stopped or generation.completion_tokens == 12
        expected = reference_logprobs(engine, generation.prompt_ids, generation.completion_ids, 1)
        assert generation.logprobs == pytest.approx(expected, abs=1e-4)
    assert all(g.completion_tokens <= 2 for g in generations[:20])


async def test_max_tokens_ends_with_length(engine):
    generation = await engine.generate(
        conversation(1), SamplingParams(temperature=0.0, max_tokens=5)
    )
    assert generation.finish_reason == "length"
    assert generation.completion_tokens == 5


async def test_greedy_is_deterministic(engine):
    sampling = SamplingParams(temperature=0.0, max_tokens=20)
    first = await asyncio.gather(*(engine.generate(conversation(i), sampling) for i in range(6)))
    second = await asyncio.gather(*(engine.generate(conversation(i), sampling) for i in range(6)))
    assert [g.completion_ids for g in first] == [g.completion_ids for g in second]


async def test_a_seeded_request_samples_the_same_alone_or_in_a_batch(engine):
    seeded = SamplingParams(temperature=1.0, max_tokens=16, seed=1234)
    alone = await engine.generate(conversation(3), seeded)
    crowd = await asyncio.gather(
        engine.generate(conversation(0), SamplingParams(max_tokens=30)),
        engine.generate(conversation(3), seeded),
        engine.generate(conversation(4), SamplingParams(max_tokens=8)),
    )
    assert crowd[1].completion_ids == alone.completion_ids


def test_the_engine_serves_one_event_loop_after_another(engine):
    sampling = SamplingParams(temperature=0.0, max_tokens=4)
    first = asyncio.run(engine.generate(conversation(2), sampling))
    second = asyncio.run(engine.generate(conversation(2), sampling))
    assert first.completion_ids == second.completion_ids


def test_a_shared_model_keeps_its_training_flag_and_gets_no_gradients(tmp_path):
    trained = LocalEngine(build_tiny_model(tmp_path / "m", **SMALL), device="cpu")
    shared = LocalEngine(model=trained.model, tokenizer=trained.tokenizer, name="live")
    assert shared.model is trained.model and shared.device == "cpu"
    shared.model.train()
    asyncio.run(shared.generate(conversation(0), SamplingParams(max_tokens=4)))
    assert shared.model.training
    assert all(p.grad is None for p in shared.model.parameters())


def test_a_taught_reply_stops_at_eos_and_keeps_it(tmp_path):
    taught = LocalEngine(build_tiny_model(tmp_path / "m", **SMALL), device="cpu")
    prompt, target = teach(taught, conversation(0), "<move>4</move>")
    generation = asyncio.run(
        taught.generate(conversation(0), SamplingParams(temperature=0.0, max_tokens=20))
    )
    assert generation.finish_reason == "stop"
    assert generation.text == "<move>4</move>"
    assert generation.completion_ids == target  # ends with <|im_end|>
    assert generation.completion_ids[-1] == taught.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert generation.prompt_ids == prompt


def test_many_concurrent_requests_run_in_few_batches(engine):
    async def many():
        before = engine.batches_run
        sampling = SamplingParams(temperature=1.0, max_tokens=6)
        await asyncio.gather(*(engine.generate(conversation(i), sampling) for i in range(100)))
        return engine.batches_run - before

    batches = asyncio.run(many())
    assert batches == math.ceil(100 / engine.max_batch_size)


def test_a_missing_model_path_is_a_policy_error_naming_it(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(PolicyError, match="no-such-model.*does not exist"):
        LocalEngine(str(missing), device="cpu")


def test_a_directory_without_a_model_is_a_policy_error(tmp_path):
    with pytest.raises(PolicyError, match="not a Hugging Face model directory"):
        LocalEngine(str(tmp_path), device="cpu")


def test_bad_device_and_sampling_are_named(engine):
    with pytest.raises(PolicyError, match="unknown device 'tpu'"):
        LocalEngine(model=engine.model, tokenizer=engine.tokenizer, device="tpu")
    with pytest.raises(PolicyError, match="temperature must be >= 0"):
        asyncio.run(engine.generate(conversation(0), SamplingParams(temperature=-1)))
    with pytest.raises(PolicyError, match="top_p must be in"):
        asyncio.run(engine.generate(conversation(0), SamplingParams(top_p=0)))


def test_a_prompt_longer_than_the_context_is_refused(engine):
    too_long = [{"role": "user", "content": "x" * (engine.context_length + 10)}]
    with pytest.raises(PolicyError, match="context of 2048"):
        asyncio.run(engine.generate(too_long, SamplingParams(max_tokens=4)))


@pytest.mark.parametrize("prefix_cache_bytes", [None, 0])
def test_rows_with_one_prompt_are_prefilled_once_and_sample_their_own_tokens(
    default_tiny_model, monkeypatch, prefix_cache_bytes
):
    """A group's rollouts start from one prompt: the batch's prefill runs each distinct
    prompt once, and every copy draws its own reply, the one it draws alone (seeded), with
    the logprobs of a plain forward pass."""
    engine = LocalEngine(default_tiny_model, device="cpu", prefix_cache_bytes=prefix_cache_bytes)
    prefilled = []
    forward = LocalEngine._forward

    def counting(self, input_ids, *rest):
        if input_ids.shape[1] > 1:
            prefilled.append(input_ids.shape[0])
        return forward(self, input_ids, *rest)

    monkeypatch.setattr(LocalEngine, "_forward", counting)
    prompts = [conversation(index % 3) for index in range(12)]
    samplings = [SamplingParams(temperature=1.0, max_tokens=12, seed=40 + i) for i in range(12)]

    async def together():
        return await asyncio.gather(
            *(engine.generate(p, s) for p, s in zip(prompts, samplings, strict=True))
        )

    batched = asyncio.run(together())
    assert prefilled[0] == 3  # 12 rows, 3 distinct prompts
    assert len({tuple(g.completion_ids) for g in batched}) > 3  # copies drew their own
    for prompt, sampling, generation in zip(prompts, samplings, batched, strict=True):
        alone = asyncio.run(engine.generate(prompt, sampling))
        assert alone.completion_ids == generation.completion_ids
        expected = reference_logprobs(engine, generation.prompt_ids, generation.completion_ids, 1.0)
        assert generation.logprobs == pytest.approx(expected, abs=1e-4)
