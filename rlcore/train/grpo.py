"""On-policy RL of a local model on a multi-turn environment: the GRPO family.

One step, as `run_rl` does it from top to bottom:
1. draw `batch_size / rollouts_per_example` fresh examples, an even mix of the env's
   groups (`StratifiedSampler`);
2. play `rollouts_per_example` rollouts of each with a `LocalEngine` that shares the
   training model, so rollouts always sample the current weights (or, with placement
   "split", holds a copy on another GPU that gets the weights after every step);
3. score them (the env's rubric already did: `rollout.reward`) and turn rewards into
   advantages (`step_advantages`: GRPO's group baseline or per-move credit, plus the env's
   own per-move verdicts with `turn_reward_weight`);
4. build training sequences from each rollout's turns, with the token ids straight from
   generation, each token weighed in the loss's sum as `loss.aggregation` says
   (`training_sequences`), and with `sound_mass_weight` every judged move's position
   with the moves the env judges best there (`attach_move_sets`);
5. with several updates per batch or a KL term, recompute the old (and reference)
   logprobs in a no-grad pass; then `num_iterations` optimizer updates on `policy_loss`
   (grpo, cispo or dr_grpo), micro-batched with gradient accumulation;
6. log metrics and sample rollouts to the sink, save a checkpoint when due.

With rollout actors (`actors`, rlcore/train/actors.py) steps 1-4 run in actor processes,
each with weights a few steps old, while this process (the learner) does steps 5-6 on their
batches as they come, the engine's sampled logprobs taken as the old policy's.

In a data-parallel run (`processes`, rlcore/train/distributed.py) every rank does steps 1-5
on its share of the batch's examples, with the per-move rewards' batch mean, the loss's
normalizer, the gradients and metric sums added up over the ranks, so all take the step one
process would; for step 6 rank 0 gathers every rank's rollout figures, advantage sums and
its part of the logged sample (not the rollouts themselves), and alone saves.

A stop request (the sink's `should_stop`) is heard inside a step, not only between steps:
the engine abandons a generation between tokens, rollouts end before their next turn, and
the update stops between micro-batches. The step is then dropped whole, never stepped on
from a partial batch, and the state after the last complete step is saved. Checkpoints
hold everything a resumed run needs to continue exactly where this one was
(`rlcore.train.common`).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from rlcore.envs.base import Environment
from rlcore.envs.registry import load_environment
from rlcore.evaluate import figures_summary, rollout_figures, summary_metrics
from rlcore.events import EventSink, NullSink
from rlcore.policy.vllm_engine import rollout_engine, sync_weights
from rlcore.rollout import fewer_collections, frozen_heap, run_rollouts
from rlcore.train.actors import Board
from rlcore.train.advantages import (
    add_turn_advantages,
    group_advantages,
    tree_advantages,
    turn_reward_advantages,
)
from rlcore.train.common import (
    Milestones,
    autocast,
    build_optimizer,
    changed_settings,
    checkpoint_dir,
    clip_gradients,
    describe_device,
    load_model_and_tokenizer,
    load_trainer_state,
    model_path,
    random_states,
    resolve_device,
    restore_random_states,
    save_checkpoint,
    save_trainer_state,
    saves_after,
    seed_everything,
)
from rlcore.train.config import LossConfig, RLConfig, save_config
from rlcore.train.distributed import (
    check_followers,
    check_same_weights,
    copy_weights,
    current_ranks,
    generation_model,
    placement_devices,
)
from rlcore.train.sampling import StratifiedSampler, rollout_sample, sample_places
from rlcore.train.select import choose_save
from rlcore.train.sequences import (
    TokenTree,
    TrainingSequence,
    collate,
    forest_batches,
    micro_batches,
    move_set_rows,
    padded,
    target_rows,
    think_length,
    to_device,
    token_tree,
    trained_targets,
    training_sequences,
    tree_batches,
)
from rlcore.train.sound_mass import attach_move_sets
from rlcore.types import Rollout, SamplingParams, Turn

# Config fields a resumed run may change without changing what it computes.
# Data-parallel rank r seeds its sampling with seed + r x this (rank 0: the run's seed).
RANK_SEED_STRIDE = 1_000_003
RESUMABLE_CHANGES = {"resume_from", "max_steps", "output_dir", "save_every", "device", "log_rollouts", "placement", "processes", "actors", "select.keep", "select.num_examples", "select.seed", "select.average"}  # fmt: skip


# ---------------------------------------------------------------------------------------
# Advantages and the loss


def alone(sums: torch.Tensor) -> torch.Tensor:
    """Sums over the ranks of a run on one process: the sums themselves."""
    return sums


def step_sequences(
    env: Environment, rollouts: list[Rollout], cfg: RLConfig, tokenizer, pieces, total=alone
):
    """Steps 3 and 4 of a step: (training sequences, the loss normalizer, the sums of the
    advantage metrics). 3: advantages from the rubric's rewards (and the env's per-move
    verdicts; `total` as `step_advantages` takes it).
    4: training sequences, the sampled token ids, each token weighed in the loss, and with
    `sound_mass_weight` every judged move's best options (sound_mass.py). With the
    collector's first threshold raised, as for the rollouts: a large step's millions of
    token ids in lists made it collect over and over (bench/rl_host_overhead.py)."""
    aggregation = "token" if cfg.loss.type == "dr_grpo" else cfg.loss.aggregation
    with fewer_collections:
        turn_advantages, advantage_sums = step_advantages(env, rollouts, cfg, total)
        sequences = []
        judged, single = 0, {}
        for rollout, advantages in zip(rollouts, turn_advantages, strict=True):
            thinks = (
                None
                if cfg.loss.train_think
                else [think_length(t.completion_ids, pieces, tokenizer) for t in rollout.turns]
            )
            built = training_sequences(rollout, advantages, aggregation, thinks)
            if cfg.sound_mass_weight > 0:
                judged += attach_move_sets(env, rollout, built, tokenizer, pieces, single)
            sequences += built
        if cfg.sound_mass_weight > 0:
            advantage_sums["sound_mass_moves"] = judged
        normalizer = loss_normalizer(sequences, cfg.loss, cfg.sampling.max_tokens)
    return sequences, normalizer, advantage_sums


def for_log(rollout: Rollout) -> Rollout:
    """A rollout as a data-parallel rank sends it to rank 0 for step 6: without the token
    ids and logprobs its turns were trained on (most of its pickled size), keeping what
    the log, the summary and the advantage metrics read. A turn keeps its prompt ids only
    where the env names no position (`state_key`), since tree advantages key on them."""
    turns = [
        Turn(
            prompt_ids=[] if turn.state_key is not None else turn.prompt_ids,
            completion_ids=[],
            finish_reason=turn.finish_reason,
            state_key=turn.state_key,
        )
        for turn in rollout.turns
    ]
    return replace(rollout, turns=turns)


def step_advantages(
    env: Environment,
    rollouts: list[Rollout],
    cfg: RLConfig,
    total: Callable[[torch.Tensor], torch.Tensor] = alone,
):
    """Per-turn advantages of a batch (the episode advantage, `cfg.advantage`, plus
    `cfg.turn_reward_weight` times the env's per-move verdicts), and the sums their metrics
    are made of (`advantage_metrics`). In a data-parallel run `rollouts` is the rank's share
    and `total` adds a tensor up over the ranks (`Ranks.sum`): the per-move rewards' batch
    mean is the whole batch's, so every rank credits its moves as one process would."""
    group = cfg.rollouts_per_example
    if cfg.advantage == "tree":
        turns = tree_advantages(rollouts, group)
    elif cfg.advantage == "none":
        turns = [[0.0] * len(r.turns) for r in rollouts]
    else:
        rewards = torch.tensor([r.reward for r in rollouts], dtype=torch.float32)
        per_rollout = group_advantages(rewards, group, cfg.scale_rewards).tolist()
        turns = [[a] * len(r.turns) for r, a in zip(rollouts, per_rollout, strict=True)]
    sums = {}
    if cfg.turn_reward_weight > 0:
        verdicts = [env.turn_rewards(r) for r in rollouts]
        if any(v is None for v in verdicts):
            raise ValueError(
                f"turn_reward_weight={cfg.turn_reward_weight} but env {env.name!r} gave no "
                "per-turn rewards for some rollouts; set turn_reward_weight = 0 for this env"
            )
        flat_verdicts = [v for row in verdicts for v in row]
        summed, judged = total(
            torch.tensor([sum(flat_verdicts), len(flat_verdicts)], dtype=torch.float64)
        ).tolist()
        mean = summed / judged if judged else 0.0
        extra = turn_reward_advantages(rollouts, verdicts, group, batch_mean=mean)
        turns = add_turn_advantages(turns, extra, cfg.turn_reward_weight)
        sums |= {"turn_rewards": float(sum(flat_verdicts)), "judged_turns": len(flat_verdicts)}
    flat = [a for row in turns for a in row]
    rewards = torch.tensor([r.reward for r in rollouts]).view(-1, group)
    sums |= {
        "groups": rewards.shape[0],
        "zero_groups": int((rewards.std(dim=1) == 0).sum()),
        "turns": len(flat),
        "zero_turns": sum(1 for a in flat if a == 0),
        "abs_advantage": float(sum(abs(a) for a in flat)),
    }
    return turns, sums


def add_sums(parts: list[dict]) -> dict:
    """Dicts of sums added key by key (a key missing from a part counts 0 there)."""
    total: dict = {}
    for part in parts:
        for key, value in part.items():
            total[key] = total.get(key, 0) + value
    return total


def advantage_metrics(sums: dict) -> dict[str, float]:
    """The advantage metrics of a batch from `step_advantages`' sums, or from the sums of
    every data-parallel rank's share added key by key: the batch's whole, each group and
    each turn weighed once (groups never straddle ranks, so the sums are exact)."""
    metrics = {}
    if "judged_turns" in sums:
        metrics["reward/turn_mean"] = sums["turn_rewards"] / max(sums["judged_turns"], 1)
    turns = sums["turns"]
    metrics |= {
        "advantage/zero_group_rate": sums["zero_groups"] / max(sums["groups"], 1),
        "advantage/abs_mean": sums["abs_advantage"] / turns if turns else 0.0,
        "advantage/zero_turn_rate": sums["zero_turns"] / turns if turns else 1.0,
    }
    if "sound_mass_moves" in sums:
        metrics["sound_mass/moves"] = float(sums["sound_mass_moves"])
    return metrics


def loss_normalizer(sequences: list[TrainingSequence], loss: LossConfig, max_tokens: int) -> float:
    """What the summed loss of a whole batch is divided by: its trained tokens (token
    aggregation: a token-level mean), sequences (sequence: each sequence's own mean is
    summed), assistant turns (turn: each turn's own mean is summed), or the constant
    max_tokens * sequences (dr_grpo: no length bias)."""
    if loss.type == "dr_grpo":
        return float(max_tokens * len(sequences))
    if loss.aggregation == "sequence":
        return float(len(sequences))
    if loss.aggregation == "turn":
        return float(sum(s.turns for s in sequences))
    return float(sum(s.trained_tokens for s in sequences))


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    loss: LossConfig,
    normalizer: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of `loss.type` on per-token logprobs [sequences, tokens], each token
    weighed by `weights` (0: not trained) and the sum divided by `normalizer` (pass the
    whole batch's, so micro-batches accumulate to the batch's gradient).

    grpo, dr_grpo: -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A) per token.
    cispo: -stopgrad(min(ratio, 1 + eps_high)) * A * logprob, so every token keeps a
    gradient however far its ratio moved. With `loss.beta` > 0 and reference logprobs, the
    k3 estimate of KL(policy || reference) on the same tokens, weighed and divided alike,
    is added times beta. Returns the loss and sums for the step's metrics: `policy`,
    `total`, `kl` and `clipped` over `tokens` trained tokens, as 0-dim tensors on the
    loss's device (reading them would wait for the GPU: see `StepSums`)."""
    mask = weights > 0
    ratio = torch.exp(logprobs - old_logprobs)
    if loss.type == "cispo":
        per_token = -ratio.clamp(max=1 + loss.clip_eps_high).detach() * advantages * logprobs
        clipped = ratio > 1 + loss.clip_eps_high
    else:
        unclipped = ratio * advantages
        bounded = ratio.clamp(1 - loss.clip_eps_low, 1 + loss.clip_eps_high) * advantages
        per_token = -torch.minimum(unclipped, bounded)
        clipped = bounded < unclipped
    normalizer = max(float(normalizer), 1e-8)
    policy = (per_token * weights).sum() / normalizer
    total, kl_sum = policy, torch.zeros((), device=logprobs.device)
    if ref_logprobs is not None and loss.beta > 0:
        log_ratio = ref_logprobs - logprobs
        kl = torch.exp(log_ratio) - log_ratio - 1  # k3: unbiased, always >= 0
        total = policy + loss.beta * (kl * weights).sum() / normalizer
        kl_sum = (kl.detach() * mask).sum()
    stats = {
        "policy": policy.detach(),
        "total": total.detach(),
        "kl": kl_sum,
        "clipped": (clipped & mask).sum().float(),
        "tokens": mask.sum().float(),
    }
    return total, stats


# Causal LMs whose logits are their head on the body's last hidden states, nothing after
# (no softcap or scale): their training pass runs the head at the trained targets only.
PLAIN_HEAD_ARCHITECTURES = frozenset(
    {"Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM"}
)


def token_logprobs(
    model,
    input_ids,
    temperature: float,
    with_entropy=False,
    move_sets=None,
    tree=None,
    trained=None,
):
    """Logprob of every next token under softmax(logits / temperature), shape [B, T-1]
    (the distribution the engine sampled from), optionally its entropy, and with
    `move_sets` (sequences.move_set_rows) the log of the summed probability of each judged
    move's best options, shape [K] (else None). Gathering minus logsumexp avoids a second
    vocabulary-sized tensor for the log-softmax.

    `input_ids` are right-padded (`collate`), so no padding mask is passed: under the
    causal mask a sequence's tokens never see the padding after them, and without a mask
    attention runs as plain causal attention (flash kernels on a GPU, no [B, T, T] mask
    built), where the padding positions' own values are garbage no weight reads.

    With `tree` (sequences.token_tree) the pass runs over the rows' token trie instead, each
    shared prefix once, and every row's values are read from its prefixes' nodes: the same
    numbers, and the same gradient (a node's share flows back from every row through it).

    With `trained` (sequences.trained_targets: flat indices of the targets the loss reads)
    and a model of `PLAIN_HEAD_ARCHITECTURES`, the head and everything vocabulary-wide run at
    those targets and the judged moves' only (a tic-tac-toe game trains ~1 token in 14), and
    every other target's logprob and entropy is 0: the same numbers where the loss reads."""
    if trained is not None and type(model).__name__ in PLAIN_HEAD_ARCHITECTURES:
        return _trained_logprobs(
            model, input_ids, temperature, with_entropy, move_sets, tree, trained
        )
    logits = model(**pass_inputs(input_ids, tree)).logits
    logits = (logits[:, :-1] if tree is None else logits[0]).float() / temperature
    log_normalizer = torch.logsumexp(logits, dim=-1)
    targets = input_ids[:, 1:]
    if tree is None:
        logprobs = logits.gather(-1, targets[..., None]).squeeze(-1) - log_normalizer
    else:
        logprobs = logits[tree.nodes, targets] - log_normalizer[tree.nodes]
    entropy = None
    if with_entropy:
        entropy = log_normalizer - (torch.softmax(logits, dim=-1) * logits).sum(-1)
        entropy = entropy if tree is None else entropy[tree.nodes]
    best = None
    if move_sets is not None:
        rows, at, members = move_sets
        where = (rows, at) if tree is None else (tree.nodes[rows, at],)
        best = judged_mass(logits[where], log_normalizer[where], members)
    return logprobs, entropy, best


def judged_mass(logits, log_normalizer, members):
    """The log of the summed probability of each judged move's best options (`members`,
    padded with -1), from the logits at its position and their logsumexp."""
    picked = logits.gather(-1, members.clamp(min=0)).masked_fill(members < 0, float("-inf"))
    return torch.logsumexp(picked, dim=-1) - log_normalizer


def pass_inputs(input_ids, tree) -> dict:
    """The model's inputs for a training pass: the right-padded rows, or the token tree's
    nodes with their positions and mask."""
    if tree is None:
        return {"input_ids": input_ids, "use_cache": False}
    return {
        "input_ids": tree.input_ids,
        "position_ids": tree.positions,
        "attention_mask": tree.mask,
        "use_cache": False,
    }


def _trained_logprobs(model, input_ids, temperature, with_entropy, move_sets, tree, trained):
    """`token_logprobs` with the head at the `trained` targets and the judged moves only."""
    rows, width = input_ids.shape
    hidden = model.model(**pass_inputs(input_ids, tree)).last_hidden_state
    hidden = hidden.reshape(-1, hidden.shape[-1])
    # Target t of a row is predicted by its position t (row * width + t in the flat states),
    # or in a tree by the node of that position.
    at = trained + trained // (width - 1) if tree is None else tree.nodes.reshape(-1)[trained]

    def head(where):
        logits = model.lm_head(hidden[where]).float() / temperature
        return logits, torch.logsumexp(logits, dim=-1)

    logits, log_normalizer = head(at)
    targets = input_ids[:, 1:].reshape(-1)[trained]
    picked = logits.gather(-1, targets[:, None]).squeeze(-1) - log_normalizer
    shape = (rows, width - 1)
    logprobs = picked.new_zeros(rows * (width - 1)).index_put((trained,), picked).view(shape)
    entropy = None
    if with_entropy:
        spread = log_normalizer - (torch.softmax(logits, dim=-1) * logits).sum(-1)
        entropy = spread.new_zeros(rows * (width - 1)).index_put((trained,), spread).view(shape)
    best = None
    if move_sets is not None:
        move_rows, move_at, members = move_sets
        where = move_rows * width + move_at if tree is None else tree.nodes[move_rows, move_at]
        best = judged_mass(*head(where), members)
    return logprobs, entropy, best


@functools.cache
def compiled_token_logprobs():
    """`token_logprobs` compiled once per process for every shape (the batch's rows and width
    vary from step to step); a graph each for with or without entropy and judged moves."""
    import torch._inductor.config as inductor

    # Inductor's padding breaks on these dynamic shapes (torch 2.11, H100): padding the
    # vocabulary's 404 to 408 (the matmul's `shape_padding` as well as `comprehensive_padding`)
    # fixed the logits' row stride at the first batch's width, and the next width failed its
    # stride check (a 1,024-game step with actors, thirty-ninth and fortieth sessions); its
    # coalescing analysis fails an assertion. Without them the kernels are the same but for
    # their layout and tiling.
    options = {"comprehensive_padding": False, "shape_padding": False}
    if hasattr(inductor.triton, "coalesce_tiling_analysis"):
        options["triton.coalesce_tiling_analysis"] = False
    return torch.compile(token_logprobs, dynamic=True, options=options)


def training_pass(cfg: RLConfig, device: torch.device):
    """The update's pass: `token_logprobs`, compiled where `cfg.compile` asks for it on CUDA."""
    return compiled_token_logprobs() if cfg.compile and device.type == "cuda" else token_logprobs


# ---------------------------------------------------------------------------------------
# The two passes over a batch of sequences


@dataclass
class Learner:
    """The model being trained and what its passes need."""

    model: torch.nn.Module
    reference: torch.nn.Module | None  # the frozen starting model, for the KL term
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    pad_id: int
    device: torch.device
    should_stop: Callable[[], bool]


class StepStopped(Exception):
    """A stop request heard between micro-batches, before the step's first optimizer
    update: the step is to be dropped."""

    def __init__(self, where: str):
        super().__init__(where)
        self.where = where


class StepSums:
    """Metric sums of one step, kept on the device while its micro-batches run: reading a
    GPU value makes the host wait for all the work queued before it, so a read per
    micro-batch would stall the loop on every one. `to_host` copies them all at once,
    after the step. In a data-parallel run the sums are added up over the ranks (the
    gradient norm, alike on every rank, is kept as it is)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.sums: dict[str, torch.Tensor] = {}

    def add(self, stats: dict[str, torch.Tensor]) -> None:
        for key, value in stats.items():
            previous = self.sums.get(key)
            self.sums[key] = value.detach() if previous is None else previous + value.detach()

    def to_host(self) -> Counter:
        sums = current_ranks().sum_dict(self.sums, alike={"grad_norm"})
        keys = list(sums)
        if not keys:
            return Counter()
        values = torch.stack([sums[key].to(self.device, torch.float64) for key in keys])
        return Counter(dict(zip(keys, values.tolist(), strict=True)))


def attention_keys_per_token(model) -> float:
    """How many keys a token's attention scores for the cost of its pass through the
    weights: the weights' multiply-adds a token (one a parameter) over the attention's a key
    (the query's score and the value's share, 2 x hidden size, in every layer)."""
    config = model.config
    weights = sum(parameter.numel() for parameter in model.parameters())
    return weights / (2 * config.hidden_size * config.num_hidden_layers)


# The most nodes a GPU pass's token tree holds: its dense mask is nodes^2 (64 MiB of bools
# here), and attention over it grows as that square while the rest of the pass grows with
# the nodes.
GPU_TREE_NODES = 8192


def pass_batches(
    learner: Learner, sequences: list[TrainingSequence], size: int, trees: bool = True
) -> list[tuple[list[TrainingSequence], TokenTree | None]]:
    """The micro-batches of a pass over `sequences`, each with its token tree or None (the
    plain pass). Sequences that share prefixes (a group's prompt, and its games' common
    moves) run as token trees, each shared prefix once: from a random-valid SFT policy a
    step's trees hold 45 % of its tokens, from `tiny-master` 15 %.
    - On the CPU, where the update is most of a step and FLOP-bound on its tokens, the runs
      are the cheapest by tokens and the dense mask's attention (sequences.tree_batches);
      a sequence that shares nothing runs in a plain micro-batch.
    - On a GPU, where a pass costs about its launches and its tokens, runs of `size`
      sequences in token order, each one tree where its trie holds at most GPU_TREE_NODES
      nodes (sequences.forest_batches): about as many passes as plain micro-batches, neither
      shared prefixes nor padding computed more than once.
    Elsewhere, without `trees` (the compiled pass, measured on plain batches only), and for
    attention that takes no boolean mask (only SDPA's does), every micro-batch is plain,
    sorted by length."""
    model, kind = learner.model, learner.device.type
    if not trees or model.config._attn_implementation != "sdpa" or kind not in ("cpu", "cuda"):
        return [(chunk, None) for chunk in micro_batches(sequences, size)]
    if kind == "cuda":
        planned = forest_batches(sequences, size, GPU_TREE_NODES)
    else:
        planned = tree_batches(sequences, size, attention_keys_per_token(model))
    return [
        (chunk, token_tree(chunk, learner.device) if as_tree else None)
        for chunk, as_tree in planned
    ]


def sampling_stats(chunk, old, entropy, weights) -> dict[str, torch.Tensor]:
    """Entropy of the trained tokens and their gap to the logprobs the engine sampled with
    (rows without sampled logprobs, e.g. from an endpoint, count for entropy only)."""
    mask = weights > 0
    sampled_at = [s.sampled_logprobs or [0.0] * len(s.input_ids) for s in chunk]
    sampled = target_rows(sampled_at, old.shape[1], old.device)
    has_sampled = to_device(
        torch.tensor([s.sampled_logprobs is not None for s in chunk]), old.device
    )
    compared = mask & has_sampled[:, None]
    return {
        "entropy": (entropy.detach() * mask).sum(),
        "entropy_tokens": mask.sum().float(),
        "mismatch": ((old.detach().float() - sampled).abs() * compared).sum(),
        "mismatch_tokens": compared.sum().float(),
    }


def _sampling_metrics(sums: Counter) -> dict[str, float]:
    return {
        "policy/entropy": sums["entropy"] / max(sums["entropy_tokens"], 1.0),
        "policy/logprob_mismatch": sums["mismatch"] / max(sums["mismatch_tokens"], 1.0),
    }


@torch.no_grad()
def score_sequences(learner: Learner, sequences, cfg: RLConfig) -> dict:
    """Fill each sequence's old (and reference) logprobs with one no-grad pass; they stay
    on the device, where the updates read them."""
    sums = StepSums(learner.device)
    temperature = cfg.sampling.temperature
    passes = pass_batches(learner, sequences, cfg.micro_batch_size)
    for index, (chunk, tree) in enumerate(passes):
        if learner.should_stop():
            raise StepStopped(f"scoring: micro-batch {index + 1} of {len(passes)} not run")
        input_ids, _, weights, _ = collate(chunk, learner.pad_id, learner.device)
        trained = trained_targets(chunk, input_ids.shape[1], learner.device)
        with autocast(learner.device):
            old, entropy, _ = token_logprobs(
                learner.model, input_ids, temperature, True, tree=tree, trained=trained
            )
            ref = None
            if learner.reference is not None:
                ref, *_ = token_logprobs(
                    learner.reference, input_ids, temperature, tree=tree, trained=trained
                )
        sums.add(sampling_stats(chunk, old, entropy, weights))
        for row, sequence in enumerate(chunk):
            length = len(sequence.input_ids) - 1
            sequence.old_logprobs = old[row, :length]
            if ref is not None:
                sequence.ref_logprobs = ref[row, :length]
    return _sampling_metrics(sums.to_host())


def update_policy(learner: Learner, sequences, normalizer: float, cfg: RLConfig) -> dict:
    """`cfg.num_iterations` optimizer updates on the batch, each accumulating the gradient
    of `policy_loss` over length-sorted micro-batches; returns the step's loss metrics.
    The old policy is the current one (one update: ratio exactly 1) or the no-grad pass's;
    with rollout actors it is the one that played the batch (its sampled logprobs).
    StepStopped between the first update's micro-batches when a stop is requested (the
    partial gradient is left for the caller to drop, never stepped on). Once the first
    update is taken the step's weights are neither the old nor the new ones, so the rest of
    its updates run to the end: the stop is heard before the next step, and the completed
    step is saved (a stop there used to drop a run's every step since its last save). The
    micro-batches go to the device before the first update, and the metrics stay there
    until the step ends, so on a GPU the loop only queues work and never waits for it."""
    with_reference = learner.reference is not None
    # A sequence without advantage or judged move adds no gradient, so without a KL term it is
    # skipped; its tokens still count in `normalizer`, so the loss is the full batch's.
    trainable = [s for s in sequences if with_reference or s.has_gradient]
    # With one update and no reference the old logprobs are the current ones: taken from
    # this very pass (ratio exactly 1), with entropy and mismatch measured here.
    single_pass = cfg.num_iterations == 1 and not with_reference
    sums = StepSums(learner.device)
    forward = training_pass(cfg, learner.device)
    passes = pass_batches(learner, trainable, cfg.micro_batch_size, forward is token_logprobs)
    chunks = [chunk for chunk, _ in passes]
    batches = [collate(chunk, learner.pad_id, learner.device) for chunk in chunks]
    move_sets = [move_set_rows(chunk, learner.device) for chunk in chunks]
    targets = [
        trained_targets(chunk, batch[0].shape[1], learner.device)
        for chunk, batch in zip(chunks, batches, strict=True)
    ]
    for iteration in range(cfg.num_iterations):
        for index, ((chunk, tree), batch, sets, trained) in enumerate(
            zip(passes, batches, move_sets, targets, strict=True)
        ):
            if iteration == 0 and learner.should_stop():
                raise StepStopped(f"update 1: micro-batch {index + 1} of {len(chunks)} not run")
            input_ids, _, weights, advantages = batch
            with autocast(learner.device):
                logprobs, entropy, best = forward(
                    learner.model,
                    input_ids,
                    cfg.sampling.temperature,
                    single_pass,
                    sets,
                    tree,
                    trained,
                )
            width, device = weights.shape[1], learner.device
            if single_pass:
                old = logprobs.detach()
                sums.add(sampling_stats(chunk, old, entropy, weights))
            else:
                old = padded([s.old_logprobs for s in chunk], width, device)
            if cfg.actors:  # played by older weights: the ratio is against those
                old = target_rows([s.sampled_logprobs for s in chunk], width, device)
            ref = padded([s.ref_logprobs for s in chunk], width, device) if with_reference else None
            loss, stats = policy_loss(logprobs, old, ref, advantages, weights, cfg.loss, normalizer)
            if best is not None:  # -log P(best moves), summed and normalized as the loss is
                mass_loss = -cfg.sound_mass_weight * best.sum() / max(normalizer, 1e-8)
                loss = loss + mass_loss
                stats |= {
                    "total": stats["total"] + mass_loss.detach(),
                    "best_mass": best.detach().exp().sum(),
                    "judged": best.new_tensor(float(len(best))),
                }
            loss.backward()
            sums.add(stats)
        current_ranks().sum_gradients(learner.model)  # data-parallel: every rank's share
        sums.add({"grad_norm": clip_gradients(learner.model, cfg.optimizer.max_grad_norm)})
        lr = learner.scheduler.get_last_lr()[0]
        learner.optimizer.step()  # with nothing trainable no parameter has a gradient
        learner.scheduler.step()
        learner.optimizer.zero_grad(set_to_none=True)
    host = sums.to_host()
    tokens = max(host["tokens"], 1.0)
    metrics = _sampling_metrics(host) if single_pass else {}
    if host.get("judged"):
        metrics["sound_mass/mean"] = host["best_mass"] / host["judged"]
    return metrics | {
        "loss/policy": host["policy"] / cfg.num_iterations,
        "loss/total": host["total"] / cfg.num_iterations,
        "loss/kl": host["kl"] / tokens,
        "policy/clip_fraction": host["clipped"] / tokens,
        "optim/grad_norm": host["grad_norm"] / cfg.num_iterations,
        "optim/lr": lr,
    }


def learn(learner: Learner, sequences, normalizer: float, cfg: RLConfig) -> dict:
    """Step 5 on a batch: old and reference logprobs when several updates or a KL term
    need them, then the updates; their metrics."""
    scored = {}
    if cfg.num_iterations > 1 or learner.reference is not None:
        scored = score_sequences(learner, sequences, cfg)
    return scored | update_policy(learner, sequences, normalizer, cfg)


# ---------------------------------------------------------------------------------------
# The training loop


def build_learner(cfg: RLConfig, device: torch.device, should_stop: Callable[[], bool]):
    """The learner of `cfg` on `device` (policy, optional frozen reference, optimizer and
    schedule, restored from `cfg.resume_from` when set), its tokenizer, and the resumed
    trainer state (None for a fresh run)."""
    model, tokenizer = load_model_and_tokenizer(cfg.resume_from or cfg.model, device)
    model.eval()  # no dropout: the importance ratio must be exactly 1 before an update
    reference = None
    if cfg.loss.beta > 0:
        reference, _ = load_model_and_tokenizer(cfg.model, device)
        reference.eval().requires_grad_(False)
    optimizer, scheduler = build_optimizer(model, cfg.optimizer, cfg.max_steps * cfg.num_iterations)
    state = None
    if cfg.resume_from:
        state = load_trainer_state(cfg.resume_from)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
    learner = Learner(
        model, reference, optimizer, scheduler, tokenizer.pad_token_id, device, should_stop
    )
    return learner, tokenizer, state


def run_rl(
    cfg: RLConfig, sink: EventSink | None = None, *, engine: str = "local", board: str = ""
) -> str:
    """Train `cfg.model` with RL on `cfg.env`; returns the final checkpoint directory, or
    on a stop request the checkpoint saved then.
    `engine`: what samples the rollouts, "local" (the batching engine on the trainer's own
    model) or "vllm" (vLLM in this process, the trainer's weights loaded into it after every
    update; the local engine, with a warning in the log, where vLLM cannot run).
    `board`: with `cfg.actors`, where this learner sets up the board its actors wait for
    (`distributed.run_rl_ranks` starts them)."""
    sink = sink or NullSink()
    cfg.validate()
    if cfg.actors and not board:
        raise ValueError(
            f"actors={cfg.actors}: the actors are started by rlcore.train.distributed."
            "run_rl_ranks (the CLI, the worker and the benchmarks run it); run_rl alone "
            "runs without them (set actors = 0)"
        )
    ranks = current_ranks()  # one rank unless launched data-parallel
    device, generation_device = placement_devices(
        cfg.placement, ranks.device(resolve_device(cfg.device))
    )
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # a rank's GPU: the engine's graphs and streams use it
    # Ranks draw the same examples (the sampler's own seed) but sample their own replies.
    seed_everything(cfg.seed + RANK_SEED_STRIDE * ranks.rank)
    output_dir = Path(cfg.output_dir)
    if ranks.is_main:
        save_config(cfg, output_dir)

    # Environment, policy model, optional frozen reference, optimizer, example stream.
    env = load_environment(cfg.env, **cfg.env_args)
    env.output_dir = str(output_dir)
    if cfg.turn_reward_weight > 0 and type(env).turn_rewards is Environment.turn_rewards:
        raise ValueError(
            f"turn_reward_weight={cfg.turn_reward_weight} needs an env with per-turn rewards; "
            f"{env.name!r} judges whole episodes only (set turn_reward_weight = 0)"
        )
    if cfg.sound_mass_weight > 0 and type(env).move_options is Environment.move_options:
        raise ValueError(
            f"sound_mass_weight={cfg.sound_mass_weight} needs an env that judges moves one by "
            f"one (Environment.move_options); {env.name!r} does not (set sound_mass_weight = 0)"
        )
    # Ranks must run an update's collectives together: only one process hears a stop
    # between its micro-batches.
    learner, tokenizer, state = build_learner(cfg, device, ranks.inside_step(sink.should_stop))
    model, optimizer, scheduler = learner.model, learner.optimizer, learner.scheduler
    generator = generation_model(model, cfg.placement, generation_device)
    sampler = StratifiedSampler(env, cfg.seed, cfg.batch_size // cfg.rollouts_per_example)
    rollouts_engine = None  # with actors, they generate
    if not cfg.actors:
        rollouts_engine, _ = rollout_engine(
            engine,
            model=generator,
            tokenizer=tokenizer,
            path=model_path(cfg.resume_from or cfg.model),
            should_stop=sink.should_stop,
            warn=lambda message: sink.log(f"rl: {message}", "warning"),
            gpu_sharers=ranks.sharing(generation_device),
        )
    sampling = SamplingParams(
        temperature=cfg.sampling.temperature,
        top_p=cfg.sampling.top_p,
        max_tokens=cfg.sampling.max_tokens,
    )
    start_step, last_saved = 0, cfg.resume_from
    if state is not None:
        if changed := changed_settings(cfg.resume_from, cfg, RESUMABLE_CHANGES):
            sink.log(f"rl: resuming with changed settings {changed}", "warning")
        sampler.load_state_dict(state["sampler"])
        restore_random_states(state["random"])
        start_step = state["step"]
        if not ranks.is_main:  # rank 0's saved streams, then this rank's own
            seed_everything(cfg.seed + RANK_SEED_STRIDE * ranks.rank + start_step)
        sink.log(f"rl: resumed from {cfg.resume_from} at step {start_step}")
    actors = Board.create(board, cfg.actors, model, start_step) if cfg.actors else None
    sink.log(
        f"rl: {cfg.loss.type} on {env.name}, {sampler.examples_per_step} examples x "
        f"{cfg.rollouts_per_example} rollouts per step, steps {start_step + 1}..{cfg.max_steps}, "
        f"training on {describe_device(device)}"
        + (
            f", generating on {describe_device(generation_device)}"
            if cfg.placement == "split"
            else ""
        )
        + (
            f", {ranks.world_size} data-parallel ranks each rolling out and training its share"
            if ranks.parallel
            else ""
        )
        + (f", {cfg.actors} actor processes rolling out" if cfg.actors else "")
    )

    def checkpoint(step: int, path: Path, start: tuple[dict, dict] | None = None) -> str:
        """Save the run after `step`; `start` (sampler and random states) stands in for the
        current ones when the step after it was begun and then dropped. Rank 0 saves; the
        other ranks hold the same weights."""
        nonlocal last_saved
        if not ranks.is_main:
            return ""
        sampler_state, random_state = start or (sampler.state_dict(), random_states())
        last_saved = save_checkpoint(model, tokenizer, cfg, path)
        save_trainer_state(path, step, optimizer, scheduler, sampler_state, random_state)
        sink.checkpoint(step, last_saved)
        return last_saved

    def stop(step: int, where: str, start=None) -> str:
        """End the run on a stop request heard in `step`, before its first update (later
        updates of a step run to its end): the weights are those after step - 1, and that
        state is saved with the sampler and random states the step began from, so a
        resumed run plays the dropped step exactly."""
        optimizer.zero_grad(set_to_none=True)
        path = checkpoint(step - 1, checkpoint_dir(output_dir, step - 1), start)
        if not ranks.is_main:
            return path
        sink.log(
            f"rl: stopped on request inside step {step} ({where}); saved the state after step "
            f"{step - 1}: {path}",
            "warning",
        )
        return path

    milestones = Milestones(
        sink, "rl", start_step + 1, cfg.max_steps, ["reward/mean", "outcome/*", "loss/policy"]
    )
    outcome_labels: set[str] = set()  # every label seen so far, reported even at rate 0
    pieces: dict[int, str] = {}  # token id -> text, for think_length
    loop = asyncio.new_event_loop()  # one loop for the run: the engine keeps its queue on it
    stop_asked = ranks.agreed(sink.should_stop)  # rank 0's answer on every rank
    check_same_weights(model, "rl", "at the start", sink)
    frozen_heap.freeze()  # the setup's objects out of the steps' full collections
    try:
        for step in range(start_step + 1, cfg.max_steps + 1):
            if stop_asked():
                return stop(step, "before it began")
            step_started = time.monotonic()
            start = (sampler.state_dict(), random_states())  # saved instead if it is dropped

            if actors:
                # 1-4. The next batch an actor finished: rolled out, scored and turned
                #      into training sequences by weights `taken.version` steps old.
                taken = actors.take(step, sink.should_stop, check_followers)
                if taken is None:
                    return stop(step, "waiting for the actors' next batch", start)
                sequences, normalizer = taken.sequences, taken.normalizer
                advantage_sums, rollout_seconds = taken.advantage_sums, taken.rollout_seconds
                train_started = scored = time.monotonic()
            else:
                # 1-2. A stratified batch of examples, each rolled out as a group (in a
                #      data-parallel run, each rank its share of the examples).
                batch = sampler.next_batch()
                examples = ranks.deal(batch)
                rollouts = loop.run_until_complete(
                    run_rollouts(
                        env,
                        rollouts_engine,
                        examples,
                        sampling=sampling,
                        rollouts_per_example=cfg.rollouts_per_example,
                        concurrency=cfg.sampling.concurrency,
                        should_stop=sink.should_stop,
                    )
                )
                wanted = len(examples) * cfg.rollouts_per_example
                if not ranks.every(len(rollouts) == wanted):
                    return stop(step, f"rollouts: {len(rollouts)} of {wanted} finished", start)
                if step == start_step + 1:  # the rollout reads the weights, never writes them
                    check_same_weights(model, "rl", f"after step {step}'s rollout", sink)
                rollout_seconds = time.monotonic() - step_started
                train_started = time.monotonic()

                # 3-4. Advantages, and the training sequences they weigh.
                sequences, normalizer, advantage_sums = step_sequences(
                    env, rollouts, cfg, tokenizer, pieces, ranks.sum
                )
                scored = time.monotonic()

            # 5. Old and reference logprobs when several updates or a KL term need them,
            #    then the updates, the loss over the whole batch's normalizer; a stop
            #    request before the first update is taken drops the step.
            try:
                normalizer = float(ranks.sum(torch.tensor(normalizer, dtype=torch.float64)))
                update_started = time.monotonic()  # the sum waits for the ranks' scoring
                trained = learn(learner, sequences, normalizer, cfg)
                if actors:
                    actors.publish(model, step)  # for the actors' next batches
                else:
                    copy_weights(model, generator)  # split placement: the engine's copy
                    sync_weights(rollouts_engine, model)  # vLLM samples the updated weights
            except StepStopped as stopped:
                return stop(step, stopped.where, start)
            updated = time.monotonic()
            if step == start_step + 1 or saves_after(step, cfg.save_every, cfg.max_steps):
                check_same_weights(model, "rl", f"after step {step}", sink)
            group = cfg.rollouts_per_example
            if actors:
                figures, logged, tokens = taken.figures, taken.logged, taken.tokens
            else:
                tokens = sum(len(s.input_ids) for s in sequences)
                figures = [rollout_figures(env, r) for r in rollouts]
            if ranks.parallel:
                # Rank 0 logs the whole batch from what every rank sends it: its rollouts'
                # figures, its advantage sums, and the rollouts of its share that the log's
                # sample takes (`rollout_sample` over the ranks' shares in rank order).
                places = sample_places(ranks.rank, ranks.world_size, len(batch), group)
                sampled = [
                    (place, for_log(r))
                    for place, r in zip(places, rollouts, strict=True)
                    if place < cfg.log_rollouts
                ]
                shares = ranks.gather((figures, sampled, tokens, advantage_sums))
                if not ranks.is_main:
                    continue
                figures = [f for share in shares for f in share[0]]
                logged = [r for _, r in sorted(p for share in shares for p in share[1])]
                tokens = sum(share[2] for share in shares)
                advantage_sums = add_sums([share[3] for share in shares])
            elif not actors:
                logged = rollout_sample(rollouts, group, cfg.log_rollouts)
            step_seconds = time.monotonic() - step_started

            # 6. Log: rollout statistics under the eval names, then the optimization's.
            metrics = summary_metrics(figures_summary(env, figures))
            outcome_labels.update(f.outcome for f in figures if f.outcome is not None)
            metrics |= {
                f"outcome/{label}": metrics.get(f"outcome/{label}", 0.0) for label in outcome_labels
            }
            metrics |= trained | advantage_metrics(advantage_sums)
            metrics |= {
                # Tokens through the trainer (prompts included) per second of the step.
                "perf/tokens_per_s": tokens / step_seconds,
                "perf/step_seconds": step_seconds,
                "perf/rollout_seconds": rollout_seconds,
                "perf/train_seconds": time.monotonic() - train_started,
                # The train part's pieces: this rank's scoring (advantages and sequences)
                # and its update; in a data-parallel run also the wait for the ranks'
                # scoring (their rollouts are waited for inside the rollout part) and rank
                # 0's gathering of their rollouts.
                "perf/scoring_seconds": scored - train_started,
                "perf/update_seconds": updated - update_started,
            }
            if ranks.parallel:
                metrics["perf/wait_seconds"] = update_started - scored
                metrics["perf/gather_seconds"] = step_started + step_seconds - updated
            if actors:
                # The actor's rollouts and scoring, the learner's wait for the batch, and how
                # many updates the weights that played it were behind this step's.
                metrics["perf/scoring_seconds"] = taken.scoring_seconds
                metrics["perf/wait_seconds"] = train_started - step_started
                metrics["async/lag"] = float(step - 1 - taken.version)
            sink.metric(step, metrics)
            milestones.step(step, metrics, step_seconds)
            if cfg.log_rollouts:
                sink.rollouts(step, logged)
            if errors := [f.error for f in figures if f.error]:
                sink.log(
                    f"rl: {len(errors)} rollouts failed at step {step}: {errors[0]}", "warning"
                )
            sink.progress(step, cfg.max_steps, "rl")
            if saves_after(step, cfg.save_every, cfg.max_steps):
                checkpoint(step, checkpoint_dir(output_dir, step))
    finally:
        frozen_heap.thaw()
        if actors:
            actors.close(board)
        if rollouts_engine is not None:
            loop.run_until_complete(rollouts_engine.aclose())
        loop.close()

    path = checkpoint(cfg.max_steps, output_dir / "final")
    check_same_weights(model, "rl", "at the end", sink, saved=path)
    if not ranks.is_main:
        return path
    milestones.summary()
    sink.log(f"rl: final checkpoint {path}")
    if cfg.select.keep > 1:  # the result: the best of the last saves on validation games
        path, _ = choose_save(cfg, sink)
    return path
