"""SFT data (synth filters, the JSONL dataset) and supervised fine-tuning with the loss on
assistant tokens only, on the real tiny model."""

import asyncio
import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from rlcore.events import RecordingSink
from rlcore.policy.local import LocalEngine
from rlcore.train.config import OptimizerConfig, SFTConfig, SynthConfig
from rlcore.train.sft import build_sft_example, load_sft_dataset, run_sft
from rlcore.train.synth import drop_reason, run_synth
from rlcore.types import Rollout, SamplingParams

CONVERSATION = [
    {"role": "system", "content": "Play."},
    {"role": "user", "content": "Board 1"},
    {"role": "assistant", "content": "<think>corner</think><move>0</move>"},
    {"role": "user", "content": "Board 2"},
    {"role": "assistant", "content": "<move>4</move>"},
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


# ---------------------------------------------------------------------------------------
# The assistant-only loss mask


def test_the_mask_covers_exactly_each_assistant_reply_and_its_end_of_turn(tokenizer):
    input_ids, loss_mask = build_sft_example(tokenizer, CONVERSATION, max_seq_len=4096)
    pieces = [
        ("<|im_start|>system\nPlay.<|im_end|>\n<|im_start|>user\nBoard 1<|im_end|>\n", 0),
        ("<|im_start|>assistant\n", 0),
        ("<think>corner</think><move>0</move><|im_end|>", 1),
        ("\n<|im_start|>user\nBoard 2<|im_end|>\n<|im_start|>assistant\n", 0),
        ("<move>4</move><|im_end|>", 1),
        ("\n", 0),
    ]
    expected_ids, expected_mask = [], []
    for text, value in pieces:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        expected_ids += ids
        expected_mask += [value] * len(ids)
    assert input_ids == expected_ids
    assert loss_mask == expected_mask
    # Token by token: the learned tokens read back as the two replies, end-of-turn included.
    learned = [
        tokenizer.convert_ids_to_tokens(i) for i, m in zip(input_ids, loss_mask, strict=True) if m
    ]
    assert learned == [
        "<think>",
        "c",
        "o",
        "r",
        "n",
        "e",
        "r",
        "</think>",
        "<move>",
        "0",
        "</move>",
        "<|im_end|>",
        "<move>",
        "4",
        "</move>",
        "<|im_end|>",
    ]
    # The ids are those of the whole rendered conversation: what the model sees at inference.
    rendered = tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    assert input_ids == tokenizer(rendered, add_special_tokens=False)["input_ids"]


def test_long_conversations_are_cut_at_max_seq_len(tokenizer):
    full_ids, full_mask = build_sft_example(tokenizer, CONVERSATION, max_seq_len=4096)
    input_ids, loss_mask = build_sft_example(tokenizer, CONVERSATION, max_seq_len=40)
    assert (input_ids, loss_mask) == (full_ids[:40], full_mask[:40])


def test_a_template_that_rewrites_earlier_turns_is_refused(tokenizer):
    rewriting = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    rewriting.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n"
        "{% if m.role == 'assistant' and not loop.last %}[earlier reply]{% else %}"
        "{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with pytest.raises(ValueError, match="rewrites earlier turns when message 3 is added"):
        build_sft_example(rewriting, CONVERSATION, max_seq_len=4096)


# ---------------------------------------------------------------------------------------
# The dataset file


def test_a_missing_dataset_names_the_path_and_the_expected_format(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nowhere\.jsonl' does not exist.*JSONL"):
        load_sft_dataset(tmp_path / "nowhere.jsonl")


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("{not json", "not valid JSON"),
        ('{"text": "hi"}', "non-empty 'messages' list"),
        ('{"messages": ["hi"]}', "message 0 must be an object with 'role'"),
        ('{"messages": [{"role": "user", "content": "hi"}]}', "no assistant message"),
    ],
)
def test_a_bad_dataset_line_is_reported_with_its_line_number(tmp_path, line, problem):
    path = tmp_path / "data.jsonl"
    good = json.dumps({"messages": CONVERSATION})
    path.write_text(f"{good}\n\n{line}\n")
    with pytest.raises(ValueError, match=f"data.jsonl:3: .*{problem}"):
        load_sft_dataset(path)


# ---------------------------------------------------------------------------------------
# Training


def test_sft_lowers_the_loss_and_saves_a_loadable_checkpoint(tiny_model, tmp_path):
    dataset = tmp_path / "data.jsonl"
    with dataset.open("w") as out:
        for cell in range(8):
            messages = [
                {"role": "user", "content": f"Board {cell}"},
                {"role": "assistant", "content": f"<think>take {cell}</think><move>{cell}</move>"},
            ]
            out.write(json.dumps({"messages": messages}) + "\n")
    cfg = SFTConfig(
        model=tiny_model,
        dataset=str(dataset),
        output_dir=str(tmp_path / "sft"),
        max_steps=40,
        batch_size=8,
        micro_batch_size=4,
        save_every=20,
        optimizer=OptimizerConfig(lr=5e-3, warmup_steps=2),
    )
    sink = RecordingSink()
    final = run_sft(cfg, sink)

    losses = [values["loss/sft"] for _, values in sink.metrics]
    assert len(losses) == 40
    assert sum(losses[-3:]) / 3 < 0.3 * losses[0]
    rates = [values["optim/lr"] for _, values in sink.metrics]
    assert rates[0] == pytest.approx(2.5e-3) and rates[1] == pytest.approx(5e-3)  # warm-up
    assert rates[-1] < rates[2]  # cosine decay
    assert {"optim/grad_norm", "perf/tokens_per_s", "perf/step_seconds"} <= set(sink.metrics[0][1])
    assert sink.checkpoints == [(20, str(tmp_path / "sft" / "step_000020")), (40, final)]
    assert sink.progress_events[-1] == (40, 40, "sft")
    messages = [message for _, message in sink.logs]
    assert sum(m.startswith("sft: step ") for m in messages) == 11  # 1, 4, 8, ..., 40
    assert messages[-2].startswith("sft: done: 40 steps") and "loss/sft" in messages[-2]
    assert messages[-1] == f"sft: final checkpoint {final}"
    assert json.loads((tmp_path / "sft" / "config.json").read_text())["max_steps"] == 40
    assert (
        json.loads((tmp_path / "sft" / "final" / "train_config.json").read_text())["optimizer"][
            "lr"
        ]
        == 5e-3
    )

    engine = LocalEngine(final, device="cpu")
    prompt = [{"role": "user", "content": "Board 3"}]
    generation = asyncio.run(engine.generate(prompt, SamplingParams(temperature=0, max_tokens=24)))
    assert generation.text.startswith("<think>take ")


def test_sft_drops_conversations_with_no_assistant_token_left_after_truncation(
    tiny_model, tmp_path
):
    dataset = tmp_path / "data.jsonl"
    long_prompt = {"role": "user", "content": "x" * 200}
    reply = {"role": "assistant", "content": "<move>1</move>"}
    dataset.write_text(json.dumps({"messages": [long_prompt, reply]}) + "\n")
    cfg = SFTConfig(
        model=tiny_model,
        dataset=str(dataset),
        output_dir=str(tmp_path / "o"),
        max_seq_len=64,
        max_steps=1,
    )
    with pytest.raises(ValueError, match="no conversation of .* keeps an assistant token"):
        run_sft(cfg, RecordingSink())


# ---------------------------------------------------------------------------------------
# Synth: teacher games, filtered


def rollout(**fields) -> Rollout:
    values = dict(
        example_id=0,
        seed=0,
        group=0,
        messages=[],
        prompt_len=0,
        outcome="win",
        rewards={"format": 1.0},
        reward=1.0,
        state={"invalid_moves": 0},
    )
    return Rollout(**{**values, **fields})


def test_each_filter_drops_for_its_own_reason_in_order():
    cfg = SynthConfig(
        exclude_outcomes=["loss"], require_format=True, max_invalid_moves=1, min_reward=0.5
    )
    assert drop_reason(rollout(), cfg) is None
    assert drop_reason(rollout(error="boom", truncated=True), cfg) == "error"
    assert drop_reason(rollout(truncated=True, outcome="loss"), cfg) == "truncated"
    assert drop_reason(rollout(outcome="loss", rewards={"format": 0.0}), cfg) == "outcome:loss"
    assert drop_reason(rollout(rewards={"format": 0.5}), cfg) == "format"
    assert drop_reason(rollout(state={"invalid_moves": 2}), cfg) == "invalid_moves"
    assert drop_reason(rollout(state={"invalid_moves": 1}), cfg) is None
    assert drop_reason(rollout(reward=0.4), cfg) == "min_reward"


def test_synth_with_the_random_player_keeps_good_games_and_counts_drops(tmp_path):
    cfg = SynthConfig(
        env="tictactoe",
        env_args={"min_random_move_prob": 0.5, "num_groups": 2},
        model="random",
        num_examples=60,
        max_kept=10,
        exclude_outcomes=["loss", "unfinished"],
        require_format=True,
        max_invalid_moves=0,
        output_dir=str(tmp_path / "synth"),
        concurrency=8,
    )
    sink = RecordingSink()
    stats = run_synth(cfg, sink)

    lines = [json.loads(line) for line in (tmp_path / "synth" / "dataset.jsonl").open()]
    assert stats["kept"] == len(lines) == 10
    assert {row["outcome"] for row in lines} <= {"win", "draw"}
    first = lines[0]
    assert set(first) == {"messages", "env", "example_id", "reward", "outcome"}
    assert first["env"] == "tictactoe"
    assert [m["role"] for m in first["messages"][:3]] == ["system", "user", "assistant"]
    assert all(set(m) == {"role", "content"} for m in first["messages"])
    # Random play loses often; nothing else can go wrong for a well-formed random player.
    assert stats["dropped"]["outcome:loss"] > 0
    assert set(stats["dropped"]) <= {"outcome:loss", "max_kept"}
    assert stats["kept"] + sum(stats["dropped"].values()) == stats["played"]
    assert stats["played"] < 60  # it stopped once 10 were kept
    assert json.loads((tmp_path / "synth" / "dataset.stats.json").read_text())["kept"] == 10
    assert any(
        "dropped by reason: " in message and "outcome:loss=" in message for _, message in sink.logs
    )
    # The dataset feeds SFT as is.
    assert len(load_sft_dataset(stats["path"])) == 10


def test_synth_gives_each_rollout_of_an_example_its_own_game(tmp_path):
    cfg = SynthConfig(
        env="tictactoe",
        model="random",
        num_examples=4,
        rollouts_per_example=3,
        output_dir=str(tmp_path / "synth"),
    )
    stats = run_synth(cfg, RecordingSink())
    rows = [json.loads(line) for line in Path(stats["path"]).read_text().splitlines()]
    assert [row["example_id"] for row in rows] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    games = {json.dumps(row["messages"]) for row in rows}
    assert len(games) > 4  # the same example replays differently
    again = run_synth(cfg, RecordingSink())  # and the whole dataset is reproducible
    assert [json.loads(line) for line in Path(again["path"]).read_text().splitlines()] == rows


def test_synth_progress_moves_rollout_by_rollout_not_chunk_by_chunk(tmp_path):
    cfg = SynthConfig(
        env="tictactoe",
        model="random",
        num_examples=12,
        rollouts_per_example=2,
        concurrency=8,
        output_dir=str(tmp_path / "synth"),
    )
    sink = RecordingSink()
    run_synth(cfg, sink)
    # 4 examples x 2 rollouts a chunk; the bar counts each of the 24 as it is taken.
    assert [done for done, _, _ in sink.progress_events] == list(range(1, 25))
    assert {total for _, total, _ in sink.progress_events} == {24}


def test_synth_drops_a_constant_player_for_running_out_of_turns(tmp_path):
    cfg = SynthConfig(
        env="tictactoe",
        env_args={"max_turns": 3},
        model="constant",
        num_examples=5,
        output_dir=str(tmp_path / "synth"),
    )
    stats = run_synth(cfg, RecordingSink())
    # Its second "<move>4</move>" hits a taken cell, again and again, until max_turns.
    assert stats == stats | {"kept": 0, "played": 5, "dropped": {"truncated": 5}}


def test_filters_the_environment_cannot_apply_are_refused(tmp_path):
    cfg = SynthConfig(
        env="reverse_text", model="oracle", max_invalid_moves=0, output_dir=str(tmp_path)
    )
    with pytest.raises(ValueError, match="max_invalid_moves=0 needs an env that counts invalid"):
        run_synth(cfg, RecordingSink())
