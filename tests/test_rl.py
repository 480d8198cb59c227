"""The RL trainer on the real tiny model: training sequences, stratified batches, learning,
checkpoints and resume."""

import asyncio
import json
import pickle
import random
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlcore.envs.registry import load_environment
from rlcore.evaluate import figures_summary, rollout_figures, summarize, summary_metrics
from rlcore.events import RecordingSink
from rlcore.policy.local import LocalEngine
from rlcore.rollout import run_rollouts
from rlcore.train.common import TRAINER_STATE, autocast, model_path
from rlcore.train.config import ConfigError, LossConfig, RLConfig, SFTConfig, build_config
from rlcore.train.grpo import add_sums, advantage_metrics, for_log, run_rl, step_advantages
from rlcore.train.sampling import StratifiedSampler, rollout_sample, sample_places
from rlcore.train.sequences import build_sequences, think_length, training_sequences
from rlcore.train.sft import run_sft
from rlcore.types import Rollout, SamplingParams, Turn

REVERSE_AB = {"mode": "random", "min_chars": 2, "max_chars": 2, "alphabet": "ab"}


@pytest.fixture(scope="module")
def half_formatted_model(tiny_model, tmp_path_factory) -> str:
    """The tiny model after a short SFT on reverse-text replies of random letters, half of
    them missing the closing </reversed> (which scores 0): a policy RL can improve."""
    env = load_environment("reverse_text", **REVERSE_AB)
    rng = random.Random(0)
    conversations = []
    for example in env.examples(64, seed=123):
        letters = "".join(rng.choice("ab") for _ in range(2))
        closing = "</reversed>" if rng.random() < 0.5 else ""
        reply = {"role": "assistant", "content": f"<reversed>{letters}{closing}"}
        conversations.append([*example.prompt, reply])
    return short_sft(tiny_model, conversations, tmp_path_factory.mktemp("warm"), steps=30)


def short_sft(model: str, conversations: list[list[dict]], work, steps: int) -> str:
    """`model` after `steps` SFT steps (batch 16, lr 3e-3) on `conversations`."""
    with (work / "data.jsonl").open("w") as out:
        for messages in conversations:
            out.write(json.dumps({"messages": messages}) + "\n")
    settings = dict(
        model=model,
        dataset=str(work / "data.jsonl"),
        output_dir=str(work / "sft"),
        max_steps=steps,
        batch_size=16,
        micro_batch_size=16,
        lr=3e-3,
        lr_schedule="constant",
    )
    cfg = build_config(SFTConfig, [("test", settings)])
    return run_sft(cfg, RecordingSink())


def rl_config(model: str, tmp_path, **changes) -> RLConfig:
    values = dict(
        model=model,
        env="reverse_text",
        env_args=dict(REVERSE_AB),
        output_dir=str(tmp_path / "rl"),
        batch_size=16,
        rollouts_per_example=4,
        micro_batch_size=16,
        max_tokens=8,
        lr=3e-4,
        max_steps=2,
    )
    return build_config(RLConfig, [("test", {**values, **changes})])


# ---------------------------------------------------------------------------------------
# Training sequences


@pytest.mark.filterwarnings("ignore:CUDA is not available:UserWarning")
def test_a_cuda_training_pass_never_takes_cudnn_attention():
    # cuDNN's attention plans every new batch shape on the host (15-20 ms a call on an
    # H200), and a step's micro-batches take new shapes every step; set here on a CPU
    # build, the flags are what a CUDA pass would see.
    assert torch.backends.cuda.cudnn_sdp_enabled()
    with autocast(torch.device("cuda")):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled()
        assert torch.backends.cuda.mem_efficient_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled()  # other code's choice left as it was
    with autocast(torch.device("cpu")):
        assert torch.backends.cuda.cudnn_sdp_enabled()


def test_a_real_multi_turn_rollout_becomes_sequences_masked_on_sampled_tokens(tiny_model):
    torch.manual_seed(0)
    env = load_environment("tictactoe", max_turns=4, num_groups=1)
    engine = LocalEngine(tiny_model, device="cpu")
    # Two-token replies: random ones are often plain characters that re-tokenize to the
    # same ids (turns merge) and sometimes not (a new sequence starts): both paths run.
    rollouts = asyncio.run(
        run_rollouts(
            env,
            engine,
            env.examples(6, seed=1),
            sampling=SamplingParams(max_tokens=2),
            rollouts_per_example=2,
        )
    )
    merged_turns = split_turns = 0
    for rollout in rollouts:
        assert rollout.num_turns == len(rollout.turns) >= 2
        sequences = build_sequences(rollout)
        # Which turns share a sequence, decided independently of build_sequences: a turn
        # joins when its prompt starts with the previous turn's prompt and completion.
        owners, sequence_start = [], []
        for index, turn in enumerate(rollout.turns):
            previous = rollout.turns[index - 1] if index else None
            if (
                previous is not None
                and turn.prompt_ids[: len(previous.prompt_ids) + len(previous.completion_ids)]
                == previous.prompt_ids + previous.completion_ids
            ):
                merged_turns += 1
            else:
                split_turns += index > 0
                sequence_start.append(index)
            owners.append(len(sequence_start) - 1)
        assert len(sequences) == len(sequence_start)
        for number, (input_ids, loss_mask) in enumerate(sequences):
            turns = [t for t, owner in zip(rollout.turns, owners, strict=True) if owner == number]
            last = turns[-1]
            # A sequence is its last turn's exact prompt and sampled ids, nothing re-encoded.
            assert input_ids == last.prompt_ids + last.completion_ids
            expected_mask = [0] * len(input_ids)
            for turn in turns:
                start = len(turn.prompt_ids)  # the prompt of a merged turn is the prefix so far
                for position in range(start, start + len(turn.completion_ids)):
                    expected_mask[position] = 1
            assert loss_mask == expected_mask
    assert merged_turns > 0 and split_turns > 0


def test_a_turn_whose_prompt_does_not_extend_the_sequence_starts_a_new_one():
    rollout = Rollout(example_id=0, seed=0, group=0, messages=[], prompt_len=0)
    rollout.turns = [
        Turn(prompt_ids=[1, 2, 3], completion_ids=[10, 11], logprobs=[-0.1, -0.2]),
        # Extends [1, 2, 3, 10, 11] with an env reply [4, 5]: same sequence.
        Turn(prompt_ids=[1, 2, 3, 10, 11, 4, 5], completion_ids=[12], logprobs=[-0.3]),
        # History re-rendered (11 became 99): not a prefix extension, a new sequence.
        Turn(prompt_ids=[1, 2, 3, 10, 99, 4, 5, 12, 6], completion_ids=[13, 14], logprobs=None),
    ]
    assert build_sequences(rollout) == [
        ([1, 2, 3, 10, 11, 4, 5, 12], [0, 0, 0, 1, 1, 0, 0, 1]),
        ([1, 2, 3, 10, 99, 4, 5, 12, 6, 13, 14], [0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1]),
    ]
    first, second = training_sequences(rollout, [1.0, 1.0, 1.0], "token")
    assert first.sampled_logprobs == [0.0, 0.0, 0.0, -0.1, -0.2, 0.0, 0.0, -0.3]
    assert second.sampled_logprobs is None  # the backend gave no logprobs for that turn


# ---------------------------------------------------------------------------------------
# Stratified batches


def test_the_sampler_deals_fresh_examples_evenly_over_groups_and_rotates_the_remainder():
    env = load_environment("tictactoe", num_groups=4)
    sampler = StratifiedSampler(env, seed=3, examples_per_step=6)
    batches = [sampler.next_batch() for _ in range(4)]
    assert [[e.group for e in batch] for batch in batches[:2]] == [
        [0, 1, 2, 3, 0, 1],
        [2, 3, 0, 1, 2, 3],
    ]
    ids = [e.id for batch in batches for e in batch]
    assert len(ids) == len(set(ids)) == 24
    replay = StratifiedSampler(env, seed=3, examples_per_step=6)
    assert [e.id for e in replay.next_batch()] == [e.id for e in batches[0]]
    other_seed = StratifiedSampler(env, seed=4, examples_per_step=6).next_batch()
    assert [e.seed for e in other_seed] != [e.seed for e in batches[0]]


def test_sampler_state_restores_the_same_stream():
    env = load_environment("tictactoe", num_groups=3)
    sampler = StratifiedSampler(env, seed=0, examples_per_step=4)
    sampler.next_batch()
    state = json.loads(json.dumps(sampler.state_dict()))
    expected = [[e.id for e in sampler.next_batch()] for _ in range(2)]
    restored = StratifiedSampler(env, seed=0, examples_per_step=4)
    restored.load_state_dict(state)
    assert [[e.id for e in restored.next_batch()] for _ in range(2)] == expected
    with pytest.raises(ValueError, match="seed 0 with 3 groups, this run has seed 1"):
        StratifiedSampler(env, seed=1, examples_per_step=4).load_state_dict(state)


# ---------------------------------------------------------------------------------------
# Training runs


def test_rl_raises_the_mean_reward_on_reverse_text(half_formatted_model, tmp_path):
    cfg = rl_config(
        half_formatted_model,
        tmp_path,
        max_steps=40,
        batch_size=64,
        rollouts_per_example=8,
        micro_batch_size=64,
    )
    sink = RecordingSink()
    final = run_rl(cfg, sink)

    rewards = [values["reward/mean"] for _, values in sink.metrics]
    assert len(rewards) == 40
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.1, f"reward went from {first:.3f} to {last:.3f}"
    # The gain is the closing tag learned: the format share rises with it.
    formats = [values["reward/format"] for _, values in sink.metrics]
    assert sum(formats[-5:]) / 5 > sum(formats[:5]) / 5 + 0.15
    # The log says it too: milestones at steps 1, 4, 8, ... 40, then how the reward moved.
    messages = [message for _, message in sink.logs]
    steps = [m.split()[2].rstrip(":") for m in messages if m.startswith("rl: step ")]
    assert steps == ["1/40"] + [f"{s}/40" for s in range(4, 41, 4)]
    summary = next(m for m in messages if m.startswith("rl: done: 40 steps"))
    logged_first, logged_last = (
        float(v) for v in summary.split("reward/mean ")[1].split(",")[0].split(" -> ")
    )
    assert logged_first == pytest.approx(sum(rewards[:4]) / 4, rel=1e-3)
    assert logged_last == pytest.approx(sum(rewards[-4:]) / 4, rel=1e-3)
    assert messages[-1] == f"rl: final checkpoint {final}"

    names = set(sink.metrics[0][1])
    for name in (
        "reward/mean",
        "reward/std",
        "reward/lcs",
        "reward/format",
        "outcome/correct",
        "outcome/incorrect",
        "reverse_text/answered",
        "length/completion_tokens",
        "length/truncated_rate",
        "policy/entropy",
        "loss/kl",
        "policy/clip_fraction",
        "optim/grad_norm",
        "loss/policy",
        "loss/total",
        "optim/lr",
        "perf/tokens_per_s",
        "perf/step_seconds",
        "perf/rollout_seconds",
        "perf/train_seconds",
        "policy/logprob_mismatch",
    ):
        assert name in names, name
    # The trainer's recomputed logprobs match what the engine sampled with.
    assert all(values["policy/logprob_mismatch"] < 1e-3 for _, values in sink.metrics)
    assert [step for step, _ in sink.rollout_batches] == list(range(1, 41))
    assert len(sink.rollout_batches[0][1]) == min(cfg.log_rollouts, cfg.batch_size)
    assert sink.progress_events[-1] == (40, 40, "rl")
    assert sink.checkpoints == [(40, final)]
    assert json.loads((tmp_path / "rl" / "config.json").read_text())["optimizer"]["lr"] == 3e-4
    reloaded = AutoModelForCausalLM.from_pretrained(final)
    assert reloaded.config.hidden_size == 64


def test_resume_continues_at_the_saved_step_with_identical_sampling(half_formatted_model, tmp_path):
    full = RecordingSink()
    run_rl(rl_config(half_formatted_model, tmp_path / "full", max_steps=4, save_every=2), full)
    checkpoint = tmp_path / "full" / "rl" / "step_000002"
    assert (checkpoint / TRAINER_STATE).is_file()
    assert [step for step, _ in full.checkpoints] == [2, 4]

    resumed = RecordingSink()
    final = run_rl(
        rl_config(
            half_formatted_model, tmp_path / "resumed", max_steps=4, resume_from=str(checkpoint)
        ),
        resumed,
    )
    assert [step for step, _ in resumed.metrics] == [3, 4]
    assert any("resumed from" in message for _, message in resumed.logs)
    for (_, expected), (_, got) in zip(full.metrics[2:], resumed.metrics, strict=True):
        for name in ("reward/mean", "length/completion_tokens", "loss/policy", "optim/lr"):
            assert got[name] == pytest.approx(expected[name], abs=1e-6), name
    for (_, expected), (_, got) in zip(
        full.rollout_batches[2:], resumed.rollout_batches, strict=True
    ):
        assert [r.messages for r in got] == [r.messages for r in expected]
    weights = AutoModelForCausalLM.from_pretrained(final).state_dict()
    reference = AutoModelForCausalLM.from_pretrained(
        tmp_path / "full" / "rl" / "final"
    ).state_dict()
    assert all(torch.allclose(weights[k], reference[k], atol=1e-6) for k in reference)


def test_kl_to_the_reference_is_measured_from_the_second_update_on(half_formatted_model, tmp_path):
    cfg = rl_config(
        half_formatted_model,
        tmp_path,
        loss_type="cispo",
        beta=0.1,
        num_iterations=2,
        lr=1e-3,
        micro_batch_size=4,
    )
    sink = RecordingSink()
    run_rl(cfg, sink)
    first, second = sink.metrics[0][1], sink.metrics[1][1]
    # Step 1's first update starts at the reference (KL exactly 0), so a positive KL at
    # step 1 comes from its second update, after the weights moved.
    assert first["loss/kl"] > 0 and second["loss/kl"] > 0
    assert first["loss/total"] == pytest.approx(first["loss/policy"] + 0.1 * first["loss/kl"])
    assert first["optim/grad_norm"] > 0


def tictactoe_step(model: str, tmp_path, env_args: dict | None = None, **changes):
    """One RL step on tic-tac-toe (2 turns a game, 2 opponent groups): (metrics, rollouts)."""
    cfg = rl_config(
        model,
        tmp_path,
        env="tictactoe",
        env_args={"max_turns": 2, "num_groups": 2, **(env_args or {})},
        max_steps=1,
        **changes,
    )
    sink = RecordingSink()
    run_rl(cfg, sink)
    ((_, metrics),) = sink.metrics
    return metrics, sink.rollout_batches[0][1]


def test_tictactoe_training_reports_env_metrics_and_mixes_groups(tiny_model, tmp_path):
    metrics, rollouts = tictactoe_step(tiny_model, tmp_path)
    expected = {
        "outcome/unfinished",
        "reward/outcome",
        "reward/format",
        "reward/invalid_move",
        "tictactoe/invalid_move_rate",
    }
    assert expected <= set(metrics)
    # A random model never plays a valid move, so every game scores the same: no signal.
    assert metrics["tictactoe/invalid_move_rate"] == 1.0
    assert metrics["advantage/zero_group_rate"] == 1.0
    assert metrics["optim/grad_norm"] == 0.0
    # Every rollout of the step is stored (log_rollouts' default covers batches up to 256):
    # 4 examples of 4 rollouts, an even mix of the 2 opponent groups.
    assert sorted(r.group for r in rollouts) == [0] * 8 + [1] * 8


def test_tree_advantages_run_on_tictactoe_with_positions_named_by_the_board(tiny_model, tmp_path):
    metrics, rollouts = tictactoe_step(
        tiny_model, tmp_path, {"opening_moves": 2}, advantage="tree", loss_aggregation="turn"
    )
    # Every turn carries the env's name for its position: the board and the turns used
    # (invalid replies leave the board as the opening set it).
    assert any(rollout.info["opening"] for rollout in rollouts)
    for rollout in rollouts:
        board = "".join(rollout.state["board"])
        assert [turn.state_key for turn in rollout.turns] == [
            f"{board}/{index}" for index in range(len(rollout.turns))
        ]
    # The untrained model replies invalidly every time, so all rollouts of an example
    # stay on one board: the same positions, the same return, no advantage anywhere.
    assert metrics["advantage/zero_turn_rate"] == 1.0
    assert metrics["optim/grad_norm"] == 0.0


def test_a_rank_sends_rank_0_figures_sums_and_its_part_of_the_sample_and_the_log_reads_the_same(
    tmp_path,
):
    # Real games of the shipped player at temperature 1 (wins, draws, losses and some
    # invalid moves), 12 examples of 4: what rank 0 logs from what 1, 2 or 5 ranks send it
    # must be what one process logs from the whole batch.
    torch.manual_seed(0)
    env = load_environment("tictactoe", opening_moves=2, num_groups=2)
    engine = LocalEngine(str(model_path("tiny-master")), device="cpu")
    examples = env.examples(12, seed=3)
    group = 4
    cfg = rl_config(
        "tiny-master",
        tmp_path,
        env="tictactoe",
        env_args={},
        rollouts_per_example=group,
        advantage="tree",
        turn_reward_weight=1.0,
    )

    whole = asyncio.run(
        run_rollouts(
            env,
            engine,
            examples,
            sampling=SamplingParams(max_tokens=24, temperature=1.0),
            rollouts_per_example=group,
        )
    )
    assert len({r.reward for r in whole}) > 1  # the advantages below are not all zero
    _, whole_sums = step_advantages(env, whole, cfg)
    whole_metrics = advantage_metrics(whole_sums)
    assert whole_metrics["advantage/abs_mean"] > 0
    verdicts = [[sum(env.turn_rewards(r)), len(r.turns)] for r in whole]
    totals = torch.tensor(verdicts, dtype=torch.float64).sum(dim=0)

    def over_ranks(_mine):  # what Ranks.sum gives every rank: the whole batch's sums
        return totals.clone()

    by_rollout = dict(zip(map(id, whole), step_advantages(env, whole, cfg)[0], strict=True))
    for world in (1, 2, 5):
        # Each rank's share: the groups of its examples (every world-th, as dealt).
        shares = [
            [
                r
                for e in range(rank, len(examples), world)
                for r in whole[e * group : (e + 1) * group]
            ]
            for rank in range(world)
        ]
        together = [r for share in shares for r in share]
        # The log's sample: each rank's rollouts at places below the count, put in order.
        for count in (0, 7, 12, 30, 48, 100):
            sent = []
            for rank, share in enumerate(shares):
                places = sample_places(rank, world, len(examples), group)
                sent += [(p, for_log(r)) for p, r in zip(places, share, strict=True) if p < count]
            logged = [r for _, r in sorted(sent, key=lambda pair: pair[0])]
            expected = rollout_sample(together, group, count)
            assert [r.to_dict() for r in logged] == [r.to_dict() for r in expected]
        # The figures and the advantage sums, added over the ranks, read as the whole's.
        figures = [rollout_figures(env, r) for r in together]
        summary = figures_summary(env, figures)
        assert summary_metrics(summary) == pytest.approx(
            summary_metrics(summarize(env, whole, 1.0))
        )
        # Each rank's advantages, with the per-move rewards' batch mean added up over the
        # ranks, are the whole batch's, and so are their sums added over the ranks.
        shared = [step_advantages(env, share, cfg, over_ranks) for share in shares]
        for share, (turns, _) in zip(shares, shared, strict=True):
            expected = [a for r in share for a in by_rollout[id(r)]]
            assert [a for row in turns for a in row] == pytest.approx(expected)
        sums = add_sums([part for _, part in shared])
        assert sums == pytest.approx(whole_sums)
        assert advantage_metrics(sums) == pytest.approx(whole_metrics)
        if world > 1:  # each share's own batch mean would credit the moves otherwise
            alone = add_sums([step_advantages(env, share, cfg)[1] for share in shares])
            assert alone["abs_advantage"] != pytest.approx(whole_sums["abs_advantage"])
    # What goes over the wire for a sampled rollout shrinks by the ids.
    slim = [for_log(r) for r in whole]
    for full, sent in zip(whole, slim, strict=True):
        assert sent.to_dict() == full.to_dict()
        assert [t.state_key for t in sent.turns] == [t.state_key for t in full.turns]
        assert all(t.prompt_ids == [] and t.completion_ids == [] for t in sent.turns)
        assert all(t.completion_ids for t in full.turns)  # the original is untouched
    ids = sum(len(t.prompt_ids) + len(t.completion_ids) for r in whole for t in r.turns)
    assert len(pickle.dumps(whole)) - len(pickle.dumps(slim)) >= 2 * ids
    # A rollout's figures pickle smaller than even its slim copy.
    assert len(pickle.dumps(figures)) < 0.75 * len(pickle.dumps(slim))
    # Without the env's name for a position, tree advantages key on the prompt: kept.
    nameless = for_log(replace(whole[0], turns=[replace(whole[0].turns[0], state_key=None)]))
    assert nameless.turns[0].prompt_ids == whole[0].turns[0].prompt_ids


def test_a_stop_request_saves_a_checkpoint_at_the_last_finished_step(tiny_model, tmp_path):
    class StopAfterFirstStep(RecordingSink):
        def should_stop(self) -> bool:
            return bool(self.metrics)

    sink = StopAfterFirstStep()
    path = run_rl(rl_config(tiny_model, tmp_path, max_steps=5), sink)
    assert path.endswith("step_000001")
    assert [step for step, _ in sink.metrics] == [1]
    assert sink.checkpoints == [(1, path)]
    assert torch.load(f"{path}/{TRAINER_STATE}", weights_only=True)["step"] == 1


def test_resuming_from_a_directory_without_trainer_state_is_refused(tiny_model, tmp_path):
    with pytest.raises(ValueError, match="is not an RL checkpoint"):
        run_rl(rl_config(tiny_model, tmp_path, resume_from=tiny_model), RecordingSink())


def test_a_group_of_one_rollout_is_refused():
    with pytest.raises(ConfigError, match="rollouts_per_example must be at least 2"):
        RLConfig(rollouts_per_example=1, batch_size=4).validate()


def test_think_length_counts_the_tokens_through_the_closing_think_tag(tiny_model):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    pieces: dict[int, str] = {}
    reply = "<think>Empty: 0 4.</think><move>4</move>"
    ids = tokenizer(reply, add_special_tokens=False)["input_ids"]
    count = think_length(ids, pieces, tokenizer)
    assert tokenizer.decode(ids[:count]) == "<think>Empty: 0 4.</think>"
    assert tokenizer.decode(ids[count:]) == "<move>4</move>"
    no_think = tokenizer("<move>4</move>", add_special_tokens=False)["input_ids"]
    assert think_length(no_think, pieces, tokenizer) == 0


def test_per_move_rewards_are_reported_on_tictactoe(tiny_model, tmp_path):
    metrics, rollouts = tictactoe_step(
        tiny_model, tmp_path, advantage="none", turn_reward_weight=1.0
    )
    # Every reply of the untrained model is invalid: each turn is rewarded 0.
    assert all(r.state["move_sound"] == [None] * r.num_turns for r in rollouts)
    assert metrics["reward/turn_mean"] == metrics["tictactoe/sound_move_rate"] == 0.0


def test_per_move_rewards_need_an_env_that_gives_them(tiny_model, tmp_path):
    cfg = rl_config(tiny_model, tmp_path, turn_reward_weight=1.0)
    with pytest.raises(ValueError, match="'reverse_text' judges whole episodes only"):
        run_rl(cfg, RecordingSink())


@pytest.fixture(scope="module")
def thinking_model(tiny_model, tmp_path_factory) -> str:
    """The tiny model after a short SFT on opening tic-tac-toe replies with a think block."""
    from rlcore.envs.tictactoe import system_prompt
    from rlcore.envs.tictactoe_players import think_reply

    rng = random.Random(0)
    conversations = [
        [
            {"role": "system", "content": system_prompt("XO"[index % 2])},
            {"role": "user", "content": "012\n345\n678\nYour move."},
            {
                "role": "assistant",
                "content": think_reply("." * 9, rng.randrange(9), "XO"[index % 2]),
            },
        ]
        for index in range(64)
    ]
    return short_sft(tiny_model, conversations, tmp_path_factory.mktemp("think"), steps=150)


def test_train_think_off_leaves_the_think_block_out_of_the_gradient(thinking_model, tmp_path):
    """On and off on the same real replies: with train_think off the policy loss has no
    gradient on any think-block token and the same gradient on the rest."""
    from rlcore.train.grpo import policy_loss, token_logprobs
    from rlcore.train.sequences import collate

    _, rollouts = tictactoe_step(thinking_model, tmp_path, env_args={"max_turns": 1},
                                 max_tokens=40, log_rollouts=16)  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(thinking_model)
    tokenizer = AutoTokenizer.from_pretrained(thinking_model)
    pieces: dict[int, str] = {}
    thinking = [
        r for r in rollouts if think_length(r.turns[0].completion_ids, pieces, tokenizer) > 0
    ]
    assert thinking, [r.completion for r in rollouts]

    def gradient(train_think: bool) -> tuple[torch.Tensor, torch.Tensor]:
        sequences = []
        for rollout in thinking:
            thinks = (
                None
                if train_think
                else [think_length(t.completion_ids, pieces, tokenizer) for t in rollout.turns]
            )
            sequences += training_sequences(rollout, [1.0] * len(rollout.turns), "token", thinks)
        input_ids, _, weights, advantages = collate(sequences, tokenizer.pad_token_id, "cpu")
        logprobs, *_ = token_logprobs(model, input_ids, 1.0)
        logprobs = logprobs.detach().requires_grad_(True)
        loss, _ = policy_loss(
            logprobs, logprobs.detach(), None, advantages, weights, LossConfig(), 1.0
        )
        loss.backward()
        return logprobs.grad, weights

    on, on_weights = gradient(True)
    off, off_weights = gradient(False)
    think = (on_weights > 0) & (off_weights == 0)  # tokens of the think blocks
    assert think.any()
    assert (on[think] != 0).all() and (off[think] == 0).all()
    assert torch.equal(on[off_weights > 0], off[off_weights > 0])


def test_rl_asked_to_sample_with_vllm_where_it_cannot_run_trains_on_the_local_engine(
    tiny_model, tmp_path
):
    sink = RecordingSink()
    final = run_rl(rl_config(tiny_model, tmp_path), sink, engine="vllm")
    assert final and len(sink.metrics) == 2  # it trained all the same
    warnings = [message for level, message in sink.logs if level == "warning"]
    assert any(
        message.startswith("rl: engine vllm asked for, running on the local engine: vllm is")
        for message in warnings
    )
