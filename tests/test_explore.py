"""Exploration moves (RL's `explore_rate`): the env's random legal replies in place of the
model's, what is played, scored and trained, reproducible from the seed."""

import asyncio
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlcore.envs.registry import load_environment
from rlcore.envs.tictactoe import is_well_formatted
from rlcore.envs.tictactoe_game import empty_cells, parse_move, think_text
from rlcore.events import RecordingSink
from rlcore.policy.local import LocalEngine
from rlcore.rollout import run_rollouts
from rlcore.train.config import ConfigError, RLConfig, build_config
from rlcore.train.explore import ExplorationMoves, explored_rate
from rlcore.train.grpo import run_rl, sampling_stats, token_logprobs
from rlcore.train.sequences import collate, training_sequences
from rlcore.types import SamplingParams

TICTACTOE = {"max_turns": 2, "num_groups": 2, "opening_moves": 2}


def rl_config(model: str, tmp_path, **changes) -> RLConfig:
    values = dict(
        model=model,
        env="tictactoe",
        env_args=dict(TICTACTOE),
        output_dir=str(tmp_path / "rl"),
        batch_size=16,
        rollouts_per_example=4,
        micro_batch_size=16,
        max_tokens=8,
        max_steps=1,
        lr=3e-4,
    )
    return build_config(RLConfig, [("test", {**values, **changes})])


def one_step(model: str, tmp_path, **changes):
    """One RL step on tic-tac-toe: (its metrics, its rollouts)."""
    sink = RecordingSink()
    run_rl(rl_config(model, tmp_path, **changes), sink)
    ((_, metrics),) = sink.metrics
    return metrics, sink.rollout_batches[0][1]


def play(model: str, explore: ExplorationMoves | None, examples=4, rollouts=4):
    """Rollouts of the untrained tiny model, its replies two tokens long, torch seeded."""
    torch.manual_seed(0)
    env = load_environment("tictactoe", **TICTACTOE)
    return asyncio.run(
        run_rollouts(
            env,
            LocalEngine(model, device="cpu"),
            env.examples(examples, seed=1),
            sampling=SamplingParams(max_tokens=2),
            rollouts_per_example=rollouts,
            player_for=explore,
        )
    )


# ---------------------------------------------------------------------------------------
# The env's side


def test_the_env_replaces_a_reply_with_a_random_legal_move_in_its_format():
    env = load_environment("tictactoe", opening_moves=4, reasoning="threats")
    rng = random.Random(0)
    for example in env.examples(20, seed=3):
        state = env.setup_state(example)
        board = list(state["board"])
        cells = empty_cells(board)
        own = "<think>I like corners.</think> <move>0</move>"
        chosen = set()
        for _ in range(60):
            reply = env.exploration_reply(own, state, rng)
            cell, error = parse_move(reply, board)
            assert error is None and cell in cells and is_well_formatted(reply)
            # The model's think block is kept as it wrote it; only the move is the env's.
            assert reply == f"<think>I like corners.</think><move>{cell}</move>"
            chosen.add(cell)
        assert chosen == set(cells)  # uniform over the legal moves: each one comes up
        assert state["board"] == board  # nothing is played until the env applies it
        # A reply without a think block gets the built-in players' reading of the board.
        malformed = env.exploration_reply("move 4 please", state, rng)
        expected = think_text(board, state["model_mark"], "threats")
        assert malformed.startswith(f"<think>{expected}</think><move>")
        assert parse_move(malformed, board)[1] is None


def test_an_env_that_cannot_replace_moves_refuses_exploration(tiny_model, tmp_path):
    cfg = rl_config(tiny_model, tmp_path, env="reverse_text", env_args={}, explore_rate=0.5)
    with pytest.raises(ValueError, match="'reverse_text' cannot"):
        run_rl(cfg, RecordingSink())


@pytest.mark.parametrize("value", [-0.1, 1.5, "x"])
def test_explore_rate_must_be_a_probability(tiny_model, tmp_path, value):
    with pytest.raises(ConfigError, match="explore_rate") as raised:
        rl_config(tiny_model, tmp_path, explore_rate=value)
    assert set(raised.value.errors) == {"explore_rate"}


# ---------------------------------------------------------------------------------------
# Rollouts and training


def test_with_explore_rate_1_every_reply_is_replaced_and_trained_as_written(tiny_model, tmp_path):
    metrics, rollouts = one_step(tiny_model, tmp_path, explore_rate=1.0, turn_reward_weight=1.0)
    assert metrics["rollout/explored_rate"] == 1.0
    # The untrained model never plays a valid move; every reply the env saw was legal.
    assert metrics["tictactoe/invalid_move_rate"] == 0.0
    assert metrics["reward/format"] == 1.0
    # Random moves are sound or not: the per-move reward now has something to compare.
    assert 0.0 < metrics["reward/turn_mean"] < 1.0 and metrics["optim/grad_norm"] > 0
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    for rollout in rollouts:
        replies = [m["content"] for m in rollout.completion if m["role"] == "assistant"]
        assert all(turn.explored and turn.logprobs is None for turn in rollout.turns)
        encoded = [
            tokenizer(reply, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            for reply in replies
        ]
        assert [turn.completion_ids for turn in rollout.turns] == encoded
        # What is trained is exactly those ids, reply after reply.
        trained = [
            token
            for sequence in training_sequences(rollout, [1.0] * len(rollout.turns), "token")
            for token, weight in zip(sequence.input_ids, sequence.weights, strict=True)
            if weight > 0
        ]
        assert trained == [token for ids in encoded for token in ids]


def test_explore_rate_0_changes_nothing(tiny_model, tmp_path):
    off, off_rollouts = one_step(tiny_model, tmp_path / "default")
    zero, zero_rollouts = one_step(tiny_model, tmp_path / "zero", explore_rate=0.0)
    assert "rollout/explored_rate" not in zero
    for name in ("reward/mean", "loss/policy", "policy/entropy", "length/completion_tokens"):
        assert zero[name] == off[name], name
    assert [r.messages for r in zero_rollouts] == [r.messages for r in off_rollouts]
    assert [t.completion_ids for r in zero_rollouts for t in r.turns] == [
        t.completion_ids for r in off_rollouts for t in r.turns
    ]


def test_the_same_seed_replaces_the_same_turns_and_another_seed_others(tiny_model):
    env = load_environment("tictactoe", **TICTACTOE)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)

    def explored(seed: int, step: int = 1):
        rollouts = play(tiny_model, ExplorationMoves(env, tokenizer, 0.5, seed, step))
        return [[t.explored for t in r.turns] for r in rollouts], [r.messages for r in rollouts]

    pattern, messages = explored(0)
    assert any(any(turns) for turns in pattern) and not all(all(turns) for turns in pattern)
    assert explored(0) == (pattern, messages)
    assert explored(1)[0] != pattern
    assert explored(0, step=2)[0] != pattern


def test_replaced_replies_stay_out_of_the_logprob_mismatch(tiny_model):
    env = load_environment("tictactoe", **TICTACTOE)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    rollouts = play(tiny_model, ExplorationMoves(env, tokenizer, 0.5, 0, 1), examples=6)
    assert 0 < explored_rate(rollouts) < 1
    sequences = [
        sequence
        for rollout in rollouts
        for sequence in training_sequences(rollout, [1.0] * len(rollout.turns), "token")
    ]
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    input_ids, attention, weights, _ = collate(sequences, tokenizer.pad_token_id, "cpu")
    with torch.no_grad():
        old, entropy = token_logprobs(model, input_ids, attention, 1.0, True)
    stats = sampling_stats(sequences, old, entropy, weights)
    sampled_tokens = sum(
        len(turn.completion_ids) for r in rollouts for turn in r.turns if not turn.explored
    )
    # Only the sampled replies are compared, and those match the engine's logprobs.
    assert stats["mismatch_tokens"] == sampled_tokens < stats["entropy_tokens"]
    assert stats["mismatch"] / stats["mismatch_tokens"] < 1e-3
