"""Training the policy's self-play opponent replies (RL's `opponent_weight`): each reply the
policy gave from the other side, judged by the env's solver, trained with its verdict less
the batch's mean verdict; the move tokens only where the think block is left out."""

import asyncio

import pytest
from transformers import AutoTokenizer

from rlcore.envs.registry import load_environment
from rlcore.envs.tictactoe_game import empty_cells, sound_moves
from rlcore.events import RecordingSink
from rlcore.policy.base import Policy
from rlcore.rollout import run_rollouts
from rlcore.train.config import RLConfig, build_config
from rlcore.train.grpo import opponent_sequences, run_rl
from rlcore.types import Generation, SamplingParams


class Alternating(Policy):
    """For each side, a sound move on every other call and an unsound one (where there is
    one) between, in a well-formed reply with the tiny tokenizer's ids."""

    name = "alternating"

    def __init__(self, tokenizer):
        self.tokenizer, self.calls = tokenizer, {}

    async def generate(self, messages, sampling, *, tools=None, state=None) -> Generation:
        board, mark = state["board"], state["model_mark"]
        sound = sound_moves(board, mark)
        unsound = [c for c in empty_cells(board) if c not in sound]
        self.calls[mark] = self.calls.get(mark, 0) + 1
        cell = unsound[0] if self.calls[mark] % 2 and unsound else sound[0]
        text = f"<think>Empty: {' '.join(map(str, empty_cells(board)))}.</think><move>{cell}</move>"
        rendered = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        prompt = self.tokenizer.encode(rendered, add_special_tokens=False)
        completion = self.tokenizer.encode(text, add_special_tokens=False)
        completion.append(self.tokenizer.convert_tokens_to_ids("<|im_end|>"))
        return Generation(
            text=text, prompt_ids=prompt, completion_ids=completion,
            logprobs=[-1.0] * len(completion),
        )  # fmt: skip


@pytest.fixture(scope="module")
def played(tiny_model):
    env = load_environment("tictactoe", max_turns=4, num_groups=2, self_play=1.0)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    policy = Alternating(tokenizer)
    rollouts = asyncio.run(
        run_rollouts(env, policy, env.examples(16, seed=5), sampling=SamplingParams())
    )
    return tokenizer, rollouts


def test_each_reply_is_trained_with_its_verdict_against_the_batch_mean(played):
    tokenizer, rollouts = played
    judged = [pair for rollout in rollouts for pair in rollout.opponent_turns]
    verdicts = [verdict for _, verdict in judged]
    baseline = sum(verdicts) / len(verdicts)
    assert 0 < baseline < 1  # both kinds of replies were played
    sequences, metrics = opponent_sequences(rollouts, 2.0, "turn", ({}, tokenizer))
    assert metrics == {"opponent/replies": len(judged), "opponent/sound_rate": baseline}
    assert len(sequences) == len(judged)
    move_tag = tokenizer.encode("<move>", add_special_tokens=False)
    for sequence, (turn, verdict) in zip(sequences, judged, strict=True):
        assert sequence.input_ids == turn.prompt_ids + turn.completion_ids
        trained = [i for i, w in enumerate(sequence.weights) if w > 0]
        # The think block and the prompt are not trained: the reply from `<move>` on is.
        start = len(turn.prompt_ids) + turn.completion_ids.index(move_tag[0])
        assert trained == list(range(start, len(sequence.input_ids)))
        expected = 2.0 * (verdict - baseline)
        assert [sequence.advantages[i] for i in trained] == pytest.approx([expected] * len(trained))
        assert sequence.sampled_logprobs[start] == -1.0


def test_a_batch_of_one_verdict_trains_nothing(played):
    tokenizer, rollouts = played
    for rollout in rollouts:
        rollout.opponent_turns = [(turn, 1.0) for turn, _ in rollout.opponent_turns]
    sequences, metrics = opponent_sequences(rollouts, 2.0, "turn", ({}, tokenizer))
    assert sequences == [] and metrics["opponent/sound_rate"] == 1.0


def test_rl_reports_the_opponents_replies_and_needs_self_play(tmp_path):
    # The shipped player makes legal moves, so its games reach the opponent's replies (the
    # untrained tiny model's never do).
    values = dict(
        model="tiny-master", output_dir=str(tmp_path / "rl"), batch_size=8,
        rollouts_per_example=4, micro_batch_size=8, max_tokens=64, max_steps=1,
        opponent_weight=1.0, env="tictactoe",
    )  # fmt: skip
    with pytest.raises(ValueError, match="opponent_weight"):
        build_config(RLConfig, [("test", {**values, "env_args": {"max_turns": 2}})])
    args = {"max_turns": 2, "num_groups": 2, "self_play": 1.0}
    sink = RecordingSink()
    run_rl(build_config(RLConfig, [("test", {**values, "env_args": args})]), sink)
    ((_, metrics),) = sink.metrics
    assert metrics["opponent/replies"] > 0 and 0 <= metrics["opponent/sound_rate"] <= 1
