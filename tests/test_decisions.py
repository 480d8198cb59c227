"""Decision sampling: the env's hooks, the token bookkeeping, the advantages and the loss,
against values computed by hand."""

import pytest
import torch
from transformers import AutoTokenizer

from rlcore.envs.registry import load_environment
from rlcore.envs.tictactoe import sound_moves, think_reply
from rlcore.policy.tiny import ensure_tiny_model
from rlcore.train.config import ConfigError, RLConfig
from rlcore.train.decisions import (
    DecisionScorer,
    alternative_reply,
    decision_advantages,
    decision_tokens,
    supports_decisions,
    token_at,
)
from rlcore.train.grpo import DecisionStats, TrainingSequence, decision_loss, training_sequences
from rlcore.types import Rollout, Turn

# X to move on "XX.OO....": 2 wins on the spot, so it is the only sound move.
BOARD = "XX.OO...."


def rollout_of(turns: list[Turn], **fields) -> Rollout:
    return Rollout(example_id=0, seed=0, group=0, messages=[], prompt_len=0, turns=turns, **fields)


def rollout_at(board: str, completion_ids: list[int], mark: str = "X") -> Rollout:
    """One turn of the model as `mark`, made on `board`."""
    turn = Turn(prompt_ids=[1], completion_ids=completion_ids, state_key=f"{board}/0")
    return rollout_of([turn], state={"model_mark": mark})


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = ensure_tiny_model(
        tmp_path_factory.mktemp("tiny") / "model",
        hidden_size=64,
        num_layers=2,
        num_heads=2,
        intermediate_size=128,
    )
    return AutoTokenizer.from_pretrained(path)


# ---------------------------------------------------------------------------------------
# The tic-tac-toe env's hooks


def test_the_decision_is_the_first_character_inside_the_last_move_tag():
    env = load_environment("tictactoe")
    reply = "<think>Empty: 2 5.</think><move>5</move>"
    assert env.decision_offset(reply) == reply.index("5</move>")
    spaced = "<think>x</think><move>  7</move>"
    assert spaced[env.decision_offset(spaced)] == "7"
    # A move tag inside the think block is not the reply's move.
    assert env.decision_offset("<think><move>3</move></think>no tag") is None
    assert env.decision_offset("no tag at all") is None
    assert env.decision_offset("<move>") is None  # the tag ends the reply: nothing in it
    assert supports_decisions(env)
    assert not supports_decisions(load_environment("reverse_text"))


def test_an_alternative_move_scores_as_the_per_move_reward_would_have():
    env = load_environment("tictactoe", think_reward=0.5)
    rollout = rollout_at(BOARD, [0])
    assert sound_moves(BOARD, "X") == [2]
    right_think = think_reply(BOARD, 2, "X")
    assert env.score_decision(rollout, 0, right_think) == 1.5  # sound, think block right
    assert env.score_decision(rollout, 0, think_reply(BOARD, 5, "X")) == 0.5  # unsound
    assert env.score_decision(rollout, 0, "<think>wrong</think><move>2</move>") == 1.0
    assert env.score_decision(rollout, 0, "<think>wrong</think><move>0</move>") == 0.0  # taken
    assert env.score_decision(rollout, 0, "<think>wrong</think><move>x</move>") == 0.0
    # Judged from the mover's side: for O the same board's sound moves differ.
    as_o = rollout_at(BOARD, [0], mark="O")
    assert env.score_decision(as_o, 0, "<move>5</move>") == float(5 in sound_moves(BOARD, "O"))
    # No position recorded, or no such turn: it cannot say.
    rollout.turns[0].state_key = None
    assert env.score_decision(rollout, 0, right_think) is None
    assert env.score_decision(rollout_at(BOARD, [0]), 3, right_think) is None


# ---------------------------------------------------------------------------------------
# Tokens


def test_token_at_finds_the_token_covering_a_character():
    texts = ["<move>", "4", "</move>"]
    assert [token_at(texts, offset) for offset in (0, 5, 6, 7, 13, 14)] == [0, 0, 1, 2, 2, None]
    assert alternative_reply(texts, 1, "7") == "<move>7</move>"


def test_decision_tokens_point_at_each_replys_move_digit(tokenizer):
    env = load_environment("tictactoe")
    reply = think_reply("X...O....", 8, "X")
    ids = tokenizer(reply, add_special_tokens=False)["input_ids"]
    broken = tokenizer("<think>x</think>8", add_special_tokens=False)["input_ids"]
    rollout = rollout_at("X...O....", ids)
    rollout.turns.append(Turn(prompt_ids=[1], completion_ids=broken, state_key="X...O..../1"))
    pieces: dict[int, str] = {}
    index, missing = decision_tokens(env, rollout, pieces, tokenizer)
    assert missing is None
    assert tokenizer.decode(ids[index : index + 1]) == "8"
    assert tokenizer.decode(ids[:index]).endswith("<move>")


def test_the_scorer_asks_the_env_once_per_token_and_position(tokenizer):
    env = load_environment("tictactoe")
    ids = tokenizer(think_reply(BOARD, 5, "X"), add_special_tokens=False)["input_ids"]
    rollout = rollout_at(BOARD, ids)
    pieces: dict[int, str] = {}
    (index,) = decision_tokens(env, rollout, pieces, tokenizer)
    scorer = DecisionScorer(env, [rollout], pieces, tokenizer)
    two, five, zero = (tokenizer.convert_tokens_to_ids(c) for c in "250")
    assert scorer(0, 0, index, [two, five, two, zero, two]) == [1.0, 0.0, 1.0, 0.0, 1.0]
    assert scorer(0, 0, index, [two, five]) == [1.0, 0.0]
    assert scorer.env_calls == 3
    rollout.turns[0].state_key = None
    with pytest.raises(ValueError, match="could not score a decision of rollout 0 turn 0"):
        scorer(0, 0, index, [tokenizer.convert_tokens_to_ids("7")])


# ---------------------------------------------------------------------------------------
# Advantages, sequences and the loss


def test_decision_advantages_are_rewards_minus_the_group_mean_optionally_over_its_std():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    plain = decision_advantages(rewards, scale=False)
    torch.testing.assert_close(
        plain, torch.tensor([[0.5, -0.5, -0.5, 0.5], [0.0] * 4, [0.75, -0.25, -0.25, -0.25]])
    )
    scaled = decision_advantages(rewards, scale=True)
    torch.testing.assert_close(scaled[0], plain[0] / (rewards[0].std() + 1e-4))
    torch.testing.assert_close(scaled[1], torch.zeros(4))
    # One good answer among four is pushed up harder once scaled: 0.75 / 0.5 = 1.5.
    assert scaled[2, 0] == pytest.approx(0.75 / 0.5, rel=1e-3)


def two_turn_rollout() -> Rollout:
    return rollout_of(
        [
            Turn(prompt_ids=[1, 2], completion_ids=[3, 4, 5]),
            Turn(prompt_ids=[1, 2, 3, 4, 5, 6], completion_ids=[7, 8]),
        ]
    )


def test_training_sequences_list_decisions_and_can_train_only_them():
    rollout = two_turn_rollout()
    # Turn 0 decides at its second token (input position 3); turn 1 names no decision.
    (plain,) = training_sequences(rollout, [0.5, -1.0], "turn", None, None, [1, None], 5)
    assert plain.decisions == [(3, 5, 0, 1)]
    assert plain.loss_mask == [0, 0, 1, 1, 1, 0, 1, 1]
    (only,) = training_sequences(
        rollout, [0.5, -1.0], "turn", None, None, [1, None], 5, decision_only=True
    )
    # Turn 0 trains its decision alone; turn 1, without one, trains whole.
    assert only.advantages == [0, 0, 0, 0.5, 0, 0, -1.0, -1.0]
    assert only.weights == pytest.approx([0, 0, 0, 1, 0, 0, 0.5, 0.5])
    assert only.loss_mask == [0, 0, 0, 1, 0, 0, 1, 1]
    assert only.kl_weights is None
    (held,) = training_sequences(
        rollout,
        [0.5, -1.0],
        "turn",
        None,
        None,
        [1, None],
        5,
        decision_only=True,
        kl_untrained=True,
    )
    # kl_scope "untrained": the KL term covers exactly the reply tokens left untrained.
    assert held.loss_mask == [0, 0, 1, 1, 1, 0, 1, 1]
    assert held.weights == pytest.approx([0, 0, 0, 1, 0, 0, 0.5, 0.5])
    assert held.kl_weights == pytest.approx([0, 0, 0.5, 0, 0.5, 0, 0, 0])
    with pytest.raises(ValueError, match="decision_only needs decision_tokens"):
        training_sequences(rollout, [0.5, -1.0], "turn", decision_only=True)


def decision_config(**changes) -> RLConfig:
    values = {"decision_samples": 4, "decision_weight": 2.0, "decision_scale_rewards": False}
    return RLConfig(**{**values, **changes})


def test_the_decision_loss_is_the_policy_gradient_of_fresh_samples_weighted_per_decision():
    logits = torch.tensor([[0.0, 1.0, 2.0]], requires_grad=True)
    sequence = TrainingSequence([1, 2, 3], [0, 0, 1], [0, 0, 0], None, decisions=[(2, 0, 0, 0)])
    calls = []

    def scorer(rollout_index, turn_index, index, tokens):
        calls.append((rollout_index, turn_index, index, list(tokens)))
        return [1.0 if token == 2 else 0.0 for token in tokens]

    torch.manual_seed(3)
    distributions = torch.log_softmax(logits, dim=-1)
    stats = DecisionStats()
    loss = decision_loss([sequence], distributions, decision_config(), scorer, 2.0, stats)
    loss.backward()
    ((_, _, _, drawn),) = calls
    torch.manual_seed(3)
    replay = torch.multinomial(torch.softmax(distributions.detach(), -1), 4, replacement=True)
    assert drawn == replay[0].tolist()
    rewards = torch.tensor([1.0 if t == 2 else 0.0 for t in drawn])
    advantages = rewards - rewards.mean()
    # d/dlogits of -(weight / K) * sum_k A_k log p(a_k) / normalizer, ratio 1.
    probabilities = distributions.detach().exp()[0]
    expected = torch.zeros(3)
    for token, advantage in zip(drawn, advantages, strict=True):
        expected -= (
            (2.0 / 4)
            * advantage
            * (torch.nn.functional.one_hot(torch.tensor(token), 3) - probabilities)
            / 2.0
        )
    torch.testing.assert_close(logits.grad[0], expected)
    assert float(loss.detach()) == pytest.approx(0.0, abs=1e-6)  # ratio 1, sum of A is 0
    assert stats.metrics(1) == {
        "decision/groups": 1.0,
        "decision/reward_mean": pytest.approx(float(rewards.mean())),
        "decision/zero_group_rate": float(rewards.std() == 0),
        "loss/decision": pytest.approx(0.0, abs=1e-6),
    }


def test_an_exploring_temperature_draws_what_the_policy_all_but_rules_out():
    logits = torch.tensor([[20.0, 0.0, 0.0]])
    sequence = TrainingSequence([1, 2, 3], [0, 0, 1], [0, 0, 0], None, decisions=[(2, 0, 0, 0)])
    drawn = []

    def scorer(rollout_index, turn_index, index, tokens):
        drawn.append(list(tokens))
        return [0.0] * len(tokens)

    distributions = torch.log_softmax(logits, dim=-1)
    for temperature in (0.0, 100.0):
        cfg = decision_config(decision_samples=300, decision_temperature=temperature)
        decision_loss([sequence], distributions, cfg, scorer, 1.0, DecisionStats())
    on_policy, exploring = drawn
    assert set(on_policy) == {0}
    assert min(exploring.count(token) for token in (0, 1, 2)) > 50


def test_decision_settings_are_checked():
    for changes, message in [
        ({"decision_samples": 1}, "decision_samples must be 0 .off. or at least 2"),
        ({"decision_samples": -2}, "decision_samples must be 0 .off. or at least 2"),
        ({"decision_weight": 0.0}, "decision_weight must be > 0"),
        ({"decision_temperature": -1.0}, "decision_temperature must be >= 0"),
        ({"train_scope": "think"}, r"train_scope must be one of \['reply', 'decision'\]"),
        ({"kl_scope": "untrained"}, "kl_scope='untrained' needs a KL penalty"),
    ]:
        with pytest.raises(ConfigError, match=message):
            RLConfig(**changes).validate()
    RLConfig(decision_samples=2, train_scope="decision", kl_scope="untrained", beta=1).validate()
