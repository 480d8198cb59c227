"""The built-in tiny model: a small Qwen2-style causal LM with a character-level tokenizer,
built from a config (no download) and saved in plain Hugging Face format.

Everything a user can do with a real checkpoint works on it offline and on a CPU:
`AutoModelForCausalLM` / `AutoTokenizer` (and vLLM) load the directory with no custom code,
its ChatML chat template renders system/user/assistant/tool turns, and the tags every
environment uses (`<think>`, `<move>`, `<tool_call>`...) are single tokens so a model that
reads one character at a time still sees them as units. `ensure_tiny_model()` builds it once
per config under `$RLCORE_HOME/models/` (default `~/.cache/rlcore`) and returns the path.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

# Bump when the tokenizer, template or architecture changes, so cached builds of the old
# layout are never mistaken for the new one (the version is part of the directory hash).
TINY_FORMAT_VERSION = 1

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
END_OF_TEXT = "<|endoftext|>"
SPECIAL_TOKENS = [IM_START, IM_END, END_OF_TEXT]
TAG_TOKENS = [
    "<think>",
    "</think>",
    "<move>",
    "</move>",
    "<answer>",
    "</answer>",
    "<reversed>",
    "</reversed>",
    "<tool_call>",
    "</tool_call>",
]
# Qwen2's pre-tokenizer split; kept identical so the saved tokenizer reloads unchanged.
QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Characters beyond ASCII that show up in prompts and model answers often enough to deserve
# their own ids (typographic quotes and dashes, math signs, accents, the board's middle dot).
EXTRA_CHARACTERS = "’‘“”–—…·×÷−≤≥°éèàüöä€£"

DEFAULT_SIZE = {
    "hidden_size": 128,
    "num_layers": 4,
    "num_heads": 4,
    "intermediate_size": 512,
    "max_position_embeddings": 2048,
    "seed": 0,
    # Byte-pair merges learned on tic-tac-toe games (`learned_merges`); 0: characters.
    "merges": 0,
}
# Options that may be 0; and those left out of a build's hash at their default, so the
# default model keeps the name it had before they existed.
ZERO_ALLOWED = ("seed", "merges")
HASHED_ONLY_IF_SET = ("merges",)
# The games the merges are learned on: the random-valid teacher's, as the mastery
# benchmark's SFT data are, from a fixed seed.
MERGE_CORPUS_GAMES = 1000
MERGE_CORPUS_SEED = 11

# ChatML. Every message renders the same way wherever it sits in the conversation, so the
# prompt of turn k is a prefix of the prompt of turn k+1 (multi-turn training relies on it).
# Tools, when given, become a leading system block in the Hermes/Qwen text convention.
# Assistant tool calls are written out only if the content does not already carry them as
# text, so a message parsed from `<tool_call>` text renders back to the same text.
CHAT_TEMPLATE = (
    "{%- macro render_content(content) -%}"
    "{%- if content is string -%}{{ content }}"
    "{%- elif content -%}{%- for part in content -%}"
    "{%- if part.type == 'text' -%}{{ part.text }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- if tools -%}"
    "{{ '<|im_start|>system\\nYou can call these tools:\\n' }}"
    "{%- for tool in tools -%}"
    "{{ (tool.function if tool.function is defined else tool) | tojson }}{{ '\\n' }}"
    "{%- endfor -%}"
    '{{ \'To call one, write <tool_call>{"name": NAME, "arguments": {...}}</tool_call>'
    "<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message.role + '\\n' }}"
    "{%- set text = render_content(message.content) -%}"
    "{{ text }}"
    "{%- if message.role == 'assistant' and message.tool_calls and '<tool_call>' not in text -%}"
    "{%- for call in message.tool_calls -%}"
    "{%- set function = call.function if call.function is defined else call -%}"
    "{{ '<tool_call>{\"name\": ' + (function.name | tojson) + ', \"arguments\": ' }}"
    "{%- if function.arguments is string -%}{{ function.arguments }}"
    "{%- else -%}{{ function.arguments | tojson }}{%- endif -%}"
    "{{ '}</tool_call>' }}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


def rlcore_home() -> Path:
    """Where rlcore keeps built models and caches: $RLCORE_HOME, else ~/.cache/rlcore."""
    return Path(os.environ.get("RLCORE_HOME") or Path.home() / ".cache" / "rlcore")


def byte_alphabet() -> list[str]:
    """The 256 printable stand-ins byte-level BPE uses for bytes 0..255 (GPT-2's table)."""
    printable_bytes = [
        *range(ord("!"), ord("~") + 1),
        *range(0xA1, 0xAC + 1),
        *range(0xAE, 0xFF + 1),
    ]
    stand_ins = {byte: chr(byte) for byte in printable_bytes}
    shifted = 0
    for byte in range(256):
        if byte not in stand_ins:
            stand_ins[byte] = chr(256 + shifted)
            shifted += 1
    return [stand_ins[byte] for byte in range(256)]


def _byte_level(text: str) -> str:
    alphabet = byte_alphabet()
    return "".join(alphabet[byte] for byte in text.encode("utf-8"))


def learned_merges(count: int) -> list[tuple[str, str]]:
    """Up to `count` byte-level BPE merges learned (Hugging Face `tokenizers`, pairs seen at
    least twice) on `MERGE_CORPUS_GAMES` tic-tac-toe games of the random-valid teacher,
    rendered with the chat template, the added tokens cut out. The split is the tiny
    tokenizer's (Qwen2's regex), so merges stay inside its pieces: every digit stays a token
    of its own (a move is one token), and the prompts' words and board rows merge. The same
    list every time (the games are seeded; the trainer is deterministic)."""
    import asyncio
    import re

    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers

    from rlcore.envs.tictactoe import TicTacToeEnv
    from rlcore.envs.tictactoe_players import RandomValidPolicy
    from rlcore.rollout import run_rollouts
    from rlcore.types import SamplingParams

    env = TicTacToeEnv()
    games = asyncio.run(
        run_rollouts(
            env,
            RandomValidPolicy(),
            env.examples(MERGE_CORPUS_GAMES, seed=MERGE_CORPUS_SEED),
            sampling=SamplingParams(),
        )
    )
    characters = build_tiny_tokenizer()
    added = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS + TAG_TOKENS))
    corpus = [
        piece
        for game in games
        for piece in added.split(characters.apply_chat_template(game.messages, tokenize=False))
        if piece
    ]
    learner = Tokenizer(models.BPE())
    learner.normalizer = normalizers.NFC()
    learner.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    alphabet = byte_alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=len(alphabet) + count,
        min_frequency=2,
        initial_alphabet=alphabet,
        show_progress=False,
    )
    learner.train_from_iterator(corpus, trainer)
    merges = json.loads(learner.to_str())["model"]["merges"]
    return [tuple(pair.split(" ")) if isinstance(pair, str) else tuple(pair) for pair in merges]


def build_tiny_tokenizer(merges: int = 0):
    """The character-level tokenizer (with `merges`, up to that many `learned_merges` on
    top), as a `PreTrainedTokenizerFast` with the chat template.

    It is a byte-level BPE laid out exactly like Qwen2's (NFC, Qwen's split regex, byte-level
    pre-tokenizer and decoder): transformers 5 loads any `qwen2` checkpoint's tokenizer through
    `Qwen2Tokenizer`, which rebuilds that pipeline from the vocab and merges, so any other
    layout would silently change on reload. With one token per byte and no merges between
    characters, ASCII text is one token per character; the few common non-ASCII characters get
    merges so they are one token too, and any other character falls back to its UTF-8 bytes
    (lossless, so no <unk> is ever needed).
    """
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )
    from transformers import PreTrainedTokenizerFast

    vocab = {token: token_id for token_id, token in enumerate(byte_alphabet())}
    pairs: list[tuple[str, str]] = []
    for character in EXTRA_CHARACTERS:
        pieces = list(_byte_level(character))
        while len(pieces) > 1:
            pairs.append((pieces[0], pieces[1]))
            pieces = [pieces[0] + pieces[1], *pieces[2:]]
    if merges:
        pairs += learned_merges(merges)
    kept = []
    for pair in pairs:  # in rank order; each merged token gets the next id
        if pair not in kept:
            kept.append(pair)
            vocab.setdefault(pair[0] + pair[1], len(vocab))
    backend = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=kept,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    backend.add_special_tokens(
        [AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS]
    )
    # Tags are ordinary (non-special) added tokens: decoding with skip_special_tokens keeps them.
    backend.add_tokens([AddedToken(token, special=False, normalized=False) for token in TAG_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=IM_END,
        pad_token=END_OF_TEXT,
        unk_token=None,
        bos_token=None,
        additional_special_tokens=[IM_START],
        chat_template=CHAT_TEMPLATE,
        model_max_length=DEFAULT_SIZE["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
    )


def _size_config(size: dict) -> dict:
    unknown = sorted(set(size) - set(DEFAULT_SIZE))
    if unknown:
        raise ValueError(
            f"unknown tiny model size option(s) {unknown}; accepted: {', '.join(DEFAULT_SIZE)}"
        )
    config = {**DEFAULT_SIZE, **size}
    for name, value in config.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(
                f"tiny model option {name} must be a non-negative integer, got {value!r}"
            )
        if name not in ZERO_ALLOWED and value == 0:
            raise ValueError(f"tiny model option {name} must be positive, got 0")
    if config["hidden_size"] % config["num_heads"]:
        raise ValueError(
            f"hidden_size ({config['hidden_size']}) must be divisible by "
            f"num_heads ({config['num_heads']})"
        )
    return config


def build_tiny_model(
    path: str | os.PathLike,
    *,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    intermediate_size: int = 512,
    max_position_embeddings: int = 2048,
    seed: int = 0,
    merges: int = 0,
) -> str:
    """Build the tiny model with weights drawn from `seed` (and a tokenizer with up to
    `merges` learned merges) and save model, tokenizer and generation config to `path`
    (created if missing). Returns the path as a string."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    size = _size_config(
        {
            "hidden_size": hidden_size,
            "num_layers": num_layers,
            "num_heads": num_heads,
            "intermediate_size": intermediate_size,
            "max_position_embeddings": max_position_embeddings,
            "seed": seed,
            "merges": merges,
        }
    )
    tokenizer = build_tiny_tokenizer(size["merges"])
    tokenizer.model_max_length = size["max_position_embeddings"]
    eos_id = tokenizer.convert_tokens_to_ids(IM_END)
    pad_id = tokenizer.convert_tokens_to_ids(END_OF_TEXT)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=size["hidden_size"],
        intermediate_size=size["intermediate_size"],
        num_hidden_layers=size["num_layers"],
        num_attention_heads=size["num_heads"],
        num_key_value_heads=size["num_heads"],
        max_position_embeddings=size["max_position_embeddings"],
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        dtype="float32",
    )
    # fork_rng: the fixed seed makes the weights reproducible without touching the caller's
    # global random state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(size["seed"])
        model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=None
    )
    target = Path(path)
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    _make_tokenizer_config_portable(target)
    (target / "rlcore_tiny.json").write_text(
        json.dumps({"format_version": TINY_FORMAT_VERSION, **size}, indent=2) + "\n"
    )
    return str(target)


def _make_tokenizer_config_portable(directory: Path) -> None:
    """Write tokenizer_config.json the way Qwen2 checkpoints on the Hub do, which both
    transformers 4 and 5 (and so vLLM) read: the Qwen2 tokenizer class, the chat template
    inline, and the extra special tokens under their long-standing key."""
    config_path = directory / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["tokenizer_class"] = "Qwen2Tokenizer"
    tokenizer_config["chat_template"] = CHAT_TEMPLATE
    extra_special = tokenizer_config.pop("extra_special_tokens", None)
    if extra_special:
        tokenizer_config["additional_special_tokens"] = extra_special
    config_path.write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n")
    # A separate chat_template.jinja would take precedence in newer versions; one source only.
    (directory / "chat_template.jinja").unlink(missing_ok=True)


def tiny_config_hash(**size: int) -> str:
    """Short hash naming one tiny model build (size options, seed and format version)."""
    config = {"format_version": TINY_FORMAT_VERSION, **_size_config(size)}
    for name in HASHED_ONLY_IF_SET:
        if config[name] == DEFAULT_SIZE[name]:
            del config[name]
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:10]


def _is_built(directory: Path) -> bool:
    return (directory / "config.json").is_file() and (directory / "tokenizer.json").is_file()


# The tic-tac-toe player the lab ships: the tiny model with merges (`tiny-bpe`) after SFT on 200
# random-valid games and RL against minimax (recipes/tictactoe_tiny/rl_gpu.toml); its README.md
# is the model card.
TINY_MASTER_DIR = Path(__file__).resolve().parent.parent / "data" / "tiny-master"
# `tiny-bpe`: the tiny model with this many learned merges in its tokenizer (about half the
# tokens of a tic-tac-toe game), where the mastery recipes start (docs/mastery.md: it beat
# the character tokenizer on the CPU profile and in round 63 on a card).
TINY_BPE_MERGES = 256
# `tiny-bpe-3l`: `tiny-bpe` with this many layers instead of 4 (0.84 M parameters against
# 1.10 M), where the CPU variant of the tic-tac-toe story starts (recipes/tictactoe_tiny/
# sft_cpu.toml): a step ~1.4x cheaper bought the 2-core CPU's 30 minutes 1.4-1.45x the RL
# steps, and it won each same-day pair against 4 layers (docs/mastery.md, forty-ninth and
# fiftieth sessions).
TINY_SMALL_LAYERS = 3
# Model names that stand for a directory of the lab's own, wherever a model is named.
BUILTIN_MODELS = ("tiny", "tiny-bpe", "tiny-bpe-3l", "tiny-master")


def builtin_model_path(model: str) -> str:
    """The directory a model name stands for: `tiny` -> the built-in tiny model's and
    `tiny-bpe` -> the same model's with `TINY_BPE_MERGES` merges, `tiny-bpe-3l` -> that
    one's with `TINY_SMALL_LAYERS` layers (each built on first use), `tiny-master` -> the
    shipped tic-tac-toe player's; any other name unchanged (a checkpoint directory or a hub
    id)."""
    if model == "tiny":
        return ensure_tiny_model()
    if model == "tiny-bpe":
        return ensure_tiny_model(merges=TINY_BPE_MERGES)
    if model == "tiny-bpe-3l":
        return ensure_tiny_model(merges=TINY_BPE_MERGES, num_layers=TINY_SMALL_LAYERS)
    if model == "tiny-master":
        return str(TINY_MASTER_DIR)
    return model


def ensure_tiny_model(path: str | os.PathLike | None = None, **size: int) -> str:
    """The directory of the tiny model built with `size` options, building it on first use.

    Default location: `$RLCORE_HOME/models/tiny-<config hash>`. The build goes to a temporary
    sibling directory that is renamed into place, so concurrent callers (several workers on
    one machine) never load half a model; a caller that loses the race uses the winner's.
    """
    target = (
        Path(path)
        if path is not None
        else (rlcore_home() / "models" / f"tiny-{tiny_config_hash(**size)}")
    )
    if _is_built(target):
        return str(target)
    if target.exists() and any(target.iterdir()):
        raise ValueError(
            f"{target} exists and is not a tiny model directory (no config.json/tokenizer.json); "
            "pass an empty or new path"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-building-", dir=target.parent))
    try:
        build_tiny_model(staging, **size)
        # An empty directory the caller made for us gives way; a concurrent winner's full
        # one does not (rmdir refuses), and the rename below then finds it built.
        with contextlib.suppress(OSError):
            target.rmdir()
        try:
            os.rename(staging, target)
        except OSError:
            if not _is_built(target):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return str(target)
