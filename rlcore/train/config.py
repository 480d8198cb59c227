"""Run configurations for data generation, supervised fine-tuning and RL.

Each config is a dataclass with one docstring per field (CleanRL's `Args` style); the
settings that belong together are sections of their own, shared where they mean the same
thing: `optimizer` (SFT and RL), `sampling` and `loss` (RL). A config is built, checked
and filled with defaults in one place, `build_config`, from layers of plain dicts (a
recipe, a model's defaults, a form, overrides), and `load_config` adds the TOML file and
`key=value` override text of the CLI on top of it. Overrides are parsed as JSON when they
parse (`optimizer.lr=3e-4`, `exclude_outcomes=["loss"]`, `resume_from=null`) and kept as
text otherwise; a dotted key reaches into a section or table (`env_args.max_turns=6`), and
a section's setting may be named without its section (`lr=3e-4`) since no two sections
share a name. Every number is bounded in `BOUNDS` and every choice listed in `CHOICES`:
the web form and the JSON API read the same tables. Errors name the key (dotted), where
it came from and what is accepted. Every run writes its resolved config (`to_dict()`) as
`config.json` beside its outputs, so a job's settings travel with its results.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
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
PLACEMENTS = ("colocated", "split")

# The accepted values of every choice, by field name.
CHOICES: dict[str, tuple[str, ...]] = {
    "device": DEVICES,
    "lr_schedule": LR_SCHEDULES,
    "type": LOSS_TYPES,
    "aggregation": LOSS_AGGREGATIONS,
    "advantage": ADVANTAGES,
    "placement": PLACEMENTS,
}

# The range of every number a config takes, inclusive, by field name (a name means the
# same thing in every config class and section). A test makes sure no numeric field is
# left out: a bound that lives in one place cannot drift between form, API and CLI.
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
    "processes": (1, 64),
    "actors": (0, 64),
    "turn_reward_weight": (0.0, 1000.0),
    "sound_mass_weight": (0.0, 1000.0),
    "clip_eps_low": (0.0, 1.0),
    "clip_eps_high": (0.0, 100.0),
    "beta": (0.0, 100.0),
    "num_iterations": (1, 1000),
    "log_rollouts": (0, 1_048_576),
    "keep": (0, 10_000),
    "average": (0, 10_000),
}
# Numbers that must be strictly above their lower bound.
ABOVE_LOW = {"lr", "top_p", "adam_eps"}

# Settings that were removed after they lost their comparisons (docs/mastery.md has the
# record), with the value that meant "off": configs stored before carry them at that value
# and still load; any other value is an error that says so. A section's setting is dotted.
REMOVED = {
    "negative_advantage_scale": 1.0,
    "unlikelihood_below": 0.0,
    "unlikelihood_ref_entropy": 0.0,
    "entropy_coef": 0.0,
    "curriculum_steps": 0,
    "curriculum_order": [],
    "decision_samples": 0,
    "decision_weight": 1.0,
    "decision_temperature": 0.0,
    "decision_scale_rewards": True,
    "kl_scope": "all",
    "train_scope": "reply",
    "explore_rate": 0.0,
    "second_choice_replay": 0,
    "opponent_weight": 0.0,
    "second_choice_weight": 0.0,
    "turn_reward_agreed_credit": True,
    "select.exact": False,
}
# Settings that moved into a section under another name.
RENAMED = {"loss_type": "loss.type", "loss_aggregation": "loss.aggregation"}


class ConfigError(ValueError):
    """A config key or value that cannot be used; the message says what would be accepted.
    `errors` maps each bad key (dotted for a section's setting) to its message."""

    def __init__(self, message: str, errors: dict[str, str] | None = None):
        super().__init__(message)
        self.errors = errors or {}


# ---------------------------------------------------------------------------------------
# Sections


@dataclass
class OptimizerConfig:
    """AdamW with linear warm-up, then cosine or constant decay: the same for SFT and RL."""

    lr: float = 1e-4
    """peak learning rate"""
    lr_schedule: str = "cosine"
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


@dataclass
class SamplingConfig:
    """How the policy samples its rollouts."""

    temperature: float = 1.0
    """sampling temperature; training logprobs use the same temperature"""
    top_p: float = 1.0
    """nucleus sampling (1.0 keeps sampling on-policy)"""
    max_tokens: int = 128
    """reply length limit per turn, in tokens (also the dr_grpo length constant)"""
    concurrency: int = 256
    """rollouts in flight at once (the local engine batches them)"""


@dataclass
class LossConfig:
    """The policy loss: which objective, how tokens are weighed, what is trained."""

    type: str = "grpo"
    """grpo (clipped ratio), cispo (clipped stop-gradient importance weight times logprob),
    dr_grpo (clipped ratio, sum / (max_tokens * sequences): no length bias)"""
    aggregation: str = "token"
    """grpo and cispo: "token" averages over every completion token of the batch (a long
    rollout weighs more); "sequence" averages each rollout's tokens first, then over
    rollouts (original GRPO: every rollout weighs the same); "turn" averages each assistant
    turn's tokens, then over turns (every move weighs the same)"""
    clip_eps_low: float = 0.2
    """lower ratio clip: ratios below 1 - this stop pushing (grpo, dr_grpo)"""
    clip_eps_high: float = 0.28
    """upper ratio clip 1 + this (grpo, dr_grpo); for cispo the importance weight cap"""
    beta: float = 0.0
    """weight of the k3 KL penalty to the frozen starting model on the trained tokens (0: no
    reference model)"""
    train_think: bool = True
    """false: each reply's think block (its tokens through `</think>`) is left out of the
    loss, so RL trains the answer only; for a reasoning routine learnt in SFT that RL's noisy
    per-move advantages would otherwise wear down (docs/mastery.md, fourth session)"""


@dataclass
class SelectConfig:
    """Which save is the run's result: with `keep` > 1, the best of the last saves by the
    env's validation games (Environment.validation), played greedily on each; saves 25
    steps apart differ as much as seeds do (docs/mastery.md, twenty-seventh session)."""

    keep: int = 0
    """choose the result among the run's last this many saves (one every `save_every`
    steps, and the last step's), copied to `best/`; 0 or 1: the last step is the result"""
    num_examples: int = 500
    """validation games per set of the env's validation, per save"""
    seed: int = 20_000
    """example seed of the validation games: keep it apart from the run's own `seed` and
    from the held-out games you report"""
    average: int = 0
    """with `keep` > 1, one more candidate: the weights averaged (uniformly) over the run's
    last this many saves, played like the others (`average/` beside the saves); 0 or 1:
    none"""


# ---------------------------------------------------------------------------------------
# Run configs


@dataclass
class SynthConfig:
    """Generate an SFT dataset: play a teacher through an environment and keep the good
    rollouts."""

    env: str = "tictactoe"
    """environment name (see `python -m rlcore envs`)"""
    env_args: dict = field(default_factory=dict)
    """environment parameters, validated by the environment's schema"""
    model: str = "random"
    """teacher: an env built-in (`random`, `oracle`), `tiny`, `tiny-bpe`, `tiny-bpe-3l`,
    `tiny-master`, a checkpoint dir, a hub id, or a served model name when `base_url` is set"""
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
        check(self)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class SFTConfig:
    """Supervised fine-tuning of a causal LM on a JSONL conversation dataset, with the loss
    on assistant tokens only."""

    model: str = "tiny"
    """`tiny` (the built-in tiny model), `tiny-bpe` (the same with a tokenizer of 256 merges
    learned on tic-tac-toe games), `tiny-bpe-3l` (that one with 3 layers instead of 4),
    `tiny-master` (the shipped tic-tac-toe player), a checkpoint directory, or a Hugging Face
    hub id"""
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
    max_seq_len: int = 1024
    """truncate longer conversations to this many tokens (truncations are counted)"""
    save_every: int = 0
    """save a checkpoint every this many steps (0: only the final one)"""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """AdamW and its learning-rate schedule"""

    def cross_checks(self) -> dict[str, str]:
        if self.micro_batch_size > self.batch_size:
            return {
                "micro_batch_size": f"must not exceed batch_size ({self.batch_size}), got "
                f"{self.micro_batch_size}"
            }
        return {}

    def validate(self) -> None:
        check(self)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class RLConfig:
    """On-policy RL (GRPO family) of a local model on a multi-turn environment."""

    model: str = "tiny"
    """starting policy: `tiny`, `tiny-bpe`, `tiny-bpe-3l`, `tiny-master`, a checkpoint directory
    (e.g. the SFT run's final/), or a hub id"""
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
    placement: str = "colocated"
    """where generation runs: "colocated" samples rollouts from the trainer's own model
    (one GPU); "split" generates on cuda:0 and trains on cuda:1, copying the weights to
    the generation side after every optimizer step (needs two GPUs; on device cpu both
    sides are the CPU)"""
    processes: int = 1
    """processes that run each step side by side (data parallel): each rolls out its share
    of the step's examples with its own engine, scores them and trains on their sequences,
    and the gradients are summed over the processes, so the update is one step on the whole
    batch. On a GPU worker a step's host work (the games, the prompts, the engine's
    bookkeeping) then runs on that many CPU cores; more processes than GPUs share them
    (process r on GPU r mod the count), through NVIDIA MPS where the machine has it
    (distributed.share_card). A job on several GPUs runs at least one a GPU"""
    actors: int = 0
    """rollout actors: processes that play, score and build each step's batch with the
    newest weights the trainer published, while the trainer updates on the batches they
    finished before; a batch is then some steps behind the weights it trains (about this
    many at most; the loss's ratio is against the weights that played it). 0: every step
    rolls out and then trains, in order (rlcore/train/actors.py)"""
    max_steps: int = 100
    """optimizer steps (one batch of rollouts each)"""
    batch_size: int = 32
    """rollouts per step; batch_size / rollouts_per_example examples are drawn"""
    rollouts_per_example: int = 8
    """group size: rollouts of one example whose rewards are compared for advantages"""
    advantage: str = "group"
    """"group": each rollout's reward minus its group's mean, the same for all its turns
    (GRPO); "tree": per turn, the mean return of the group's rollouts that made the same
    move in the same position minus the mean of all that reached the position (credit to
    moves in multi-turn games; see advantages.tree_advantages); "none": no episode
    advantage, only the env's per-turn rewards (needs turn_reward_weight > 0)"""
    scale_rewards: bool = False
    """divide group advantages by the group's reward std (original GRPO); not with dr_grpo"""
    turn_reward_weight: float = 0.0
    """weight of the env's per-turn rewards (Environment.turn_rewards; tic-tac-toe: 1 for a
    move that keeps the game-theoretic value, 0 for one that gives some away or is
    invalid) in each turn's advantage, against a per-position baseline (see
    advantages.turn_reward_advantages). 0 trains on episode rewards alone"""
    sound_mass_weight: float = 0.0
    """at every move the env judges, every legal move of the position is judged, and the
    loss adds this weight times -log of the policy's probability (at the sampling
    temperature) of the moves judged best, per turn as the loss is normalized
    (Environment.move_options; see rlcore/train/sound_mass.py). 0: off"""
    num_iterations: int = 1
    """optimizer updates per batch of rollouts (> 1 makes the clip matter)"""
    micro_batch_size: int = 8
    """training sequences per forward pass: at most this many run as one token tree, each
    prefix they share once (on a GPU every pass; on the CPU the runs that share enough),
    the rest sorted by length to waste little padding (grpo.pass_batches)"""
    compile: bool = False
    """on CUDA, run the training pass (the model's forward, the logprobs, entropy and
    judged-move mass, and their backward) compiled (torch.compile, shapes dynamic): the
    update of 1,024 sequences 1.46x faster on an H100 (docs/BENCHMARKS.md), after a compile
    of about a minute at the run's first update (and again the first time a micro-batch
    without judged moves comes). For long runs; the CPU always runs it eagerly"""
    save_every: int = 0
    """save a checkpoint every this many steps (0: only the final one)"""
    resume_from: str | None = None
    """a checkpoint directory of an earlier run of this config to continue from"""
    log_rollouts: int = 256
    """rollouts stored per step for the inspector, spread over groups: every rollout of a
    batch up to this size (0: none)"""
    optimizer: OptimizerConfig = field(
        default_factory=lambda: OptimizerConfig(lr=1e-5, lr_schedule="constant")
    )
    """AdamW and its learning-rate schedule"""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """how rollouts are sampled"""
    loss: LossConfig = field(default_factory=LossConfig)
    """the policy loss"""
    select: SelectConfig = field(default_factory=SelectConfig)
    """which save is the run's result"""

    def cross_checks(self) -> dict[str, str]:
        errors = {}
        if self.rollouts_per_example < 2:
            errors["rollouts_per_example"] = (
                "must be at least 2 (advantages compare rollouts of one example), got "
                f"{self.rollouts_per_example}"
            )
        elif self.batch_size % self.rollouts_per_example:
            errors["batch_size"] = (
                f"must be a multiple of rollouts_per_example ({self.rollouts_per_example}), "
                f"got {self.batch_size}"
            )
        if self.advantage == "none" and not self.turn_reward_weight > 0:
            errors["advantage"] = '"none" leaves nothing to learn from: set turn_reward_weight > 0'
        if self.scale_rewards and self.advantage != "group":
            errors["scale_rewards"] = "applies to advantage 'group' only"
        elif self.scale_rewards and self.loss.type == "dr_grpo":
            errors["scale_rewards"] = "contradicts loss type dr_grpo (no std scaling)"
        if self.processes > 1 and self.placement != "colocated":
            errors["processes"] = (
                f"{self.processes} processes each sample from their own trainer's model; "
                f"placement {self.placement!r} runs in one process (set placement = 'colocated')"
            )
        elif self.actors and (self.processes > 1 or self.placement != "colocated"):
            errors["actors"] = (
                f"{self.actors} actors feed one trainer on one device: set processes = 1 and "
                f"placement = 'colocated' (got {self.processes} and {self.placement!r})"
            )
        elif self.batch_size // max(self.rollouts_per_example, 1) < self.processes:
            errors["processes"] = (
                f"each process rolls out at least one example: {self.processes} processes "
                f"need batch_size >= {self.processes} x rollouts_per_example, got "
                f"{self.batch_size} with groups of {self.rollouts_per_example}"
            )
        if self.select.keep > 1 and not self.save_every:
            errors["select.keep"] = (
                f"chooses among saves: set save_every (steps between saves), got keep "
                f"{self.select.keep} with save_every 0"
            )
        if self.select.average > 1 and self.select.keep < 2:
            errors["select.average"] = (
                f"is a candidate of the choice among saves: set select.keep above 1, got "
                f"average {self.select.average} with keep {self.select.keep}"
            )
        if not self.sampling.temperature > 0:
            errors["sampling.temperature"] = (
                f"must be > 0 for training (logprobs are taken at it), got {self.sampling.temperature}"
            )
        return errors

    def validate(self) -> None:
        check(self)

    def to_dict(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------------------------------
# Checking


def _sections(cls: type) -> dict[str, type]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in fields(cls) if dataclasses.is_dataclass(hints[f.name])}


def _leaf_errors(cfg, prefix: str = "") -> dict[str, str]:
    """Bounds and choices of every setting of `cfg` and its sections, by dotted key."""
    errors = {}
    for f in fields(cfg):
        value, key = getattr(cfg, f.name), prefix + f.name
        if dataclasses.is_dataclass(value):
            errors |= _leaf_errors(value, key + ".")
        elif f.name in CHOICES and value not in CHOICES[f.name]:
            errors[key] = f"must be one of {list(CHOICES[f.name])}, got {value!r}"
        elif f.name in BOUNDS and value is not None and not isinstance(value, bool):
            low, high = BOUNDS[f.name]
            if value != value or value < low or (f.name in ABOVE_LOW and value == low):
                errors[key] = (
                    f"must be {'above' if f.name in ABOVE_LOW else 'at least'} {low}, got {value!r}"
                )
            elif value > high:
                errors[key] = f"must be at most {high}, got {value!r}"
    return errors


def check(cfg) -> None:
    """Every setting within its bounds and choices, then the config's own cross-field
    rules; ConfigError naming each bad key otherwise. The one validation of a config."""
    errors = _leaf_errors(cfg)
    if hasattr(cfg, "output_dir") and not str(cfg.output_dir).strip():
        errors["output_dir"] = "must not be empty"
    if not errors and hasattr(cfg, "cross_checks"):
        errors = cfg.cross_checks()
    if errors:
        raise ConfigError(
            f"{type(cfg).__name__}: " + "; ".join(f"{k} {v}" for k, v in errors.items()), errors
        )


# ---------------------------------------------------------------------------------------
# Building

ConfigT = TypeVar("ConfigT")


def place_setting(cls: type, key: str) -> str:
    """The dotted path of `key` in `cls`: a section's setting named alone, or a renamed
    one, goes where it lives now; anything else stays as given."""
    if key in RENAMED:
        return RENAMED[key]
    names = {f.name for f in fields(cls)}
    head = key.split(".", 1)[0]
    if head in names:
        return key
    owners = [
        name
        for name, section in _sections(cls).items()
        if head in {f.name for f in fields(section)}
    ]
    return f"{owners[0]}.{key}" if len(owners) == 1 else key


def flatten_settings(values: dict, prefix: str = "") -> dict[str, Any]:
    """Nested settings as {dotted key: value}; tables that are values (env_args) stay whole."""
    flat = {}
    for key, value in values.items():
        if isinstance(value, dict) and key != "env_args":
            flat |= flatten_settings(value, f"{prefix}{key}.")
        else:
            flat[prefix + key] = value
    return flat


def _merge(values: dict, sources: dict, key: str, value: Any, source: str) -> None:
    """Set dotted `key` in the nested dict `values`, recording where it came from."""
    parts = key.split(".")
    table = values
    for depth, part in enumerate(parts[:-1]):
        table = table.setdefault(part, {})
        if not isinstance(table, dict):
            raise ConfigError(
                f"{key!r} (from {source}): {'.'.join(parts[: depth + 1])!r} is not a table",
                {key: "is not inside a table"},
            )
    if isinstance(value, dict) and isinstance(table.get(parts[-1]), dict):
        for inner, item in value.items():
            _merge(values, sources, f"{key}.{inner}", item, source)
        return
    table[parts[-1]] = copy.deepcopy(value)  # later layers must not change the caller's
    sources[key] = source


def build_config(cls: type[ConfigT], layers: list[tuple[str, dict]]) -> ConfigT:
    """A checked `cls` from `layers` of (source, settings), later layers winning; a
    section's or table's settings merge key by key. Works for any config dataclass
    (`rlcore.evaluate.EvalConfig` too)."""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    errors: dict[str, str] = {}
    for source, layer in layers:
        for key, value in layer.items():
            if _removed(key, value, source, errors):
                continue
            if isinstance(value, dict):  # a section's removed settings, e.g. select.exact
                value = {
                    inner: setting
                    for inner, setting in value.items()
                    if not _removed(f"{key}.{inner}", setting, source, errors)
                }
            _merge(values, sources, place_setting(cls, key), value, source)
    cfg = _construct(cls, values, sources, "", errors)
    if errors:
        raise ConfigError(
            f"{cls.__name__}: " + "; ".join(f"{k}: {v}" for k, v in errors.items()), errors
        )
    check(cfg)
    return cfg


def _removed(key: str, value: Any, source: str, errors: dict) -> bool:
    """Whether `key` is a removed setting (REMOVED), noting an error where its value is not
    the one that meant "off"."""
    if key not in REMOVED:
        return False
    if value != REMOVED[key]:
        errors[key] = (
            f"was removed after it lost its comparisons (docs/mastery.md); "
            f"got {value!r} (from {source})"
        )
    return True


def _construct(cls: type, values: dict, sources: dict, prefix: str, errors: dict) -> Any:
    hints = typing.get_type_hints(cls)
    by_name = {f.name: f for f in fields(cls)}
    kwargs = {}
    for key, value in values.items():
        where = prefix + key
        if key not in by_name:
            errors[where] = (
                f"unknown key {where!r} (from {sources.get(where, '?')}); "
                f"valid keys: {', '.join(_keys(cls, prefix))}"
            )
            continue
        annotation = hints[key]
        try:
            if dataclasses.is_dataclass(annotation):
                if not isinstance(value, dict):
                    raise ConfigError(f"expected a table of settings, got {value!r}")
                # Settings not given keep this config's own default for the section.
                given = asdict(by_name[key].default_factory()) | value
                kwargs[key] = _construct(annotation, given, sources, where + ".", errors)
            else:
                kwargs[key] = _coerce(value, annotation)
        except ConfigError as exc:
            errors[where] = f"{exc} (from {sources.get(where, '?')})"
    try:
        return cls(**kwargs)
    except TypeError as exc:  # a required field (EvalConfig's env, model) was not given
        errors[prefix or "config"] = f"{exc}; valid keys: {', '.join(_keys(cls, prefix))}"
        return None


def _keys(cls: type, prefix: str = "") -> list[str]:
    return [prefix + f.name for f in fields(cls)]


def load_config(
    cls: type[ConfigT],
    toml_path: str | Path | None = None,
    overrides: list[str] | None = None,
    *,
    values: dict | None = None,
) -> ConfigT:
    """A checked `cls` from a TOML file (optional), then `values` (a dict), then
    `key=value` override texts: `build_config` over those layers."""
    layers: list[tuple[str, dict]] = []
    if toml_path is not None:
        path = Path(toml_path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        try:
            layers.append((str(path), tomllib.loads(path.read_text())))
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {str(path)!r} is not valid TOML: {exc}") from None
    if values:
        layers.append(("settings", values))
    for override in overrides or []:
        key, value = _parse_override(override)
        layers.append((f"override {override!r}", {key: value}))
    return build_config(cls, layers)


def _parse_override(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override {text!r} is not of the form key=value")
    try:
        return key, json.loads(raw)
    except json.JSONDecodeError:
        return key, raw


def _coerce(value: Any, annotation: Any) -> Any:
    """`value` as `annotation` (int, float, bool, str, list[str], dict, or X | None)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        (inner,) = [o for o in options if o is not type(None)]
        return _coerce(value, inner)
    if value is None:
        raise ConfigError("must not be null")
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"expected true or false, got {value!r}")
    if annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer() and abs(value) < 2**63:
            return int(value)
        raise ConfigError(f"expected an integer, got {value!r}")
    if annotation is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise ConfigError(f"expected a finite number, got {value!r}")
            return float(value)
        raise ConfigError(f"expected a number, got {value!r}")
    if annotation is str:
        if isinstance(value, str):
            return value
        if isinstance(value, int | float) and not isinstance(value, bool):
            return str(value)  # `model=123` is a name that happens to look like a number
        raise ConfigError(f"expected text, got {value!r}")
    if annotation is dict or origin is dict:
        if isinstance(value, dict):
            return dict(value)
        raise ConfigError(f"expected a table of key = value, got {value!r}")
    if origin is list or annotation is list:
        (item_type,) = typing.get_args(annotation) or (str,)
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise ConfigError(f"expected a list, got {value!r}")
        return [_coerce(item, item_type) for item in value]
    raise ConfigError(f"unsupported field type {annotation!r}")


# ---------------------------------------------------------------------------------------
# Describing


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


def config_schema(cls: type, prefix: str = "", defaults: Any = None) -> list[dict]:
    """Every setting of `cls`, its sections' settings included under dotted names, in
    declaration order: name, type, default, help, min, max, choices."""
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    rows = []
    for f in fields(cls):
        if defaults is not None:
            default = getattr(defaults, f.name)
        elif f.default is not MISSING:
            default = f.default
        elif f.default_factory is not MISSING:
            default = f.default_factory()
        else:
            default = None
        annotation = hints[f.name]
        if dataclasses.is_dataclass(annotation):
            rows += config_schema(annotation, f"{prefix}{f.name}.", default)
            continue
        low, high = BOUNDS.get(f.name, (None, None))
        rows.append(
            {
                "name": prefix + f.name,
                "type": _type_name(annotation),
                "default": default,
                "help": docs.get(f.name, ""),
                "min": low,
                "max": high,
                "choices": list(CHOICES[f.name]) if f.name in CHOICES else None,
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
