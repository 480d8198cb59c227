"""Sound mass (rlcore/train/sound_mass.py): at every judged move, every legal move of the
position judged by the env, and -log of the policy's probability of the best ones added
to the loss. The env's side on real tic-tac-toe games, the trainer's on the tiny model."""

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlcore.envs.registry import load_environment
from rlcore.envs.tictactoe_game import empty_cells, oracle_best_moves, sound_moves
from rlcore.events import RecordingSink
from rlcore.policy.base import Policy
from rlcore.rollout import run_rollouts
from rlcore.train.config import RLConfig, build_config
from rlcore.train.grpo import run_rl, token_logprobs
from rlcore.train.sequences import collate, move_set_rows, training_sequences
from rlcore.train.sound_mass import attach_move_sets
from rlcore.types import Generation, SamplingParams


class FirstCellPlayer(Policy):
    """Plays the first empty cell, sound or not, in a well-formed reply, with the token
    ids the tiny model's tokenizer gives."""

    name = "first-cell"

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    async def generate(self, messages, sampling, *, tools=None, state=None) -> Generation:
        cell = empty_cells(state["board"])[0]
        text = f"<think>first</think><move>{cell}</move>"
        prompt = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        completion = self.tokenizer.encode(text, add_special_tokens=False)
        completion.append(self.tokenizer.convert_tokens_to_ids("<|im_end|>"))
        return Generation(
            text=text,
            prompt_ids=self.tokenizer.encode(prompt, add_special_tokens=False),
            completion_ids=completion,
        )


@pytest.fixture(scope="module")
def played(tiny_model):
    env = load_environment("tictactoe", max_turns=4, num_groups=2)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    rollouts = asyncio.run(
        run_rollouts(
            env, FirstCellPlayer(tokenizer), env.examples(12, seed=5), sampling=SamplingParams()
        )
    )
    sequences = []
    for rollout in rollouts:
        built = training_sequences(rollout, [0.0] * len(rollout.turns), "turn")
        attach_move_sets(env, rollout, built, tokenizer, {}, {})
        sequences += built
    return env, tokenizer, rollouts, sequences


def test_the_env_offers_every_legal_move_it_judged_with_the_positions_other_moves(played):
    env, tokenizer, rollouts, _ = played
    sound_seen = unsound_seen = 0
    for rollout in rollouts:
        for index, turn in enumerate(rollout.turns):
            reply = tokenizer.decode(turn.completion_ids).replace("<|im_end|>", "")
            options = env.move_options(rollout, index, reply)
            verdict = rollout.state["move_sound"][index]
            board = turn.state_key.split("/")[0]
            assert options is not None and int(options.played) == empty_cells(board)[0]
            assert options.judge(options.played) == (1.0 if verdict else 0.0)
            assert sorted(int(o) for o in [options.played, *options.others]) == empty_cells(board)
            for option in options.others:
                expected = (
                    1.0 if int(option) in sound_moves(board, rollout.state["model_mark"]) else 0.0
                )
                assert options.judge(option) == expected
            sound_seen += verdict
            unsound_seen += not verdict
    assert sound_seen >= 5 and unsound_seen >= 5


def test_each_judged_move_is_recorded_at_its_token_with_the_positions_sound_moves(played):
    env, tokenizer, rollouts, sequences = played
    recorded = [(s, at, ids) for s in sequences for at, ids in s.move_sets]
    assert len(recorded) == sum(len(r.turns) for r in rollouts)
    positions = {}  # the ids up to each move -> its position's sound cells
    for rollout in rollouts:
        for turn in rollout.turns:
            move_tag = tokenizer.convert_tokens_to_ids("<move>")
            at = turn.completion_ids.index(move_tag) + 1
            board = turn.state_key.split("/")[0]
            cells = sound_moves(board, rollout.state["model_mark"])
            positions[tuple(turn.prompt_ids + turn.completion_ids[:at])] = cells
    for sequence, at, ids in recorded:
        # Target `at` predicts the move: the token after it is a digit, right after <move>.
        assert tokenizer.decode(sequence.input_ids[at]) == "<move>"
        assert tokenizer.decode(sequence.input_ids[at + 1]).isdigit()
        cells = positions[tuple(sequence.input_ids[: at + 1])]
        assert sorted(int(tokenizer.decode(i)) for i in ids) == sorted(cells)


def test_win_chances_grade_the_sound_moves_and_add_the_oracles_set(played):
    _, tokenizer, rollouts, _ = played
    env = load_environment("tictactoe", max_turns=4, num_groups=2, win_chances=True)
    graded = 0
    for rollout in rollouts:
        built = training_sequences(rollout, [0.0] * len(rollout.turns), "turn")
        assert attach_move_sets(env, rollout, built, tokenizer, {}, {}) == len(rollout.turns)
        recorded = iter([ids for s in built for _, ids in s.move_sets])
        for index, turn in enumerate(rollout.turns):
            reply = tokenizer.decode(turn.completion_ids).replace("<|im_end|>", "")
            options = env.move_options(rollout, index, reply)
            board, mark = turn.state_key.split("/")[0], rollout.state["model_mark"]
            sound, best = set(sound_moves(board, mark)), set(oracle_best_moves(board, mark))
            assert best <= sound
            for option in [options.played, *options.others]:
                cell = int(option)
                expected = 1.0 if cell in best else 0.5 if cell in sound else 0.0
                assert options.judge(option) == expected, (board, cell)
            cells = [sorted(int(tokenizer.decode(i)) for i in next(recorded))]
            mixed = sound != best and sound != set(empty_cells(board))
            if mixed:  # three grades: the oracle's moves, then every sound one
                cells.append(sorted(int(tokenizer.decode(i)) for i in next(recorded)))
                graded += 1
            assert cells == ([sorted(best), sorted(sound)] if mixed else [sorted(best)])
        assert next(recorded, None) is None
    assert graded >= 3


def test_the_loss_reads_the_log_probability_of_the_sound_moves(played, tiny_model):
    _, tokenizer, _, sequences = played
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    chunk = sequences[:5]
    input_ids, *_ = collate(chunk, tokenizer.pad_token_id, "cpu")
    sets = move_set_rows(chunk, "cpu")
    with torch.no_grad():
        _, _, best = token_logprobs(model, input_ids, 0.7, move_sets=sets)
    expected = []
    for sequence in chunk:
        for at, ids in sequence.move_sets:
            with torch.no_grad():
                logits = model(torch.tensor([sequence.input_ids[: at + 1]])).logits[0, -1]
            expected.append(torch.softmax(logits / 0.7, -1)[ids].sum().log())
    assert len(expected) == len(best) > 5
    assert torch.allclose(best, torch.stack(expected), atol=1e-4)


def test_training_on_the_term_alone_raises_the_sound_mass(played, tiny_model):
    _, tokenizer, _, sequences = played
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    input_ids, *_ = collate(sequences, tokenizer.pad_token_id, "cpu")
    sets = move_set_rows(sequences, "cpu")

    def mass():
        return token_logprobs(model, input_ids, 1.0, move_sets=sets)[2]

    with torch.no_grad():
        before = mass().exp().mean()
    for _ in range(10):
        loss = -mass().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        after = mass().exp().mean()
    assert after > 5 * before, (before, after)


def test_rl_with_sound_mass_reports_it_and_refuses_envs_without_verdicts(tmp_path):
    """On the shipped player (legal replies), one step: every legal move judged and its
    sound mass reported."""
    values = dict(
        model="tiny-master", output_dir=str(tmp_path / "rl"), batch_size=8,
        rollouts_per_example=4, micro_batch_size=8, max_tokens=64, max_steps=1,
        sound_mass_weight=1.0, temperature=1.0,
    )  # fmt: skip
    tictactoe = {"env": "tictactoe", "env_args": {"max_turns": 2, "num_groups": 2}}
    sink = RecordingSink()
    run_rl(build_config(RLConfig, [("test", {**values, **tictactoe})]), sink)
    ((_, metrics),) = sink.metrics
    legal = metrics["tictactoe/invalid_move_rate"] < 1
    assert legal and metrics["sound_mass/moves"] >= 4
    assert 0 < metrics["sound_mass/mean"] < 1
    # -log P(sound) > 0 joins the policy loss in the reported total.
    assert metrics["loss/total"] > metrics["loss/policy"]
    refused = build_config(RLConfig, [("test", {**values, "env": "reverse_text"})])
    with pytest.raises(ValueError, match="sound_mass_weight=1.0 needs an env that judges"):
        run_rl(refused, RecordingSink())
