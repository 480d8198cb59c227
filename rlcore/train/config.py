"""Run configurations for data generation, supervised fine-tuning and RL.

Each config is a dataclass with one docstring per field (CleanRL's `Args` style), loaded
from a TOML file plus `key=value` overrides by `load_config`. Overrides are parsed as JSON
when they parse (`lr=3e-4`, `exclude_outcomes=["loss"]`, `resume_from=null`) and kept as
text otherwise; a dotted key reaches into a table (`env_args.max_turns=6`). Unknown keys
and values of the wrong type are errors that name the key, where it came from and what is
accepted. Every run writes its resolved config (`to_dict()`) as `config.json` beside its
outputs, so a job's settings travel with its results.
"""

from __future__ import annotations

import ast
import inspect
import json
import math
import textwrap
import tomllib
import types
import typing
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar

DEVICES = ("auto", "cpu", "cuda")
LOSS_TYPES = ("grpo", "cispo", "dr_grpo")
LR_SCHEDULES = ("cosine", "constant")
LOSS_AGGREGATIONS = ("token", "sequence", "turn")
ADVANTAGES = ("group", "tree", "none")
KL_SCOPES = ("all", "think", "untrained")
TRAIN_SCOPES = ("reply", "decision")


class ConfigError(ValueError):
    """A config key or value that cannot be used; the message says what would be accepted.
    `errors` maps each bad key to its message where the key is known (for forms and APIs
    that put a message under its field)."""

    def __init__(self, message: str, errors: dict[str, str] | None = None):
        super().__init__(message)
        self.errors = errors or {}


# The range of every number a config takes, inclusive, by field name (a name means the
# same thing in every config class). `load_config` checks them for any config class, the
# web form's number fields take their min and max from here, and a test makes sure no
# numeric field is left out: a bound that lives in one place cannot drift between the
# form, the JSON API and the CLI.
BOUNDS: dict[str, tuple[float, float]] = {
    "num_examples": (1, 10_000_000),
    "rollouts_per_example": (1, 4096),
    "max_tokens": (1, 131_072),
    "temperature": (0.0, 10.0),
    "top_p": (0.0, 1.0),
    "concurrency": (1, 65_536),
    "seed": (0, 2**32 - 1),
    "max_kept": (1, 10_000_000),
    "min_reward": (-1e6, 1e6),
    "max_invalid_moves": (0, 1_000_000),
    "epochs": (1, 100_000),
    "max_steps": (1, 10_000_000),
    "batch_size": (1, 1_048_576),
    "micro_batch_size": (1, 1_048_576),
    "lr": (0.0, 10.0),
    "warmup_steps": (0, 10_000_000),
    "min_lr_ratio": (0.0, 1.0),
    "weight_decay": (0.0, 10.0),
    "adam_eps": (0.0, 1.0),
    "max_grad_norm": (0.0, 1e6),
    "max_seq_len": (1, 1_048_576),
    "save_every": (0, 10_000_000),
    "turn_reward_weight": (0.0, 1000.0),
    "negative_advantage_scale": (0.0, 1.0),
    "unlikelihood_below": (0.0, 1.0),
    "unlikelihood_ref_entropy": (0.0, 100.0),
    "clip_eps_low": (0.0, 1.0),
    "clip_eps_high": (0.0, 100.0),
    "beta": (0.0, 100.0),
    "curriculum_steps": (0, 10_000_000),
    "entropy_coef": (0.0, 100.0),
    "decision_samples": (0, 1024),
    "decision_weight": (0.0, 1000.0),
    "decision_temperature": (0.0, 100.0),
    "num_iterations": (1, 1000),
    "log_rollouts": (0, 1_048_576),
}


def bounds_error(name: str, value: Any) -> str | None:
    """What is wrong with `value` for field `name` by BOUNDS, or None."""
    if name not in BOUNDS or value is None or isinstance(value, bool):
        return None
    low, high = BOUNDS[name]
    if value != value or value < low:  # NaN compares false with everything
        return f"{name} must be at least {low}, got {value!r}"
    if value > high:
        return f"{name} must be at most {high}, got {value!r}"
    return None


@dataclass
class SynthConfig:
    """Generate an SFT dataset: play a teacher through an environment and keep the good
    rollouts."""

    env: str = "tictactoe"
    """environment name (see `python -m rlcore envs`)"""
    env_args: dict = field(default_factory=dict)
    """environment parameters, validated by the environment's schema"""
    model: str = "random"
    """teacher: an env built-in (`random`, `oracle`), `tiny`, a checkpoint dir, a hub id,
    or a served model name when `base_url` is set"""
    base_url: str | None = None
    """OpenAI-compatible endpoint for the teacher (vLLM, OpenAI, `rlcore serve`)"""
    api_key_env: str = "OPENAI_API_KEY"
    """environment variable holding the endpoint's API key"""
    num_examples: int = 200
    """how many examples to draw from the environment at most"""
    rollouts_per_example: int = 1
    """rollouts of each example (more gives more distinct kept conversations)"""
    max_kept: int | None = None
    """stop once this many rollouts passed the filters (None: play every example)"""
    temperature: float = 1.0
    """teacher sampling temperature (model teachers only)"""
    top_p: float = 1.0
    """teacher nucleus sampling (model teachers only)"""
    max_tokens: int = 256
    """teacher reply length limit per turn, in tokens"""
    concurrency: int = 32
    """rollouts in flight at once"""
    exclude_outcomes: list[str] = field(default_factory=list)
    """drop rollouts whose outcome label is one of these (e.g. ["loss", "unfinished"])"""
    min_reward: float | None = None
    """drop rollouts whose total reward is below this"""
    require_format: bool = False
    """drop rollouts whose `format` reward is not 1 (every assistant turn well formed)"""
    max_invalid_moves: int | None = None
    """drop rollouts whose final state counts more invalid moves than this"""
    output_dir: str = "runs/synth"
    """where the dataset (`dataset.jsonl`), its stats and config.json go"""
    seed: int = 0
    """seed of the environment's examples and of the teacher's sampling"""
    device: str = "auto"
    """device for a local model teacher: auto, cpu or cuda"""

    def validate(self) -> None:
        errors = _common_errors(self)
        _check_positive(errors, self, "num_examples", "rollouts_per_example", "max_tokens")
        _check_positive(errors, self, "concurrency")
        if self.max_kept is not None and self.max_kept < 1:
            errors.append(f"max_kept must be at least 1 or null, got {self.max_kept!r}")
        if self.max_invalid_moves is not None and self.max_invalid_moves < 0:
            errors.append(f"max_invalid_moves must be >= 0 or null, got {self.max_invalid_moves!r}")
        if self.temperature < 0:
            errors.append(f"temperature must be >= 0, got {self.temperature!r}")
        _raise(self, errors)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class SFTConfig:
    """Supervised fine-tuning of a causal LM on a JSONL conversation dataset, with the loss
    on assistant tokens only."""

    model: str = "tiny"
    """`tiny` (the built-in tiny model), a checkpoint directory, or a Hugging Face hub id"""
    dataset: str = "runs/synth/dataset.jsonl"
    """JSONL file, one {"messages": [...]} conversation per line (as `synth` writes)"""
    output_dir: str = "runs/sft"
    """where checkpoints (`step_NNNNNN/`, `final/`) and config.json go"""
    seed: int = 0
    """seed of initialisation-free randomness: data order and torch"""
    device: str = "auto"
    """auto (cuda when available), cpu or cuda"""
    epochs: int = 1
    """passes over the dataset (ignored when max_steps is set)"""
    max_steps: int | None = None
    """optimizer steps to take; overrides epochs"""
    batch_size: int = 16
    """conversations per optimizer step"""
    micro_batch_size: int = 8
    """conversations per forward pass; gradients accumulate over batch_size / this"""
    lr: float = 1e-4
    """peak learning rate (AdamW)"""
    lr_schedule: str = "cosine"
    """decay after warm-up: cosine (to min_lr_ratio * lr) or constant"""
    warmup_steps: int = 0
    """steps of linear warm-up from 0 to lr"""
    min_lr_ratio: float = 0.1
    """final learning rate of the cosine decay, as a fraction of lr"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    adam_eps: float = 1e-8
    """AdamW's epsilon: a parameter whose gradient is far below it moves less than lr per
    step (1e-8 lets even tiny, noisy gradients take full-size steps)"""
    max_grad_norm: float = 1.0
    """clip the global gradient norm to this (0: no clipping)"""
    max_seq_len: int = 1024
    """truncate longer conversations to this many tokens (truncations are counted)"""
    save_every: int = 0
    """save a checkpoint every this many steps (0: only the final one)"""

    def validate(self) -> None:
        errors = _common_errors(self)
        _check_positive(errors, self, "epochs", "batch_size", "micro_batch_size", "max_seq_len")
        _check_optimizer(errors, self)
        if self.max_steps is not None and self.max_steps < 1:
            errors.append(f"max_steps must be at least 1 or null, got {self.max_steps!r}")
        if self.micro_batch_size > self.batch_size:
            errors.append(
                f"micro_batch_size ({self.micro_batch_size}) must not exceed "
                f"batch_size ({self.batch_size})"
            )
        _raise(self, errors)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class RLConfig:
    """On-policy RL (GRPO family) of a local model on a multi-turn environment."""

    model: str = "tiny"
    """starting policy: `tiny`, a checkpoint directory (e.g. the SFT run's final/), or a hub id"""
    env: str = "tictactoe"
    """environment name"""
    env_args: dict = field(default_factory=dict)
    """environment parameters (max_turns, opponent strength range, num_groups, ...)"""
    output_dir: str = "runs/rl"
    """where checkpoints (`step_NNNNNN/`, `final/`) and config.json go"""
    seed: int = 0
    """seed of the example stream, sampling and torch"""
    device: str = "auto"
    """auto (cuda when available), cpu or cuda"""
    max_steps: int = 100
    """optimizer steps (one batch of rollouts each)"""
    batch_size: int = 32
    """rollouts per step; batch_size / rollouts_per_example examples are drawn"""
    rollouts_per_example: int = 8
    """group size: rollouts of one example whose rewards are compared for advantages"""
    loss_type: str = "grpo"
    """grpo (clipped ratio, token-level mean), cispo (clipped stop-gradient importance
    weight times logprob), dr_grpo (clipped ratio, sum / (max_tokens * sequences))"""
    loss_aggregation: str = "token"
    """grpo and cispo: "token" averages over every completion token of the batch, so a
    long rollout weighs more than a short one; "sequence" averages each rollout's tokens
    first, then over rollouts (original GRPO), so every rollout weighs the same: a long
    failed multi-turn game then cannot outweigh the short wins of its group; "turn"
    averages each assistant turn's tokens, then over turns, so every move weighs the same"""
    advantage: str = "group"
    """"group": each rollout's reward minus its group's mean, the same for all its turns
    (GRPO); "tree": per turn, the mean return of the group's rollouts that made the same
    move in the same position minus the mean of all that reached the position (credit to
    moves in multi-turn games; see grpo.tree_advantages); "none": no episode advantage, only
    the env's per-turn rewards (needs turn_reward_weight > 0)"""
    turn_reward_weight: float = 0.0
    """weight of the env's per-turn rewards (Environment.turn_rewards; tic-tac-toe: 1 for a
    move that keeps the game-theoretic value, 0 for one that gives some away or is
    invalid) in each turn's advantage: that reward minus its baseline (the mean over the
    group's turns in the same position where their rewards differ, else over the batch's
    turns), times this, is added to the episode advantage. 0 trains on episode rewards
    alone; above 0 the env must give per-turn rewards"""
    train_think: bool = True
    """false: the loss skips each reply's think block (its tokens through `</think>`), so
    RL credits only the answer; for models whose thinking is a fixed routine learnt in SFT
    (the tic-tac-toe replies' list of empty cells), which RL's noisy per-move advantages
    would otherwise wear down"""
    negative_advantage_scale: float = 1.0
    """multiplies advantages below 0: 1 is the plain estimator; 0 learns only from moves
    that did better than their alternatives (filtered behaviour cloning, as RAFT/ReST do);
    in between damps the pushes down on sampled tokens (in the tic-tac-toe sweep neither
    made learning rates above 1e-4 stable for the tiny model: docs/mastery.md)"""
    unlikelihood_below: float = 0.0
    """0: a token with a negative advantage is pushed down by the policy gradient, whose
    pull on its logit is |A| * (1 - p) and so vanishes on a confident mistake. Above 0:
    such a token whose probability p is below this value gets the unlikelihood loss
    |A| * -log(1 - p) instead, whose pull is |A| * p (largest on confident mistakes).
    Tokens at or above it (a reply's fixed tags, p ~ 1) keep the policy gradient, so the
    format is not pushed down with the choice: e.g. 0.99. In the tic-tac-toe sweep it
    broke every run (a tag pushed below the threshold becomes a target too:
    docs/mastery.md, round 27)"""
    unlikelihood_ref_entropy: float = 0.0
    """with unlikelihood_below: only tokens where the starting model's sampling entropy
    was at least this many nats qualify (its decisions, e.g. the move digit after SFT on
    random moves, not the tags it always writes); loads the starting model as reference
    even with beta = 0. 0: every token below the probability threshold qualifies"""
    scale_rewards: bool = False
    """divide advantages by the group's reward std (original GRPO); not with dr_grpo"""
    clip_eps_low: float = 0.2
    """lower ratio clip: ratios below 1 - this stop pushing (grpo, dr_grpo)"""
    clip_eps_high: float = 0.28
    """upper ratio clip 1 + this (grpo, dr_grpo); for cispo the importance weight cap"""
    beta: float = 0.0
    """weight of the k3 KL penalty to the frozen starting model (0: no reference model)"""
    curriculum_steps: int = 0
    """0: every batch mixes all of the env's groups evenly. N > 0: the groups unlock one by
    one in `curriculum_order` over the first N steps (group k of the order from step
    1 + k * N / groups on), each batch dealt evenly over those unlocked so far"""
    curriculum_order: list = field(default_factory=list)
    """the env's group ids in the order a curriculum unlocks them, e.g. [3, 2, 1, 0] for
    tic-tac-toe's weakest opponents first (empty: 0, 1, 2, ...)"""
    entropy_coef: float = 0.0
    """weight of an entropy bonus: the loss subtracts this times the mean entropy of the
    sampling distribution at each trained token (weighed as the policy loss), so the
    policy does not commit to one answer before it has tried the others (0: none)"""
    decision_samples: int = 0
    """0: off. K >= 2: at each reply's decision token (the env's `decision_offset`:
    tic-tac-toe's move digit) K tokens are drawn from the policy's own distribution there,
    each scored by the env as the reply with that token in place of the sampled one
    (`score_decision`: the per-turn reward it would have earned in that position), and
    trained as a group: reward minus the group's mean, through the same loss. A group per
    decision, not only per prompt, at no extra forward pass (rlcore.train.decisions)"""
    decision_weight: float = 1.0
    """weight of a decision's K samples together in the loss sum (1: as much as one turn
    under turn aggregation)"""
    decision_temperature: float = 0.0
    """0: decision samples come from the sampling distribution (`temperature`). Above 0:
    from the policy at this temperature instead, e.g. 3 to explore answers the policy has
    all but ruled out; they are trained as if sampled at `temperature` (no importance
    weight), so a good answer found that way is pushed up in full"""
    decision_scale_rewards: bool = True
    """divide each decision group's advantages by its reward std (GRPO's scaling), so a
    rare good answer among K is pushed up as hard as a common one"""
    kl_scope: str = "all"
    """which tokens the KL penalty (beta) holds to the starting model: "all" the tokens the
    policy loss trains; "think" each reply's think block only, trained or not, so a
    reasoning routine learnt in SFT stays put while the answer after it learns freely
    (with train_think = false the think block then gets the KL term alone); "untrained"
    every reply token the policy loss leaves out (with train_scope "decision": all but the
    decision, so the format learnt in SFT is held while the choice learns)"""
    train_scope: str = "reply"
    """which reply tokens the policy loss trains: "reply" all of them (less the think block
    with train_think = false); "decision" only each reply's decision token (the env's
    `decision_offset`: tic-tac-toe's move digit; a reply without one is trained whole)"""
    num_iterations: int = 1
    """optimizer updates per batch of rollouts (> 1 makes the clip matter)"""
    micro_batch_size: int = 8
    """training sequences per forward pass (sorted by length to waste little padding)"""
    lr: float = 1e-5
    """peak learning rate (AdamW)"""
    lr_schedule: str = "constant"
    """decay after warm-up: cosine (to min_lr_ratio * lr) or constant"""
    warmup_steps: int = 0
    """optimizer updates of linear warm-up from 0 to lr"""
    min_lr_ratio: float = 0.1
    """final learning rate of the cosine decay, as a fraction of lr"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    adam_eps: float = 1e-8
    """AdamW's epsilon: a parameter whose gradient is far below it moves less than lr per
    step (1e-8 lets even tiny, noisy gradients take full-size steps)"""
    max_grad_norm: float = 1.0
    """clip the global gradient norm to this (0: no clipping)"""
    temperature: float = 1.0
    """sampling temperature; training logprobs use the same temperature"""
    top_p: float = 1.0
    """nucleus sampling during rollouts (1.0 keeps sampling on-policy)"""
    max_tokens: int = 128
    """reply length limit per turn, in tokens (also the dr_grpo length constant)"""
    concurrency: int = 256
    """rollouts in flight at once (the local engine batches them)"""
    save_every: int = 0
    """save a checkpoint every this many steps (0: only the final one)"""
    resume_from: str | None = None
    """a checkpoint directory of an earlier run of this config to continue from"""
    log_rollouts: int = 8
    """rollouts sent to the sink per step, spread over groups (0: none)"""

    def validate(self) -> None:
        errors = _common_errors(self)
        _check_positive(errors, self, "max_steps", "batch_size")
        _check_positive(errors, self, "num_iterations", "micro_batch_size", "max_tokens")
        _check_positive(errors, self, "concurrency")
        _check_optimizer(errors, self)
        if self.rollouts_per_example < 2:
            errors.append(
                f"rollouts_per_example must be at least 2 (advantages compare rollouts of "
                f"one example), got {self.rollouts_per_example!r}"
            )
        elif self.batch_size % self.rollouts_per_example:
            errors.append(
                f"batch_size ({self.batch_size}) must be a multiple of "
                f"rollouts_per_example ({self.rollouts_per_example})"
            )
        if self.loss_type not in LOSS_TYPES:
            errors.append(f"loss_type must be one of {list(LOSS_TYPES)}, got {self.loss_type!r}")
        if self.loss_aggregation not in LOSS_AGGREGATIONS:
            errors.append(
                f"loss_aggregation must be one of {list(LOSS_AGGREGATIONS)}, "
                f"got {self.loss_aggregation!r}"
            )
        if self.advantage not in ADVANTAGES:
            errors.append(f"advantage must be one of {list(ADVANTAGES)}, got {self.advantage!r}")
        if not 0.0 <= self.negative_advantage_scale <= 1.0:
            errors.append(
                f"negative_advantage_scale must be in [0, 1], got {self.negative_advantage_scale!r}"
            )
        if not self.turn_reward_weight >= 0.0:
            errors.append(f"turn_reward_weight must be >= 0, got {self.turn_reward_weight!r}")
        if self.advantage == "none" and not self.turn_reward_weight > 0:
            errors.append(
                "advantage='none' leaves nothing to learn from: set turn_reward_weight > 0"
            )
        if self.advantage == "tree" and self.scale_rewards:
            errors.append("scale_rewards=true applies to advantage='group' only")
        if self.loss_type == "dr_grpo" and self.scale_rewards:
            errors.append("scale_rewards=true contradicts loss_type='dr_grpo' (no std scaling)")
        if self.clip_eps_low < 0 or self.clip_eps_high < 0:
            errors.append(
                f"clip_eps_low and clip_eps_high must be >= 0, got "
                f"{self.clip_eps_low!r} and {self.clip_eps_high!r}"
            )
        if self.beta < 0:
            errors.append(f"beta must be >= 0, got {self.beta!r}")
        if self.curriculum_steps < 0:
            errors.append(f"curriculum_steps must be >= 0, got {self.curriculum_steps!r}")
        order = self.curriculum_order
        if not isinstance(order, list) or not all(
            isinstance(g, int) and not isinstance(g, bool) and g >= 0 for g in order
        ):
            errors.append(f"curriculum_order must be a list of group ids >= 0, got {order!r}")
        elif len(set(order)) != len(order):
            errors.append(f"curriculum_order lists a group twice: {order!r}")
        if not 0.0 <= self.unlikelihood_below < 1.0:
            errors.append(f"unlikelihood_below must be in [0, 1), got {self.unlikelihood_below!r}")
        if not self.unlikelihood_ref_entropy >= 0.0:
            errors.append(
                f"unlikelihood_ref_entropy must be >= 0, got {self.unlikelihood_ref_entropy!r}"
            )
        elif self.unlikelihood_ref_entropy > 0 and not self.unlikelihood_below > 0:
            errors.append("unlikelihood_ref_entropy needs unlikelihood_below > 0")
        if self.decision_samples == 1 or self.decision_samples < 0:
            errors.append(
                f"decision_samples must be 0 (off) or at least 2 (a group), got "
                f"{self.decision_samples!r}"
            )
        if not self.decision_temperature >= 0.0:
            errors.append(f"decision_temperature must be >= 0, got {self.decision_temperature!r}")
        if not self.decision_weight > 0.0:
            errors.append(f"decision_weight must be > 0, got {self.decision_weight!r}")
        if not self.entropy_coef >= 0.0:
            errors.append(f"entropy_coef must be >= 0, got {self.entropy_coef!r}")
        if self.train_scope not in TRAIN_SCOPES:
            errors.append(
                f"train_scope must be one of {list(TRAIN_SCOPES)}, got {self.train_scope!r}"
            )
        if self.kl_scope not in KL_SCOPES:
            errors.append(f"kl_scope must be one of {list(KL_SCOPES)}, got {self.kl_scope!r}")
        elif self.kl_scope != "all" and not self.beta > 0:
            errors.append(f"kl_scope={self.kl_scope!r} needs a KL penalty: set beta > 0")
        if self.temperature <= 0:
            errors.append(f"temperature must be > 0 for training, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            errors.append(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.log_rollouts < 0:
            errors.append(f"log_rollouts must be >= 0, got {self.log_rollouts!r}")
        _raise(self, errors)

    def to_dict(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------------------------------
# Validation helpers


def _common_errors(cfg) -> list[str]:
    errors = []
    if cfg.device not in DEVICES:
        errors.append(f"device must be one of {list(DEVICES)}, got {cfg.device!r}")
    if not str(cfg.output_dir).strip():
        errors.append("output_dir must not be empty")
    return errors


def _check_positive(errors: list[str], cfg, *names: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        if value < 1:
            errors.append(f"{name} must be at least 1, got {value!r}")


def _check_optimizer(errors: list[str], cfg) -> None:
    if cfg.lr <= 0:
        errors.append(f"lr must be > 0, got {cfg.lr!r}")
    if cfg.lr_schedule not in LR_SCHEDULES:
        errors.append(f"lr_schedule must be one of {list(LR_SCHEDULES)}, got {cfg.lr_schedule!r}")
    if cfg.warmup_steps < 0:
        errors.append(f"warmup_steps must be >= 0, got {cfg.warmup_steps!r}")
    if not 0 <= cfg.min_lr_ratio <= 1:
        errors.append(f"min_lr_ratio must be in [0, 1], got {cfg.min_lr_ratio!r}")
    if cfg.max_grad_norm < 0:
        errors.append(f"max_grad_norm must be >= 0, got {cfg.max_grad_norm!r}")
    if not cfg.adam_eps > 0:
        errors.append(f"adam_eps must be > 0, got {cfg.adam_eps!r}")
    if cfg.save_every < 0:
        errors.append(f"save_every must be >= 0, got {cfg.save_every!r}")


def _raise(cfg, errors: list[str]) -> None:
    if errors:
        raise ConfigError(f"{type(cfg).__name__}: " + "; ".join(errors))


# ---------------------------------------------------------------------------------------
# Loading

ConfigT = TypeVar("ConfigT")


def load_config(
    cls: type[ConfigT], toml_path: str | Path | None = None, overrides: list[str] | None = None
) -> ConfigT:
    """A validated `cls` from a TOML file (optional) with `key=value` overrides on top.

    Works for any config dataclass (also `rlcore.evaluate.EvalConfig`); `validate()` runs
    when the class has one."""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    if toml_path is not None:
        path = Path(toml_path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        try:
            values = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {str(path)!r} is not valid TOML: {exc}") from None
        sources = {key: f"{path}" for key in values}
    for override in overrides or []:
        key, value = _parse_override(override)
        head, _, rest = key.partition(".")
        if rest:
            table = values.setdefault(head, {})
            if not isinstance(table, dict):
                raise ConfigError(f"override {override!r}: {head!r} is not a table")
            table[rest] = value
        else:
            values[key] = value
        sources[head] = f"override {override!r}"

    hints = typing.get_type_hints(cls)
    valid = [f.name for f in fields(cls)]
    unknown = [key for key in values if key not in hints]
    if unknown:
        raise ConfigError(
            f"{cls.__name__}: unknown key(s) {', '.join(map(repr, unknown))} "
            f"(from {', '.join(sorted({sources.get(k, '?') for k in unknown}))}); "
            f"valid keys: {', '.join(valid)}",
            {key: f"unknown key {key!r}; valid keys: {', '.join(valid)}" for key in unknown},
        )
    kwargs, errors = {}, {}
    for key, value in values.items():
        try:
            kwargs[key] = _coerce(
                value, hints[key], f"{cls.__name__}.{key} (from {sources.get(key, '?')})"
            )
        except ConfigError as exc:
            errors[key] = str(exc)
            continue
        if error := bounds_error(key, kwargs[key]):
            errors[key] = f"{error} (from {sources.get(key, '?')})"
    if errors:
        raise ConfigError(f"{cls.__name__}: " + "; ".join(errors.values()), errors)
    try:
        cfg = cls(**kwargs)
    except TypeError as exc:  # a required field (EvalConfig's env, model) was not given
        raise ConfigError(f"{cls.__name__}: {exc}; valid keys: {', '.join(valid)}") from None
    if hasattr(cfg, "validate"):
        cfg.validate()
    return cfg


def _parse_override(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override {text!r} is not of the form key=value")
    try:
        return key, json.loads(raw)
    except json.JSONDecodeError:
        return key, raw


def _coerce(value: Any, annotation: Any, where: str) -> Any:
    """`value` as `annotation` (int, float, bool, str, list[str], dict, or X | None)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        (inner,) = [o for o in options if o is not type(None)]
        return _coerce(value, inner, where)
    if value is None:
        raise ConfigError(f"{where}: must not be null")
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer() and abs(value) < 2**63:
            return int(value)
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if annotation is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise ConfigError(f"{where}: expected a finite number, got {value!r}")
            return float(value)
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if annotation is str:
        if isinstance(value, str):
            return value
        if isinstance(value, int | float) and not isinstance(value, bool):
            return str(value)  # `model=123` is a name that happens to look like a number
        raise ConfigError(f"{where}: expected text, got {value!r}")
    if annotation is dict or origin is dict:
        if isinstance(value, dict):
            return dict(value)
        raise ConfigError(f"{where}: expected a table of key = value, got {value!r}")
    if origin is list:
        (item_type,) = typing.get_args(annotation)
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return [_coerce(item, item_type, where) for item in value]
    raise ConfigError(f"{where}: unsupported field type {annotation!r}")


def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string literal under it), for help texts and forms."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, following in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def config_schema(cls: type) -> list[dict]:
    """Name, type, default and help of every field, in declaration order."""
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    rows = []
    for f in fields(cls):
        if f.default is not MISSING:
            default = f.default
        elif f.default_factory is not MISSING:
            default = f.default_factory()
        else:
            default = None
        rows.append(
            {
                "name": f.name,
                "type": _type_name(hints[f.name]),
                "default": default,
                "help": docs.get(f.name, ""),
                "min": BOUNDS.get(f.name, (None, None))[0],
                "max": BOUNDS.get(f.name, (None, None))[1],
            }
        )
    return rows


def _type_name(annotation: Any) -> str:
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def save_config(cfg, output_dir: str | Path, name: str = "config.json") -> Path:
    """Write the resolved config as JSON into `output_dir` (created) and return the path."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    path.write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    return path
