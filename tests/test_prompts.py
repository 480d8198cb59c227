"""Prompts of growing conversations: text rendered only for the messages added since an
earlier prompt, and ids reused from earlier prompts, are exactly the text and ids of
rendering and tokenizing each prompt whole, on the shipped tokenizer and template, on
templates that look beyond the message at hand, and in real rollouts of several envs;
replies decoded in one batch are the replies decoded one by one."""

import asyncio
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken
from transformers import AutoTokenizer

from rlcore.envs.registry import load_environment
from rlcore.policy.local import LocalEngine
from rlcore.policy.prompts import (
    PrefixTokenizer,
    PromptRenderer,
    message_local_problem,
    plain_fast_encode,
    prefix_reuse_problem,
    render_builtin_chatml,
)
from rlcore.policy.tiny import CHAT_TEMPLATE
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


@pytest.mark.parametrize("search_window", [4096, 30, 1])
def test_growing_prompts_tokenize_as_whole_texts(tokenizer, monkeypatch, search_window):
    """Also when the earlier prompt ends before the last `search_window` characters,
    where the search for it starts."""
    monkeypatch.setattr("rlcore.policy.prompts.SEARCH_WINDOW", search_window)
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
            text = engine.tokenizer.apply_chat_template(
                rollout.messages[:at],
                tools=env.tool_schemas,
                add_generation_prompt=True,
                tokenize=False,
            )
            assert turn.prompt_ids == whole(engine.tokenizer, [text])[0]
            checked += 1
    assert checked >= len(rollouts)
    if checked > len(rollouts):  # some game went on after its first reply
        assert engine._prompt_tokenizer.reused_chars > 0
        if env.tool_schemas:  # rendered by Jinja, the new messages only
            assert engine._renderer.reused_messages > 0
        else:  # plain messages on the built-in template: no Jinja at all
            assert engine._renderer.builtin_rendered > 0


# A ChatML template that, like many published ones, looks at the conversation as a whole:
# a default system prompt unless the first message is one, and a marker on the last one.
LOOKING_AROUND = (
    "{%- if messages[0].role != 'system' -%}{{ '<|im_start|>system\\nBe brief.<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message.role + '\\n' + message.content }}"
    "{%- if loop.last %} (last){% endif -%}{{ '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


def test_the_shipped_template_renders_each_message_alone():
    assert message_local_problem(CHAT_TEMPLATE) is None


@pytest.mark.parametrize(
    ("template", "problem"),
    [
        (LOOKING_AROUND, "reads messages outside"),
        ("{% for m in messages %}{{ loop.index }}{{ m.content }}{% endfor %}", "`loop`"),
        ("{% for m in messages %}{{ messages|length }}{% endfor %}", "'messages'"),
        ("{% for m in messages %}{% if m.role == 'x' %}{% break %}{% endif %}{% endfor %}",
         "breaks"),
        ("{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = 1 %}{% endfor %}",
         "namespace"),
        ("{% for m in messages %}{{ m.content }}{% endfor %}{% for m in messages %}{% endfor %}",
         "2 top-level loops"),
        ("{% for m in messages %}{{ add_generation_prompt }}{% endfor %}",
         "'add_generation_prompt'"),
    ],
)  # fmt: skip
def test_templates_that_look_beyond_the_message_are_rendered_whole(template, problem):
    assert problem in message_local_problem(template)


def conversations(rng: random.Random, count: int, turns: int, tool_calls: bool = False):
    """Per turn, `count` growing conversations: sometimes a tool result or two, and with
    `tool_calls` some replies carrying tool calls (rendered whole)."""
    chats = [[{"role": "user", "content": "Go."}] for _ in range(count)]
    for chat in chats[::2]:
        chat.insert(0, {"role": "system", "content": "Play."})
    for _ in range(turns):
        yield [list(chat) for chat in chats]
        for chat in chats:
            reply = {"role": "assistant", "content": "".join(rng.choices(PIECES, k=5))}
            if tool_calls and rng.random() < 0.3:
                reply["tool_calls"] = [{"function": {"name": "add", "arguments": {"a": 1}}}]
            chat.append(reply)
            for _ in range(rng.choice([0, 1, 1, 2])):
                chat.append({"role": rng.choice(["user", "tool"]), "content": rng.choice(PIECES)})


@pytest.mark.parametrize("template", ["shipped", "looking around"])
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_growing_conversations_render_as_whole_texts(default_tiny_model, template, tools):
    tokenizer = AutoTokenizer.from_pretrained(default_tiny_model)
    if template == "looking around":
        tokenizer.chat_template = LOOKING_AROUND
    renderer = PromptRenderer(tokenizer, max_entries=50)
    for chats in conversations(random.Random(template), count=30, turns=6, tool_calls=True):
        for chat in chats:
            expected = tokenizer.apply_chat_template(
                chat, tools=tools, add_generation_prompt=True, tokenize=False
            )
            assert renderer.render(chat, tools) == expected
    if template == "shipped" and tools is None:  # plain chats skip Jinja, the rest render whole
        assert renderer.builtin_rendered > 0
    else:
        assert (renderer.reused_messages > 0) == (template == "shipped")
    assert len(renderer._texts) <= 50


CONTENTS = st.lists(st.sampled_from(PIECES + ["a", "{{", "}}", "{%", "%}", "#"]), max_size=6).map(
    "".join
) | st.text(max_size=12)
MESSAGES = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant", "tool", "x"]), "content": CONTENTS}
    ),
    min_size=1,
    max_size=6,
)


@settings(max_examples=300, deadline=None)
@given(messages=MESSAGES)
def test_the_builtin_template_without_jinja_is_the_templates_text(tokenizer, messages):
    assert tokenizer.chat_template == CHAT_TEMPLATE
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert render_builtin_chatml(messages) == expected


def test_only_plain_messages_skip_jinja(tokenizer):
    assert (
        render_builtin_chatml([{"role": "user", "content": [{"type": "text", "text": "a"}]}])
        is None
    )
    assert render_builtin_chatml([{"role": "assistant", "content": "a", "tool_calls": []}]) is None
    assert render_builtin_chatml([]) is None
    renderer = PromptRenderer(tokenizer)
    assert renderer.builtin
    chat = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    assert renderer.render(chat, tools) == tokenizer.apply_chat_template(
        chat, tools=tools, add_generation_prompt=True, tokenize=False
    )
    assert renderer.builtin_rendered == 0  # tools: Jinja
    renderer.render(chat)
    assert renderer.builtin_rendered == 1


def test_replies_decoded_in_one_batch_are_decoded_one_by_one(default_tiny_model):
    engine = LocalEngine(default_tiny_model, device="cpu", name="tiny")
    assert engine._batch_decode
    rng = random.Random(0)
    vocabulary = len(engine.tokenizer)
    replies = [[rng.randrange(vocabulary) for _ in range(rng.randint(0, 40))] for _ in range(200)]
    completions = [(ids, [], "stop") for ids in replies]
    expected = [engine.tokenizer.decode(ids, skip_special_tokens=True) for ids in replies]
    assert engine._decode_replies(completions) == expected


def test_texts_encoded_by_the_backend_are_transformers_ids(default_tiny_model):
    """The shipped tokenizer skips transformers' call (its per-text conversion) and encodes
    in the backend: the same ids, for whole texts and for the rests of growing prompts."""
    fresh = AutoTokenizer.from_pretrained(default_tiny_model)
    assert plain_fast_encode(fresh)
    prompts, calls = PrefixTokenizer(fresh), []
    backend = fresh.backend_tokenizer
    original = backend.encode_batch_fast

    class Counting:  # the backend is a Rust object: wrap it to count the fast calls
        def __getattr__(self, name):
            return getattr(backend, name)

        def encode_batch_fast(self, texts, **kwargs):
            calls.append(len(texts))
            return original(texts, **kwargs)

    fresh._tokenizer = Counting()
    rng = random.Random(2)
    texts = ["".join(rng.choice(PIECES) for _ in range(rng.randint(0, 40))) for _ in range(50)]
    assert prompts.encode(texts) == whole(fresh, texts)
    for grown in growing_prompts(fresh, conversations=10, turns=4):
        assert prompts.encode(grown) == whole(fresh, grown)
    assert calls  # the backend's own batch encoder did the work


def test_a_backend_left_truncating_is_encoded_by_transformers_call(default_tiny_model):
    """A backend set to truncate (an earlier call asked for it) would cut the ids; the
    encoder then goes through transformers' call, which encodes whole texts."""
    fresh = AutoTokenizer.from_pretrained(default_tiny_model)
    text = "<|im_start|>user\n" + "X.O\n" * 40 + "<|im_end|>\n"
    expected = whole(fresh, [text])
    fresh.backend_tokenizer.enable_truncation(5)
    assert PrefixTokenizer(fresh).encode([text]) == expected
    assert len(expected[0]) > 5


def test_a_tokenizer_with_its_own_encoding_is_encoded_by_its_call(default_tiny_model):
    fresh = AutoTokenizer.from_pretrained(default_tiny_model)

    class Own(type(fresh)):
        def _encode_plus(self, *args, **kwargs):
            return super()._encode_plus(*args, **kwargs)

    fresh.__class__ = Own
    assert not plain_fast_encode(fresh)
    assert not plain_fast_encode(object())
