"""Prompts of growing conversations: ids reused from earlier turns' prompts are exactly the
ids of tokenizing each prompt whole, on the shipped tokenizer and in real rollouts."""

import asyncio
import random

import pytest
from tokenizers import AddedToken
from transformers import AutoTokenizer

from rlcore.envs.registry import load_environment
from rlcore.policy.local import LocalEngine
from rlcore.policy.prompts import PrefixTokenizer, prefix_reuse_problem
from rlcore.types import SamplingParams

# Pieces of replies that sit badly at a cut: leading newlines and spaces, added tokens,
# a combining accent (NFC), digits, contractions.
PIECES = ["\n", "\n\n", " ", "  ", "<think>", "</think>", "<move>", "4", "</move>", "<|im_end|>",
          "<|im_start|>", "é", "\u0301", "'s", "abc", "X.O", "\t", "12", "?!"]  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer(default_tiny_model):
    return AutoTokenizer.from_pretrained(default_tiny_model)


def whole(tokenizer, texts):
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def growing_prompts(tokenizer, conversations: int, turns: int, seed: int = 0):
    """Per turn, the prompts of `conversations` chats, each turn's prompt the last one's
    plus a random reply and a user message."""
    rng = random.Random(seed)
    chats = [[{"role": "system", "content": "Play."}, {"role": "user", "content": "Go."}]]
    chats = [list(chats[0]) for _ in range(conversations)]
    for _ in range(turns):
        yield [
            tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
            for chat in chats
        ]
        for chat in chats:
            reply = "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 12)))
            chat.append({"role": "assistant", "content": reply})
            chat.append({"role": "user", "content": rng.choice(PIECES) + "Your move."})


def test_the_shipped_tokenizer_allows_reuse(tokenizer):
    assert prefix_reuse_problem(tokenizer) is None


def test_growing_prompts_tokenize_as_whole_texts(tokenizer):
    prompts = PrefixTokenizer(tokenizer)
    for texts in growing_prompts(tokenizer, conversations=40, turns=6):
        assert prompts.encode(texts) == whole(tokenizer, texts)
    assert prompts.reused_chars > prompts.tokenized_chars


def test_repeated_and_unrelated_texts_tokenize_as_whole_texts(tokenizer):
    prompts = PrefixTokenizer(tokenizer, max_entries=3)
    rng = random.Random(1)
    for _ in range(20):
        texts = ["".join(rng.choice(PIECES) for _ in range(rng.randint(0, 30))) for _ in range(6)]
        texts += texts[:2]
        assert prompts.encode(texts) == whole(tokenizer, texts)
    assert len(prompts._entries) <= 3


def test_a_tokenizer_that_strips_beside_an_added_token_is_tokenized_whole(default_tiny_model):
    stripping = AutoTokenizer.from_pretrained(default_tiny_model)
    stripping.add_tokens([AddedToken("<sep>", rstrip=True)])
    assert "strips whitespace" in prefix_reuse_problem(stripping)
    prompts = PrefixTokenizer(stripping)
    for texts in growing_prompts(stripping, conversations=4, turns=3):
        texts = [text + "<sep>  x" for text in texts]
        assert prompts.encode(texts) == whole(stripping, texts)
    assert prompts.reused_chars == 0


def test_overlapping_added_tokens_are_refused(default_tiny_model):
    overlapping = AutoTokenizer.from_pretrained(default_tiny_model)
    overlapping.add_tokens([AddedToken("<move>4", normalized=False)])
    assert "inside" in prefix_reuse_problem(overlapping)


@pytest.mark.parametrize("env_name", ["tictactoe", "double_check", "calculator"])
def test_rollout_prompts_are_the_whole_rendered_conversation_tokenized(
    default_tiny_model, env_name
):
    """Each turn's prompt ids, in real multi-turn rollouts of the untrained model, are the
    tokenizer's ids of that turn's whole rendered conversation."""
    engine = LocalEngine(default_tiny_model, device="cpu", name="tiny")
    env = load_environment(env_name)
    examples = [env.make_example(index, 0) for index in range(3)]
    sampling = SamplingParams(temperature=1.0, max_tokens=12, seed=3)

    async def play():
        return await asyncio.gather(*(env.rollout(engine, ex, sampling) for ex in examples))

    rollouts = asyncio.run(play())
    checked = 0
    for rollout in rollouts:
        assistant_at = [i for i, m in enumerate(rollout.messages) if m["role"] == "assistant"]
        for turn, at in zip(rollout.turns, assistant_at, strict=False):
            text = engine.render_prompt(rollout.messages[:at], env.tool_schemas)
            assert turn.prompt_ids == whole(engine.tokenizer, [text])[0]
            checked += 1
    assert checked >= len(rollouts)
    if checked > len(rollouts):  # some game went on after its first reply
        assert engine._prompt_tokenizer.reused_chars > 0
