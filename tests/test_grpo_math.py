"""Group advantages and every loss variant against values computed by hand."""

import math

import pytest
import torch

from rlcore.train.advantages import (
    add_turn_advantages,
    group_advantages,
    tree_advantages,
    turn_reward_advantages,
)
from rlcore.train.config import ConfigError, LossConfig, RLConfig, build_config
from rlcore.train.grpo import loss_normalizer, policy_loss
from rlcore.train.sequences import TrainingSequence, training_sequences
from rlcore.types import Rollout, Turn

# Two sequences of two tokens; the last token of the second is not trained.
OLD = torch.tensor([[-1.0, -2.0], [-0.5, -1.5]])
RATIOS = torch.tensor([[1.5, 0.5], [0.5, 3.0]])
WEIGHTS = torch.tensor([[1.0, 1.0], [1.0, 0.0]])  # token aggregation: 1 where trained
ADVANTAGES = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])


def new_logprobs() -> torch.Tensor:
    return (OLD + RATIOS.log()).clone().requires_grad_(True)


def assert_close(actual: torch.Tensor, expected) -> None:
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype))


def loss_config(**changes) -> LossConfig:
    return LossConfig(**{"clip_eps_low": 0.2, "clip_eps_high": 0.28, "beta": 0.0, **changes})


def config(**changes) -> RLConfig:
    return build_config(RLConfig, [("test", changes)])


def sequences(trained: list[int], turns: int = 1) -> list[TrainingSequence]:
    """Sequences with these numbers of trained tokens (for the normalizer)."""
    return [
        TrainingSequence(input_ids=[0] * (n + 1), weights=[0.0] + [1.0] * n,
                         advantages=[0.0] * (n + 1), sampled_logprobs=None, turns=turns)
        for n in trained
    ]  # fmt: skip


def test_advantages_are_rewards_minus_their_group_mean():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 1.0, 1.0, 1.0, 1.0])
    advantages = group_advantages(rewards, group_size=4, scale=False)
    assert advantages.tolist() == [0.5, -0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]


def test_scaled_advantages_divide_by_the_group_std_and_leave_flat_groups_at_zero():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 1.0, 1.0, 1.0, 1.0])
    advantages = group_advantages(rewards, group_size=4, scale=True)
    std = math.sqrt((0.25 + 0.25) / 3)  # unbiased std of [1, 0, .5, .5]
    expected = [0.5 / (std + 1e-4), -0.5 / (std + 1e-4), 0, 0, 0, 0, 0, 0]
    assert advantages.tolist() == pytest.approx(expected, rel=1e-5)


def test_rewards_that_do_not_fill_whole_groups_are_refused():
    with pytest.raises(ValueError, match="5 rewards do not split into groups of 2"):
        group_advantages(torch.ones(5), group_size=2, scale=False)


def test_grpo_clips_the_ratio_per_token_and_averages_over_completion_tokens():
    logprobs = new_logprobs()
    loss, stats = policy_loss(logprobs, OLD, None, ADVANTAGES, WEIGHTS, loss_config(), 3.0)
    # token (0,0): A=+1, ratio 1.5 > 1.28 -> clipped objective 1.28
    # token (0,1): A=+1, ratio 0.5 -> unclipped 0.5 (the min keeps the pessimistic term)
    # token (1,0): A=-1, ratio 0.5 < 0.8 -> clipped objective -0.8
    assert loss.item() == pytest.approx((-1.28 - 0.5 + 0.8) / 3)
    assert stats["clipped"] / stats["tokens"] == pytest.approx(2 / 3)
    assert stats["tokens"] == 3
    loss.backward()
    # Clipped tokens get no gradient; the free one gets -ratio * A / 3; untrained: none.
    assert_close(logprobs.grad, [[0.0, -0.5 / 3], [0.0, 0.0]])


def test_grpo_with_ratio_one_is_the_policy_gradient():
    logprobs = OLD.clone().requires_grad_(True)
    loss, stats = policy_loss(logprobs, OLD, None, ADVANTAGES, WEIGHTS, loss_config(), 3.0)
    assert loss.item() == pytest.approx((-1 - 1 + 1) / 3)
    assert stats["clipped"] == 0.0
    loss.backward()
    assert_close(logprobs.grad, [[-1 / 3, -1 / 3], [1 / 3, 0.0]])


def test_dr_grpo_divides_the_sum_by_max_tokens_times_sequences():
    logprobs = new_logprobs()
    normalizer = loss_normalizer(sequences([2, 1]), loss_config(type="dr_grpo"), max_tokens=4)
    assert normalizer == 8.0
    assert loss_normalizer(sequences([2, 1]), loss_config(type="grpo"), max_tokens=4) == 3.0
    loss, _ = policy_loss(
        logprobs, OLD, None, ADVANTAGES, WEIGHTS, loss_config(type="dr_grpo"), normalizer
    )
    assert loss.item() == pytest.approx((-1.28 - 0.5 + 0.8) / (4 * 2))


def test_cispo_weights_every_token_by_its_clipped_ratio_without_differentiating_it():
    logprobs = new_logprobs()
    loss, stats = policy_loss(
        logprobs, OLD, None, ADVANTAGES, WEIGHTS, loss_config(type="cispo"), 3.0
    )
    weights = [[1.28, 0.5], [0.5, 1.28]]  # min(ratio, 1 + eps_high)
    expected = (
        -(
            weights[0][0] * 1 * logprobs[0, 0]
            + weights[0][1] * 1 * logprobs[0, 1]
            + weights[1][0] * -1 * logprobs[1, 0]
        )
        / 3
    )
    assert loss.item() == pytest.approx(expected.item())
    assert stats["clipped"] / stats["tokens"] == pytest.approx(1 / 3)
    loss.backward()
    # Stop-gradient: d/dlogprob is -weight * A / 3 exactly, and the clipped token (0,0)
    # still learns, unlike under grpo. Differentiating through the ratio would add
    # -ratio * A * logprob / 3 terms and change every entry.
    assert_close(logprobs.grad, [[-1.28 / 3, -0.5 / 3], [0.5 / 3, 0.0]])


def test_the_kl_penalty_is_the_k3_estimate_weighted_by_beta():
    logprobs = OLD.clone().requires_grad_(True)
    reference = OLD + torch.tensor([[0.5, -0.5], [1.0, 2.0]])
    loss, stats = policy_loss(
        logprobs, OLD, reference, ADVANTAGES, WEIGHTS, loss_config(beta=0.1), 3.0
    )

    def k3(delta):
        return math.exp(delta) - delta - 1

    kl_sum = k3(0.5) + k3(-0.5) + k3(1.0)  # the untrained token (delta 2) does not count
    assert stats["kl"] == pytest.approx(kl_sum)
    assert stats["total"] == pytest.approx(loss.item())
    assert loss.item() == pytest.approx((-1 - 1 + 1) / 3 + 0.1 * kl_sum / 3)
    loss.backward()
    # d k3 / d logprob = 1 - exp(ref - logprob)
    expected = [
        [(-1 + 0.1 * (1 - math.exp(0.5))) / 3, (-1 + 0.1 * (1 - math.exp(-0.5))) / 3],
        [(1 + 0.1 * (1 - math.exp(1.0))) / 3, 0.0],
    ]
    assert_close(logprobs.grad, expected)


def test_a_reference_is_ignored_when_beta_is_zero():
    reference = OLD + 1.0
    loss, stats = policy_loss(OLD.clone(), OLD, reference, ADVANTAGES, WEIGHTS, loss_config(), 3.0)
    assert loss.item() == pytest.approx(-1 / 3)
    assert stats["kl"] == 0.0


@pytest.mark.parametrize("loss_type", ["grpo", "cispo", "dr_grpo"])
def test_micro_batches_with_the_batch_normalizer_add_up_to_the_full_batch(loss_type):
    loss = loss_config(type=loss_type, beta=0.05)
    reference = OLD - 0.3
    normalizer = loss_normalizer(sequences([2, 1]), loss, max_tokens=4)
    full = new_logprobs()
    full_loss, _ = policy_loss(full, OLD, reference, ADVANTAGES, WEIGHTS, loss, normalizer)
    full_loss.backward()
    parts = new_logprobs()
    total = 0.0
    for row in (0, 1):
        rows = slice(row, row + 1)
        part_loss, _ = policy_loss(
            parts[rows], OLD[rows], reference[rows], ADVANTAGES[rows], WEIGHTS[rows], loss,
            normalizer,
        )  # fmt: skip
        part_loss.backward()
        total += part_loss.item()
    assert total == pytest.approx(full_loss.item())
    assert_close(parts.grad, full.grad.tolist())


def test_an_unknown_loss_type_or_aggregation_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"loss.type must be one of .*got 'ppo'"):
        config(loss_type="ppo")
    with pytest.raises(ConfigError, match=r"loss.aggregation must be one of .*got 'rollout'"):
        config(**{"loss.aggregation": "rollout"})


def test_sequence_aggregation_weighs_every_sequence_the_same_whatever_its_length():
    # Per-token objectives as in the token-level test: first sequence 1.28 and 0.5 (two
    # tokens, mean 0.89); second sequence -0.8 (one token). Each sequence's own mean,
    # summed, over the 2 sequences: the weights training_sequences gives (1 / its tokens).
    loss = loss_config(aggregation="sequence")
    assert loss_normalizer(sequences([2, 1]), loss, max_tokens=4) == 2.0
    weights = torch.tensor([[0.5, 0.5], [1.0, 0.0]])
    value, stats = policy_loss(new_logprobs(), OLD, None, ADVANTAGES, weights, loss, 2.0)
    assert value.item() == pytest.approx(-((1.28 + 0.5) / 2 - 0.8) / 2)
    assert stats["tokens"] == 3.0


# ---------------------------------------------------------------------------------------
# Per-turn credit: tree advantages, per-token advantages and turn aggregation


def rollout_of(turns: list[Turn], reward: float = 0.0) -> Rollout:
    return Rollout(
        example_id=0, seed=0, group=0, messages=[], prompt_len=0, reward=reward, turns=turns
    )


def rollout(reward: float, *prompts: list[int]) -> Rollout:
    """A rollout whose turns have these prompts (each turn's completion: one token)."""
    return rollout_of(
        [Turn(prompt_ids=list(p), completion_ids=[p[-1] + 100]) for p in prompts], reward
    )


def test_tree_advantages_compare_each_move_with_the_others_tried_in_its_position():
    # Group 1: from the root [1], two rollouts made the move leading to [1, 10], one the
    # move leading to [1, 11], one ended the game at once.
    group = [
        rollout(1.0, [1], [1, 10]),
        rollout(0.0, [1], [1, 10]),
        rollout(1.0, [1], [1, 11]),
        rollout(0.5, [1]),
    ]
    # Group 2: every rollout scored the same: no signal anywhere.
    flat = [rollout(0.5, [2], [2, 10]), rollout(0.5, [2], [2, 11])] * 2
    advantages = tree_advantages(group + flat, group_size=4)
    root = (1.0 + 0.0 + 1.0 + 0.5) / 4
    shared = (1.0 + 0.0) / 2  # the two rollouts through [1, 10]
    expected = [
        [shared - root, 1.0 - shared],
        [shared - root, 0.0 - shared],
        [1.0 - root, 0.0],  # [1, 11] was reached once: nothing to compare there
        [0.5 - root],
    ]
    assert [len(turns) for turns in advantages[:4]] == [2, 2, 2, 1]
    for actual, wanted in zip(advantages[:4], expected, strict=True):
        assert actual == pytest.approx(wanted)
    assert advantages[4:] == [[0.0, 0.0]] * 4
    # A single-turn group is plain GRPO: each reward minus the group's mean.
    single = [rollout(r, [3]) for r in (1.0, 0.0, 0.5, 0.5)]
    grpo = group_advantages(torch.tensor([1.0, 0.0, 0.5, 0.5]), 4, scale=False)
    assert [a[0] for a in tree_advantages(single, 4)] == pytest.approx(grpo.tolist())


def test_a_rollout_whose_first_turn_failed_gets_no_advantages_and_spoils_no_others():
    # Its first turn failed (an engine error, a context overflow): no turns, nothing to
    # credit; the group's other rollouts are compared among themselves as before.
    group = [rollout(1.0, [1]), rollout(0.0, [1]), rollout_of([], reward=0.0)]
    advantages = tree_advantages(group, group_size=3)
    assert advantages[2] == []
    # The failed rollout reached no position, so the root's value is the other two's mean.
    assert advantages[0] == pytest.approx([1.0 - 0.5])
    assert advantages[1] == pytest.approx([0.0 - 0.5])


def test_tree_advantages_refuse_partial_groups():
    with pytest.raises(ValueError, match="3 rollouts do not split into groups of 2"):
        tree_advantages([rollout(0.0, [1])] * 3, group_size=2)


@pytest.mark.parametrize(
    "aggregation, weights",
    [
        ("token", [0, 0, 1, 1, 1, 0, 1]),
        ("sequence", [0, 0, 0.25, 0.25, 0.25, 0, 0.25]),
        ("turn", [0, 0, 1 / 3, 1 / 3, 1 / 3, 0, 1]),
    ],
)
def test_training_sequences_carry_each_turns_advantage_and_weight(aggregation, weights):
    two_turns = rollout_of(
        [
            Turn(prompt_ids=[1, 2], completion_ids=[3, 4, 5], logprobs=[-0.1, -0.2, -0.3]),
            Turn(prompt_ids=[1, 2, 3, 4, 5, 6], completion_ids=[7], logprobs=[-0.4]),
        ]
    )
    (sequence,) = training_sequences(two_turns, [0.5, -1.0], aggregation)
    assert sequence.input_ids == [1, 2, 3, 4, 5, 6, 7]
    assert [int(w > 0) for w in sequence.weights] == [0, 0, 1, 1, 1, 0, 1]
    assert sequence.advantages == [0, 0, 0.5, 0.5, 0.5, 0, -1.0]
    assert sequence.weights == pytest.approx(weights)
    assert sequence.sampled_logprobs == [0, 0, -0.1, -0.2, -0.3, 0, -0.4]
    assert sequence.turns == 2
    with pytest.raises(ValueError, match="1 advantages for a rollout of 2 turns"):
        training_sequences(two_turns, [0.5], aggregation)


def test_turn_aggregation_averages_each_turn_then_over_turns():
    # One sequence holding two turns: tokens 0-1 are turn A (advantage 1), token 2 turn B
    # (advantage -2); ratio 1 everywhere, so the loss is -sum(w * A) / turns.
    loss = loss_config(aggregation="turn")
    old = torch.zeros(1, 3)
    advantages = torch.tensor([[1.0, 1.0, -2.0]])
    weights = torch.tensor([[0.5, 0.5, 1.0]])
    normalizer = loss_normalizer(sequences([3], turns=2), loss, max_tokens=4)
    assert normalizer == 2.0
    value, _ = policy_loss(
        old.clone().requires_grad_(True), old, None, advantages, weights, loss, normalizer
    )
    assert_close(value, -((0.5 * 1 + 0.5 * 1) + 1.0 * -2.0) / 2)


def test_tree_advantage_config_is_checked():
    with pytest.raises(ConfigError, match="advantage must be one of"):
        config(advantage="vine")
    with pytest.raises(ConfigError, match="scale_rewards applies to advantage 'group' only"):
        config(advantage="tree", scale_rewards=True)


# ---------------------------------------------------------------------------------------
# Per-turn rewards from the env and loss on the answer only


def keyed(*keys: str) -> Rollout:
    """A rollout whose turns the env named `keys` (one token each)."""
    return rollout_of([Turn(prompt_ids=[1], completion_ids=[2], state_key=k) for k in keys])


def test_turn_rewards_are_compared_in_their_position_where_moves_differed():
    rollouts = [keyed("a", "b"), keyed("a", "c"), keyed("d"), keyed("d")]
    rewards = [[1.0, 0.0], [0.0, 1.0], [0.0], [0.0]]
    batch_mean = 2 / 6
    advantages = turn_reward_advantages(rollouts, rewards, group_size=2)
    # "a": the two moves scored 1 and 0, so the baseline is their mean; "b" and "c" were
    # met once and "d" saw the same (bad) move twice: the batch's mean judges them, so a
    # move always made badly is still pushed down.
    expected = [
        [1.0 - 0.5, 0.0 - batch_mean],
        [0.0 - 0.5, 1.0 - batch_mean],
        [0.0 - batch_mean],
        [0.0 - batch_mean],
    ]
    for actual, wanted in zip(advantages, expected, strict=True):
        assert actual == pytest.approx(wanted)
    # Positions are per group: the same key in another group is another position.
    again = turn_reward_advantages(
        [keyed("a"), keyed("x"), keyed("a"), keyed("y")], [[1.0], [0.0], [0.0], [1.0]], 2
    )
    assert again == [[0.5], [-0.5], [-0.5], [0.5]]


def test_turn_rewards_must_match_the_turns_and_fill_whole_groups():
    with pytest.raises(ValueError, match="rollout 1 .* has 2 turns but 1 per-turn rewards"):
        turn_reward_advantages([keyed("a"), keyed("a", "b")], [[1.0], [1.0]], 2)
    with pytest.raises(ValueError, match="3 rollouts do not split into groups of 2"):
        turn_reward_advantages([keyed("a")] * 3, [[1.0]] * 3, 2)


def test_turn_advantages_add_to_the_episode_ones_times_the_weight():
    assert add_turn_advantages([[0.5, -1.0], [0.0]], [[1.0, 1.0], [-0.5]], 2.0) == [
        [2.5, 1.0],
        [-1.0],
    ]


def test_skipped_think_tokens_are_not_trained_and_stay_out_of_the_turn_weights():
    two_turns = rollout_of(
        [
            Turn(prompt_ids=[1, 2], completion_ids=[3, 4, 5]),
            Turn(prompt_ids=[1, 2, 3, 4, 5, 6], completion_ids=[7, 8]),
        ]
    )
    (sequence,) = training_sequences(two_turns, [0.5, -1.0], "turn", think_lengths=[2, 0])
    assert sequence.input_ids == [1, 2, 3, 4, 5, 6, 7, 8]
    assert sequence.advantages == [0, 0, 0, 0, 0.5, 0, -1.0, -1.0]
    assert sequence.weights == pytest.approx([0, 0, 0, 0, 1, 0, 0.5, 0.5])
    assert sequence.trained_tokens == 3
    (whole,) = training_sequences(two_turns, [0.5, -1.0], "turn")
    assert whole.trained_tokens == 5  # the control: with the think block trained


def test_turn_reward_and_advantage_settings_are_checked():
    with pytest.raises(ConfigError, match="turn_reward_weight must be at least 0.0"):
        config(turn_reward_weight=-1.0)
    with pytest.raises(ConfigError, match='advantage "none" leaves nothing to learn'):
        config(advantage="none")
    config(advantage="none", turn_reward_weight=1.0)
