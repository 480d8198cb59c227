"""Group advantages and every loss variant against values computed by hand."""

import math

import pytest
import torch

from rlcore.train.config import ConfigError, RLConfig
from rlcore.train.grpo import (
    add_turn_advantages,
    group_advantages,
    loss_normalizer,
    policy_loss,
    scale_negative,
    training_sequences,
    tree_advantages,
    turn_reward_advantages,
)
from rlcore.types import Rollout, Turn

# Two sequences of two tokens; the last token of the second is off the mask.
OLD = torch.tensor([[-1.0, -2.0], [-0.5, -1.5]])
RATIOS = torch.tensor([[1.5, 0.5], [0.5, 3.0]])
MASK = torch.tensor([[1, 1], [1, 0]])
ADVANTAGES = torch.tensor([1.0, -1.0])


def new_logprobs() -> torch.Tensor:
    return (OLD + RATIOS.log()).clone().requires_grad_(True)


def assert_close(actual: torch.Tensor, expected) -> None:
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype))


def config(**changes) -> RLConfig:
    values = {"clip_eps_low": 0.2, "clip_eps_high": 0.28, "max_tokens": 4, "beta": 0.0}
    return RLConfig(**{**values, **changes})


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
    loss, stats = policy_loss(logprobs, OLD, None, ADVANTAGES, MASK, config(loss_type="grpo"))
    # token (0,0): A=+1, ratio 1.5 > 1.28 -> clipped objective 1.28
    # token (0,1): A=+1, ratio 0.5 -> unclipped 0.5 (the min keeps the pessimistic term)
    # token (1,0): A=-1, ratio 0.5 < 0.8 -> clipped objective -0.8
    assert loss.item() == pytest.approx((-1.28 - 0.5 + 0.8) / 3)
    assert stats["policy/clip_fraction"] == pytest.approx(2 / 3)
    assert stats["tokens"] == 3
    loss.backward()
    # Clipped tokens get no gradient; the free one gets -ratio * A / 3; masked: none.
    assert_close(logprobs.grad, [[0.0, -0.5 / 3], [0.0, 0.0]])


def test_grpo_with_ratio_one_is_the_policy_gradient():
    logprobs = OLD.clone().requires_grad_(True)
    loss, stats = policy_loss(logprobs, OLD, None, ADVANTAGES, MASK, config())
    assert loss.item() == pytest.approx((-1 - 1 + 1) / 3)
    assert stats["policy/clip_fraction"] == 0.0
    loss.backward()
    assert_close(logprobs.grad, [[-1 / 3, -1 / 3], [1 / 3, 0.0]])


def test_dr_grpo_divides_the_sum_by_max_tokens_times_sequences():
    logprobs = new_logprobs()
    loss, _ = policy_loss(logprobs, OLD, None, ADVANTAGES, MASK, config(loss_type="dr_grpo"))
    assert loss.item() == pytest.approx((-1.28 - 0.5 + 0.8) / (4 * 2))
    assert loss_normalizer(3, 2, config(loss_type="dr_grpo")) == 8.0
    assert loss_normalizer(3, 2, config(loss_type="grpo")) == 3.0


def test_cispo_weights_every_token_by_its_clipped_ratio_without_differentiating_it():
    logprobs = new_logprobs()
    loss, stats = policy_loss(logprobs, OLD, None, ADVANTAGES, MASK, config(loss_type="cispo"))
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
    assert stats["policy/clip_fraction"] == pytest.approx(1 / 3)
    loss.backward()
    # Stop-gradient: d/dlogprob is -weight * A / 3 exactly, and the clipped token (0,0)
    # still learns, unlike under grpo. Differentiating through the ratio would add
    # -ratio * A * logprob / 3 terms and change every entry.
    assert_close(logprobs.grad, [[-1.28 / 3, -0.5 / 3], [0.5 / 3, 0.0]])


def test_the_kl_penalty_is_the_k3_estimate_weighted_by_beta():
    logprobs = OLD.clone().requires_grad_(True)
    reference = OLD + torch.tensor([[0.5, -0.5], [1.0, 2.0]])
    cfg = config(beta=0.1)
    loss, stats = policy_loss(logprobs, OLD, reference, ADVANTAGES, MASK, cfg)

    def k3(delta):
        return math.exp(delta) - delta - 1

    kl_sum = k3(0.5) + k3(-0.5) + k3(1.0)  # the masked token (delta 2) does not count
    assert stats["loss/kl"] == pytest.approx(kl_sum / 3)
    assert loss.item() == pytest.approx((-1 - 1 + 1) / 3 + 0.1 * kl_sum / 3)
    loss.backward()
    # d k3 / d logprob = 1 - exp(ref - logprob)
    expected = [
        [(-1 + 0.1 * (1 - math.exp(0.5))) / 3, (-1 + 0.1 * (1 - math.exp(-0.5))) / 3],
        [(1 + 0.1 * (1 - math.exp(1.0))) / 3, 0.0],
    ]
    assert_close(logprobs.grad, expected)


def test_kl_weights_confine_the_penalty_to_their_tokens():
    # Token (0, 0) is trained by the policy loss only, (0, 1) held by the KL term only
    # (a think block with train_think off), (1, 0) both.
    logprobs = OLD.clone().requires_grad_(True)
    reference = OLD + torch.tensor([[0.5, -0.5], [1.0, 2.0]])
    weights = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    kl_weights = torch.tensor([[0.0, 1.0], [1.0, 0.0]])
    cfg = config(beta=0.1, kl_scope="think")
    loss, stats = policy_loss(
        logprobs,
        OLD,
        reference,
        ADVANTAGES,
        MASK,
        cfg,
        normalizer=2.0,
        weights=weights,
        kl_weights=kl_weights,
    )

    def k3(delta):
        return math.exp(delta) - delta - 1

    assert stats["loss/kl"] == pytest.approx((k3(-0.5) + k3(1.0)) / 2)
    assert loss.item() == pytest.approx((-1 + 1) / 2 + 0.1 * (k3(-0.5) + k3(1.0)) / 2)
    loss.backward()
    expected = [
        [-1 / 2, 0.1 * (1 - math.exp(-0.5)) / 2],
        [(1 + 0.1 * (1 - math.exp(1.0))) / 2, 0.0],
    ]
    assert_close(logprobs.grad, expected)


def test_kl_scope_is_checked():
    with pytest.raises(ConfigError, match="kl_scope must be one of"):
        config(kl_scope="move", beta=0.1).validate()
    with pytest.raises(ConfigError, match="kl_scope='think' needs a KL penalty"):
        config(kl_scope="think").validate()
    config(kl_scope="think", beta=0.1).validate()


def test_unlikelihood_replaces_the_push_down_on_unsure_negative_tokens_only():
    # Token probabilities 0.5 and 0.999 under advantage -1 (first sequence: +1, unchanged).
    logprobs = torch.tensor([[math.log(0.3), math.log(0.6)], [math.log(0.5), math.log(0.999)]])
    logprobs = logprobs.clone().requires_grad_(True)
    old = logprobs.detach().clone()
    mask = torch.ones(2, 2)
    cfg = config(unlikelihood_below=0.99)
    loss, stats = policy_loss(logprobs, old, None, ADVANTAGES, mask, cfg, normalizer=4.0)
    # (1, 0): p = 0.5 < 0.99 and A = -1: -log(1 - 0.5); (1, 1): p = 0.999 keeps the policy
    # gradient term -A * ratio = 1; the positive sequence keeps -A * ratio = -1 per token.
    assert loss.item() == pytest.approx((-1 - 1 - math.log(0.5) + 1) / 4)
    assert stats["policy/unlikelihood_fraction"] == pytest.approx(0.25)
    loss.backward()
    # d/dlogprob of -log(1 - p) is p / (1 - p) = 1 for p = 0.5; the others as in grpo.
    assert_close(logprobs.grad, [[-1 / 4, -1 / 4], [1.0 / 4, 1 / 4]])
    with pytest.raises(ConfigError, match=r"unlikelihood_below must be in \[0, 1\)"):
        config(unlikelihood_below=1.0).validate()
    # Limited to the marked decisions: (1, 0) is not one, so its policy gradient stays.
    plain = logprobs.detach().clone().requires_grad_(True)
    decisions = torch.tensor([[True, True], [False, True]])
    loss, stats = policy_loss(
        plain, old, None, ADVANTAGES, mask, cfg, normalizer=4.0, decisions=decisions
    )
    assert loss.item() == pytest.approx((-1 - 1 + 1 + 1) / 4)
    assert stats["policy/unlikelihood_fraction"] == 0.0
    with pytest.raises(ConfigError, match="unlikelihood_ref_entropy needs unlikelihood_below"):
        config(unlikelihood_ref_entropy=0.5).validate()


def test_a_reference_is_ignored_when_beta_is_zero():
    reference = OLD + 1.0
    loss, stats = policy_loss(OLD.clone(), OLD, reference, ADVANTAGES, MASK, config(beta=0.0))
    assert loss.item() == pytest.approx(-1 / 3)
    assert stats["loss/kl"] == 0.0


@pytest.mark.parametrize("loss_type", ["grpo", "cispo", "dr_grpo"])
def test_micro_batches_with_the_batch_normalizer_add_up_to_the_full_batch(loss_type):
    cfg = config(loss_type=loss_type, beta=0.05)
    reference = OLD - 0.3
    normalizer = loss_normalizer(int(MASK.sum()), 2, cfg)
    full = new_logprobs()
    full_loss, _ = policy_loss(full, OLD, reference, ADVANTAGES, MASK, cfg, normalizer=normalizer)
    full_loss.backward()
    parts = new_logprobs()
    total = 0.0
    for row in (0, 1):
        part_loss, _ = policy_loss(
            parts[row : row + 1],
            OLD[row : row + 1],
            reference[row : row + 1],
            ADVANTAGES[row : row + 1],
            MASK[row : row + 1],
            cfg,
            normalizer=normalizer,
        )
        part_loss.backward()
        total += part_loss.item()
    assert total == pytest.approx(full_loss.item())
    assert_close(parts.grad, full.grad.tolist())


def test_an_unknown_loss_type_is_refused_by_name():
    cfg = config()
    cfg.loss_type = "ppo"
    with pytest.raises(ValueError, match="'ppo'"):
        policy_loss(OLD, OLD, None, ADVANTAGES, MASK, cfg)


def test_sequence_aggregation_weighs_every_sequence_the_same_whatever_its_length():
    # Per-token objectives as in the token-level test: first sequence 1.28 and 0.5 (two
    # tokens, mean 0.89); second sequence -0.8 (one token). Each sequence's own mean,
    # summed, over the 2 sequences.
    cfg = config(loss_aggregation="sequence")
    logprobs = new_logprobs()
    assert loss_normalizer(3, 2, cfg) == 2.0
    loss, stats = policy_loss(logprobs, OLD, None, ADVANTAGES, MASK, cfg)
    assert loss.item() == pytest.approx(-((1.28 + 0.5) / 2 - 0.8) / 2)
    assert stats["tokens"] == 3.0


def test_an_unknown_loss_aggregation_is_refused_by_name():
    with pytest.raises(ValueError, match="loss_aggregation must be one of"):
        config(loss_aggregation="rollout").validate()


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
    assert sequence.loss_mask == [0, 0, 1, 1, 1, 0, 1]
    assert sequence.advantages == [0, 0, 0.5, 0.5, 0.5, 0, -1.0]
    assert sequence.weights == pytest.approx(weights)
    assert sequence.sampled_logprobs == [0, 0, -0.1, -0.2, -0.3, 0, -0.4]
    assert sequence.turns == 2
    with pytest.raises(ValueError, match="1 advantages for a rollout of 2 turns"):
        training_sequences(two_turns, [0.5], aggregation)


def test_turn_aggregation_averages_each_turn_then_over_turns():
    # One sequence holding two turns: tokens 0-1 are turn A (advantage 1), token 2 turn B
    # (advantage -2); ratio 1 everywhere, so the loss is -sum(w * A) / turns.
    cfg = config(loss_aggregation="turn")
    old = torch.zeros(1, 3)
    mask = torch.ones(1, 3)
    advantages = torch.tensor([[1.0, 1.0, -2.0]])
    weights = torch.tensor([[0.5, 0.5, 1.0]])
    normalizer = loss_normalizer(3, 1, cfg, num_turns=2)
    assert normalizer == 2.0
    loss, _ = policy_loss(
        old.clone().requires_grad_(True),
        old,
        None,
        advantages,
        mask,
        cfg,
        normalizer=normalizer,
        weights=weights,
    )
    assert_close(loss, -((0.5 * 1 + 0.5 * 1) + 1.0 * -2.0) / 2)


def test_tree_advantage_config_is_checked():
    with pytest.raises(ConfigError, match="advantage must be one of"):
        config(advantage="vine").validate()
    with pytest.raises(ConfigError, match="scale_rewards=true applies to advantage='group'"):
        config(advantage="tree", scale_rewards=True).validate()


def test_negative_advantages_are_damped_or_dropped_and_the_scale_is_checked():
    advantages = [[0.5, -1.0], [-0.25], [0.0]]
    assert scale_negative(advantages, 1.0) == advantages
    assert scale_negative(advantages, 0.5) == [[0.5, -0.5], [-0.125], [0.0]]
    assert scale_negative(advantages, 0.0) == [[0.5, 0.0], [0.0], [0.0]]
    with pytest.raises(ConfigError, match=r"negative_advantage_scale must be in \[0, 1\]"):
        config(negative_advantage_scale=1.5).validate()


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


def test_skipped_think_tokens_stay_off_the_mask_and_out_of_the_turn_weights():
    two_turns = rollout_of(
        [
            Turn(prompt_ids=[1, 2], completion_ids=[3, 4, 5]),
            Turn(prompt_ids=[1, 2, 3, 4, 5, 6], completion_ids=[7, 8]),
        ]
    )
    (sequence,) = training_sequences(two_turns, [0.5, -1.0], "turn", skip=[2, 0])
    assert sequence.input_ids == [1, 2, 3, 4, 5, 6, 7, 8]
    assert sequence.loss_mask == [0, 0, 0, 0, 1, 0, 1, 1]
    assert sequence.advantages == [0, 0, 0, 0, 0.5, 0, -1.0, -1.0]
    assert sequence.weights == pytest.approx([0, 0, 0, 0, 1, 0, 0.5, 0.5])


def test_kl_only_think_tokens_join_the_mask_with_their_own_weights():
    two_turns = rollout_of(
        [
            Turn(prompt_ids=[1, 2], completion_ids=[3, 4, 5]),
            Turn(prompt_ids=[1, 2, 3, 4, 5, 6], completion_ids=[7, 8]),
        ]
    )
    # Think blocks of 2 and 1 tokens, off the policy loss (skip) but under the KL term.
    (sequence,) = training_sequences(two_turns, [0.5, -1.0], "turn", skip=[2, 1], kl_only=[2, 1])
    assert sequence.loss_mask == [0, 0, 1, 1, 1, 0, 1, 1]
    assert sequence.advantages == [0, 0, 0, 0, 0.5, 0, 0, -1.0]
    assert sequence.weights == pytest.approx([0, 0, 0, 0, 1, 0, 0, 1])
    assert sequence.kl_weights == pytest.approx([0, 0, 0.5, 0.5, 0, 0, 1, 0])
    assert sequence.turns == 2
    # Trained and held at once (train_think on): the think tokens carry both weights.
    (both,) = training_sequences(two_turns, [0.5, -1.0], "token", kl_only=[2, 0])
    assert both.loss_mask == [0, 0, 1, 1, 1, 0, 1, 1]
    assert both.weights == pytest.approx([0, 0, 1, 1, 1, 0, 1, 1])
    assert both.kl_weights == pytest.approx([0, 0, 1, 1, 0, 0, 0, 0])
    # Without kl_only the KL term follows the policy weights.
    (plain,) = training_sequences(two_turns, [0.5, -1.0], "turn")
    assert plain.kl_weights is None


def test_turn_reward_and_advantage_settings_are_checked():
    with pytest.raises(ConfigError, match="turn_reward_weight must be >= 0"):
        config(turn_reward_weight=-1.0).validate()
    with pytest.raises(ConfigError, match="advantage='none' leaves nothing to learn"):
        config(advantage="none").validate()
    config(advantage="none", turn_reward_weight=1.0).validate()
