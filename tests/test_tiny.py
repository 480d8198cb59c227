"""The built-in tiny model: tokenizer, chat template, Hugging Face layout, cached builds."""

import json
import os
import threading
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlcore.policy.tiny import (
    CHAT_TEMPLATE,
    EXTRA_CHARACTERS,
    TAG_TOKENS,
    build_tiny_model,
    build_tiny_tokenizer,
    ensure_tiny_model,
    tiny_config_hash,
)

SMALL = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64}


def read_json(directory, name):
    return json.loads((Path(directory) / name).read_text())


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def test_text_with_tags_round_trips(tokenizer):
    text = '<think>x is\tat 4, so “block” — é</think>\n<move>4</move> ☃ {"a": 1}'
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text


def test_each_tag_and_special_token_is_one_token(tokenizer):
    for token in [*TAG_TOKENS, "<|im_start|>", "<|im_end|>", "<|endoftext|>"]:
        ids = tokenizer(token, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1, token
        assert tokenizer.convert_ids_to_tokens(ids) == [token]


def test_ascii_and_common_unicode_are_one_token_per_character(tokenizer):
    text = "".join(chr(code) for code in range(32, 127)) + "\n\t" + EXTRA_CHARACTERS
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)


def test_rare_characters_fall_back_to_bytes_losslessly(tokenizer):
    ids = tokenizer("☃", add_special_tokens=False)["input_ids"]
    assert len(ids) == 3  # its three UTF-8 bytes
    assert tokenizer.decode(ids) == "☃"


def test_special_tokens_are_dropped_when_asked_but_tags_are_kept(tokenizer):
    ids = tokenizer("<move>4</move><|im_end|>", add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "<move>4</move>"
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"


def test_chat_template_renders_chatml_for_every_role(tokenizer):
    messages = [
        {"role": "system", "content": "Play well."},
        {"role": "user", "content": "Your move."},
        {"role": "assistant", "content": "<move>4</move>"},
        {"role": "tool", "content": "42"},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nPlay well.<|im_end|>\n"
        "<|im_start|>user\nYour move.<|im_end|>\n"
        "<|im_start|>assistant\n<move>4</move><|im_end|>\n"
        "<|im_start|>tool\n42<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_chat_template_never_rewrites_history(tokenizer):
    tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
    conversation = [{"role": "user", "content": "2+3?"}]
    prompts = []
    for reply in ["<think>use the tool</think>", "<think>it said 5</think><answer>5</answer>"]:
        prompt = tokenizer.apply_chat_template(
            conversation, tools=tools, tokenize=False, add_generation_prompt=True
        )
        prompts.append(prompt)
        conversation = [
            *conversation,
            {"role": "assistant", "content": reply},
            {"role": "tool", "content": "5"},
            {"role": "user", "content": "and now?"},
        ]
    final = tokenizer.apply_chat_template(
        conversation, tools=tools, tokenize=False, add_generation_prompt=True
    )
    assert final.startswith(prompts[1]) and prompts[1].startswith(prompts[0])
    assert prompts[0] != prompts[1]


def test_chat_template_writes_tools_and_tool_calls_once(tokenizer):
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    native = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
        ],
    }
    as_text = {
        "role": "assistant",
        "content": '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>',
        "tool_calls": native["tool_calls"],
    }
    for message in (native, as_text):
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": "1?"}, message], tools=tools, tokenize=False
        )
        assert rendered.startswith("<|im_start|>system\nYou can call these tools:\n")
        assert '{"name": "add", "parameters": {"type": "object"}}' in rendered
        assert rendered.count('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>') == 1


def test_saved_directory_has_the_standard_hugging_face_layout(tiny_dir, tokenizer):
    files = set(os.listdir(tiny_dir))
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    } <= files
    config = read_json(tiny_dir, "config.json")
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["model_type"] == "qwen2"
    assert config["vocab_size"] == len(tokenizer)
    generation = read_json(tiny_dir, "generation_config.json")
    assert generation["eos_token_id"] == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert generation["pad_token_id"] == tokenizer.convert_tokens_to_ids("<|endoftext|>")
    tokenizer_config = read_json(tiny_dir, "tokenizer_config.json")
    assert tokenizer_config["chat_template"] == CHAT_TEMPLATE
    assert tokenizer_config["eos_token"] == "<|im_end|>"


def test_auto_classes_load_it_offline_unchanged(tiny_dir, tokenizer, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    loaded_tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    text = "<think>hm</think>\n<move>8</move>\t“ok” ☃"
    assert loaded_tokenizer(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert loaded_tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert loaded_tokenizer.chat_template == CHAT_TEMPLATE
    ids = torch.tensor([loaded_tokenizer("hello")["input_ids"]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, 5, len(tokenizer))
    assert torch.isfinite(logits).all()


def test_default_size_has_about_a_million_parameters(tiny_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    count = sum(p.numel() for p in model.parameters())
    assert 900_000 < count < 1_500_000


def test_same_seed_gives_same_weights_and_another_seed_differs(tmp_path):
    def weights(seed, name):
        path = build_tiny_model(tmp_path / name, seed=seed, **SMALL)
        return AutoModelForCausalLM.from_pretrained(path).state_dict()

    first, again, other = weights(0, "a"), weights(0, "b"), weights(1, "c")
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not torch.equal(first["model.embed_tokens.weight"], other["model.embed_tokens.weight"])


def test_ensure_builds_once_into_rlcore_home_and_reuses_it(tmp_path, monkeypatch):
    monkeypatch.setenv("RLCORE_HOME", str(tmp_path))
    path = ensure_tiny_model(**SMALL)
    assert path == str(tmp_path / "models" / f"tiny-{tiny_config_hash(**SMALL)}")
    weights_file = os.path.join(path, "model.safetensors")
    built_at = os.stat(weights_file).st_mtime_ns
    assert ensure_tiny_model(**SMALL) == path
    assert os.stat(weights_file).st_mtime_ns == built_at
    assert os.listdir(tmp_path / "models") == [os.path.basename(path)]  # no staging left over
    assert ensure_tiny_model(**{**SMALL, "seed": 1}) != path


def test_concurrent_callers_all_get_one_complete_model(tmp_path, monkeypatch):
    monkeypatch.setenv("RLCORE_HOME", str(tmp_path))
    results, errors = [], []

    def build():
        try:
            results.append(ensure_tiny_model(**SMALL))
        except Exception as exc:  # collected so the assertion below shows it
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert len(set(results)) == 1
    assert os.listdir(tmp_path / "models") == [os.path.basename(results[0])]
    AutoTokenizer.from_pretrained(results[0])


def test_bad_size_options_are_named():
    with pytest.raises(ValueError, match="hidden_sizes"):
        tiny_config_hash(hidden_sizes=64)
    with pytest.raises(ValueError, match="divisible by num_heads"):
        tiny_config_hash(hidden_size=30, num_heads=4)
    with pytest.raises(ValueError, match="num_layers must be positive"):
        tiny_config_hash(num_layers=0)


def test_ensure_refuses_a_non_empty_directory_that_is_not_a_model(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not a tiny model directory"):
        ensure_tiny_model(tmp_path)


@pytest.fixture(scope="module")
def game_texts(tokenizer):
    """Chat-rendered games of the random-valid player, other seeds than the merges'."""
    import asyncio

    from rlcore.envs.tictactoe import TicTacToeEnv
    from rlcore.envs.tictactoe_players import RandomValidPolicy
    from rlcore.rollout import run_rollouts
    from rlcore.types import SamplingParams

    env = TicTacToeEnv()
    games = asyncio.run(
        run_rollouts(env, RandomValidPolicy(), env.examples(40, seed=99), sampling=SamplingParams())
    )
    return [tokenizer.apply_chat_template(game.messages, tokenize=False) for game in games]


def test_merges_halve_a_game_and_keep_moves_tags_and_text_whole(tokenizer, game_texts):
    merged = build_tiny_tokenizer(merges=256)
    assert len(merged) > len(tokenizer)

    def count(t):
        return sum(len(t(text, add_special_tokens=False)["input_ids"]) for text in game_texts)

    assert count(merged) < 0.6 * count(tokenizer)
    for text in game_texts:  # lossless
        assert merged.decode(merged(text, add_special_tokens=False)["input_ids"]) == text
    for token in [*TAG_TOKENS, "<|im_start|>", "<|im_end|>", *"0123456789"]:
        assert len(merged(token, add_special_tokens=False)["input_ids"]) == 1, token
    # A move is one token after the tag, as the sound mass reads it.
    ids = merged("<move>7</move>", add_special_tokens=False)["input_ids"]
    assert merged.convert_ids_to_tokens(ids) == ["<move>", "7", "</move>"]


def test_merges_are_learned_the_same_every_time_and_name_their_own_build():
    from rlcore.policy.tiny import learned_merges

    first = learned_merges(64)
    assert first == learned_merges(64) and 0 < len(first) <= 64
    # The default build keeps its name; a build with merges gets another.
    assert tiny_config_hash() == tiny_config_hash(merges=0) != tiny_config_hash(merges=256)
    with pytest.raises(ValueError, match="merges must be a non-negative integer"):
        tiny_config_hash(merges=-1)


def test_a_model_with_merges_reloads_with_the_same_tokenizer(tmp_path, game_texts):
    from rlcore.policy.prompts import prefix_reuse_problem

    path = build_tiny_model(tmp_path / "merged", merges=256, **SMALL)
    reloaded = AutoTokenizer.from_pretrained(path)
    built = build_tiny_tokenizer(merges=256)
    assert len(reloaded) == len(built) == AutoModelForCausalLM.from_pretrained(path).vocab_size
    for text in game_texts:
        assert reloaded.encode(text, add_special_tokens=False) == built.encode(
            text, add_special_tokens=False
        )
    assert prefix_reuse_problem(reloaded) is None  # the engine's prompt cache still applies
    assert read_json(path, "rlcore_tiny.json")["merges"] == 256


@pytest.mark.parametrize(("name", "layers"), [("tiny-bpe", 4), ("tiny-bpe-3l", 3)])
def test_the_tiny_models_with_merges_are_named_everywhere_a_model_is_named(
    name, layers, tmp_path, monkeypatch
):
    """`tiny-bpe`: the tiny model with 256 merges; `tiny-bpe-3l`: the same with 3 layers
    (the CPU variant's start, recipes/tictactoe_tiny/sft_cpu.toml)."""
    from rlcore.policy import load_policy
    from rlcore.policy.tiny import (
        BUILTIN_MODELS,
        TINY_BPE_MERGES,
        TINY_SMALL_LAYERS,
        builtin_model_path,
    )
    from rlcore.train.common import load_model_and_tokenizer, model_path
    from workers.engines import model_path as server_model_path

    monkeypatch.setenv("RLCORE_HOME", str(tmp_path))
    assert name in BUILTIN_MODELS and TINY_BPE_MERGES == 256 and TINY_SMALL_LAYERS == 3
    path = builtin_model_path(name)
    assert path == model_path(name) == server_model_path(name)
    assert path.startswith(str(tmp_path)) and path != builtin_model_path("tiny")
    assert read_json(path, "rlcore_tiny.json")["merges"] == TINY_BPE_MERGES
    network, tokenizer = load_model_and_tokenizer(name, torch.device("cpu"))
    assert network.config.num_hidden_layers == layers
    plain = AutoTokenizer.from_pretrained(builtin_model_path("tiny"))
    board = "X.O\n.X.\nO..\nYou are X. Your move."
    assert len(tokenizer.encode(board)) < len(plain.encode(board))
    assert network.config.vocab_size == len(tokenizer)
    assert load_policy(name, device="cpu").name == name
    if name == "tiny-bpe-3l":  # the same tokenizer as tiny-bpe's, a smaller network
        bpe_network, bpe_tokenizer = load_model_and_tokenizer("tiny-bpe", torch.device("cpu"))
        assert tokenizer.encode(board) == bpe_tokenizer.encode(board)
        assert path != builtin_model_path("tiny-bpe")
        assert sum(p.numel() for p in network.parameters()) < sum(
            p.numel() for p in bpe_network.parameters()
        )
