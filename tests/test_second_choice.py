"""Second choices (rlcore/train/second_choice.py): at a move the env judged unsound, the
policy's own choice among the other legal moves, judged by the env and trained up when
sound. The env's side on real tic-tac-toe games, the trainer's side on the tiny model."""

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlcore.envs.registry import load_environment
from rlcore.envs.tictactoe_game import empty_cells, sound_moves
from rlcore.events import RecordingSink
from rlcore.policy.base import Policy
from rlcore.rollout import run_rollouts
from rlcore.train.config import RLConfig, build_config
from rlcore.train.grpo import run_rl
from rlcore.train.second_choice import _last_logits, second_choice_sequences
from rlcore.types import Generation, SamplingParams


class UnsoundPlayer(Policy):
    """Plays the first empty cell the solver calls unsound (a sound one when there is
    none), in a well-formed reply, with the token ids the tiny model's tokenizer gives."""

    name = "unsound"

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    async def generate(self, messages, sampling, *, tools=None, state=None) -> Generation:
        board, mark = state["board"], state["model_mark"]
        sound = sound_moves(board, mark)
        cells = [c for c in empty_cells(board) if c not in sound] or sound
        text = f"<think>my move</think><move>{cells[0]}</move>"
        prompt = self.tokenizer.encode(
            self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            ),
            add_special_tokens=False,
        )
        completion = self.tokenizer.encode(text, add_special_tokens=False)
        completion.append(self.tokenizer.convert_tokens_to_ids("<|im_end|>"))
        return Generation(text=text, prompt_ids=list(prompt), completion_ids=completion)


@pytest.fixture(scope="module")
def played(tiny_model):
    env = load_environment("tictactoe", max_turns=4, num_groups=2)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    rollouts = asyncio.run(
        run_rollouts(
            env, UnsoundPlayer(tokenizer), env.examples(12, seed=3), sampling=SamplingParams()
        )
    )
    return env, tokenizer, rollouts


def reply_text(tokenizer, turn) -> str:
    return tokenizer.decode(turn.completion_ids, skip_special_tokens=False).replace(
        "<|im_end|>", ""
    )


def test_the_env_offers_the_other_moves_of_an_unsound_one_and_judges_them(played):
    env, tokenizer, rollouts = played
    offered = 0
    for rollout in rollouts:
        for index, turn in enumerate(rollout.turns):
            options = env.decision_options(rollout, index, reply_text(tokenizer, turn))
            if rollout.state["move_sound"][index] is not False:
                assert options is None  # sound moves (and invalid replies) get none
                continue
            offered += 1
            board = turn.state_key.split("/")[0]
            mark = rollout.state["model_mark"]
            assert options.prefix == "<think>my move</think><move>"
            assert int(options.played) not in sound_moves(board, mark)
            assert sorted(int(o) for o in options.others) == [
                c for c in empty_cells(board) if c != int(options.played)
            ]
            for option in options.others:
                expected = 1.0 if int(option) in sound_moves(board, mark) else 0.0
                assert options.judge(option) == expected
            assert options.judge(options.played) == 0.0
    assert offered >= 6


def test_a_sound_second_choice_is_trained_on_its_move_token_alone(played, tiny_model):
    env, tokenizer, rollouts = played
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    torch.manual_seed(0)
    sequences, metrics = second_choice_sequences(
        env, rollouts, model, tokenizer, weight=2.0, temperature=1.0, pieces={}, rows_per_pass=5
    )
    unsound = sum(v is False for r in rollouts for v in r.state["move_sound"])
    assert metrics["second_choice/tried"] == unsound
    assert len(sequences) == round(metrics["second_choice/sound_rate"] * unsound)
    assert sequences, "no second choice was sound in 12 games: the draw never left the move"
    originals = [t.prompt_ids + t.completion_ids for r in rollouts for t in r.turns]
    for sequence in sequences:
        (at,) = [i for i, w in enumerate(sequence.weights) if w > 0]
        assert sequence.weights[at] == 1.0 and sequence.advantages[at] == 2.0
        assert sum(a != 0 for a in sequence.advantages) == 1
        # The same tokens as one of the turns, the move token alone swapped.
        matches = [
            o for o in originals
            if len(o) == len(sequence.input_ids) and o[:at] == sequence.input_ids[:at]
            and o[at + 1 :] == sequence.input_ids[at + 1 :]
        ]  # fmt: skip
        assert matches and matches[0][at] != sequence.input_ids[at]
        assert tokenizer.decode(sequence.input_ids[at]).isdigit()


def test_second_choices_follow_the_policys_own_preference(played, tiny_model):
    """Drawn at temperature ~0 the choice is the other move the model scores highest, and it
    is trained exactly where the env judges that move sound."""
    env, tokenizer, rollouts = played
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    expected = {}  # prefix ids -> the best-scored other move's token, where it is sound
    for rollout in rollouts:
        for index, turn in enumerate(rollout.turns):
            options = env.decision_options(rollout, index, reply_text(tokenizer, turn))
            if options is None:
                continue
            move_tag = tokenizer.convert_tokens_to_ids("<move>")
            at = len(turn.completion_ids) - turn.completion_ids[::-1].index(move_tag)
            prefix = turn.prompt_ids + turn.completion_ids[:at]
            with torch.no_grad():
                logits = model(torch.tensor([prefix])).logits[0, -1]
            best = max(options.others, key=lambda o: logits[tokenizer.convert_tokens_to_ids(o)])
            if options.judge(best) > 0:
                expected[tuple(prefix)] = tokenizer.convert_tokens_to_ids(best)
    sequences, _ = second_choice_sequences(
        env, rollouts, model, tokenizer, weight=1.0, temperature=1e-6, pieces={}
    )
    chosen = {}
    for sequence in sequences:
        (at,) = [i for i, w in enumerate(sequence.weights) if w > 0]
        chosen[tuple(sequence.input_ids[:at])] = sequence.input_ids[at]
    assert expected and chosen == expected


def test_last_logits_of_left_padded_prefixes_are_each_prefixs_own(tiny_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    prefixes = [[5, 9, 12, 40, 41, 7], [3, 4], [8, 8, 8, 8]]
    batched = _last_logits(model, prefixes)
    for row, prefix in enumerate(prefixes):
        with torch.no_grad():
            alone = model(torch.tensor([prefix])).logits[0, -1].float()
        assert torch.allclose(batched[row], alone, atol=1e-4)


def test_rl_with_second_choices_reports_them_and_refuses_envs_without_verdicts(
    tiny_model, tmp_path
):
    values = dict(
        model=tiny_model, output_dir=str(tmp_path / "rl"), batch_size=8,
        rollouts_per_example=4, micro_batch_size=8, max_tokens=8, max_steps=1,
        second_choice_weight=1.0,
    )  # fmt: skip
    sink = RecordingSink()
    tictactoe = {"env": "tictactoe", "env_args": {"max_turns": 2, "num_groups": 2}}
    cfg = build_config(RLConfig, [("test", {**values, **tictactoe})])
    run_rl(cfg, sink)
    ((_, metrics),) = sink.metrics
    assert {"second_choice/tried", "second_choice/sound_rate"} <= set(metrics)
    refused = build_config(RLConfig, [("test", {**values, "env": "reverse_text"})])
    with pytest.raises(ValueError, match="second_choice_weight=1.0 needs an env that judges"):
        run_rl(refused, RecordingSink())
