"""Benchmark: turn the untrained built-in tiny model into a tic-tac-toe player, end to end.

Stages, each timed, all on the machine's own device (a 2-core CPU is the reference):
1. base: the built-in tiny model, untrained (random weights);
2. synth + SFT: teacher games of the env's random-valid player (no stronger than random;
   the oracle is never a teacher), losses and unfinished games filtered out, at most
   `--sft-games` kept; SFT of the tiny model on them;
3. RL: GRPO against the minimax opponent with its random-move probability spread over
   [--rl-min-p, --rl-max-p] (stratified), for as long as the wall-time budget allows;
4. evaluation of base, SFT and RL: `--eval-games` games each against a random opponent
   (random_move_prob = 1) and against the optimal one (random_move_prob = 0), greedy.

With `--rl-select K` the RL checkpoint evaluated is chosen, inside the budget, among the
run's last K saves (one every `--rl-select-every` steps) by the trainer's own choice (RL's
`select`, rlcore/train/select.py): each plays `--rl-select-games` validation games per
opponent (their own seed, apart from the training streams and the held-out evaluation's)
and the best by the choice rule (`choice_score`, the env's validation weights) is the RL
stage. `--rl-select-average A` adds one candidate: the weights averaged over the last A
saves (`select.average`).
The first save's validation is timed as it is made, and RL stops K such times before the
budget's end, so the choice is paid for out of the same wall time. The last step's save is evaluated
too, as the stage `rl_last`: what the choice gained, on the same held-out games.

Prints the base / SFT / RL table and each stage's wall time; writes
`bench/results/tictactoe_mastery.json`; keeps every stage's checkpoint directory so anyone
can re-run `python -m rlcore eval tictactoe --model <dir> ...` on it, and every RL step's
metrics in `<out>/rl/metrics.jsonl`.

    python bench/tictactoe_mastery.py                # the full run (30 min budget)
    python bench/tictactoe_mastery.py --quick        # a few minutes, to check the plumbing

A budget longer than one sitting (a lent GPU machine runs a command for 10 minutes at most)
is spent in two: `--split-minutes M` stops RL once the pipeline has run M minutes, saves
the run and writes a partial results file without evaluating; the same command with
`--resume <that file>` in place of `--split-minutes` continues RL from the saved state (the
trainer's exact resume) for what is left of the budget, then evaluates. The wall times of
both parts add up in the final JSON, the second part's start-up (loading, CUDA graphs)
included.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from rlcore.envs import load_environment  # noqa: E402
from rlcore.envs.tictactoe_game import REASONING_FORMATS  # noqa: E402
from rlcore.evaluate import EvalConfig, run_eval  # noqa: E402
from rlcore.events import ConsoleSink  # noqa: E402
from rlcore.policy.tiny import ensure_tiny_model  # noqa: E402
from rlcore.train.config import RLConfig, SFTConfig, SynthConfig, build_config  # noqa: E402
from rlcore.train.distributed import run_rl_ranks  # noqa: E402
from rlcore.train.select import BEST, choose_save, saved_steps  # noqa: E402
from rlcore.train.sft import run_sft  # noqa: E402
from rlcore.train.synth import run_synth  # noqa: E402

OPPONENTS = {"random": 1.0, "optimal": 0.0}
# Example streams: training starts at seed 0 (--seed), the held-out evaluation is seed
# 10,000 and the validation games of --rl-select are seed 20,000.
HELD_OUT_SEED, VALIDATION_SEED = 10_000, 20_000


def choice_score(rows: dict) -> float:
    """The choice rule (tiny-master is chosen by it) for one model's rows of `evaluate`:
    the tic-tac-toe env's own validation weights (`TicTacToeEnv.validation`, which RL's
    `select` uses), i.e. draws against optimal + wins against random - 2 x losses against
    random - 2 x the invalid-move rate (the mean of both opponents')."""
    return sum(
        weight * rows[part.name][metric.rsplit("/", 1)[-1]]
        for part in load_environment("tictactoe").validation()
        for metric, weight in part.weights.items()
    )


class DeadlineSink(ConsoleSink):
    """Console output plus a stop request once the stage's wall-time deadline passes. With
    `probe`, the first save is handed to it and the deadline moves that many seconds
    earlier (the room the choice among saves needs)."""

    def __init__(
        self,
        deadline: float,
        metric_keys: list[str],
        metrics_path: Path,
        append: bool = False,
        split: float | None = None,
        probe=None,
    ):
        super().__init__(metric_keys=metric_keys)
        self.budget_end, self.split = deadline, split
        self.probe = probe
        self.first_progress: tuple[float, int] | None = None
        metrics_path.parent.mkdir(parents=True, exist_ok=True)
        self.metrics_file = metrics_path.open("a" if append else "w")

    @property
    def deadline(self) -> float:
        """The budget's end, or the split's where that comes first."""
        return min(self.budget_end, self.split if self.split is not None else self.budget_end)

    def checkpoint(self, step: int, path: str) -> None:
        super().checkpoint(step, path)
        if self.probe is not None:
            probe, self.probe = self.probe, None
            self.budget_end -= probe(path)

    def metric(self, step: int, values: dict[str, float]) -> None:
        """Shown on the console; every metric of every step kept in `metrics_path`."""
        super().metric(step, values)
        self.metrics_file.write(json.dumps({"step": step, **values}) + "\n")
        self.metrics_file.flush()

    def should_stop(self) -> bool:
        return time.monotonic() >= self.deadline

    def progress(self, done: int, total: int, desc: str = "") -> None:
        """The bar's total is the steps the budget leaves room for at the rate so far, not
        the (unreachable) step limit, so its ETA is the deadline's."""
        now = time.monotonic()
        if self.first_progress is None:
            self.first_progress = (now, done)
        started, first_done = self.first_progress
        if done > first_done and done < total:
            per_step = (now - started) / (done - first_done)
            total = min(total, done + max(1, round((self.deadline - now) / per_step)))
        super().progress(done, total, desc)


def evaluate(
    model: str, games: int, args, label: str, opponents=tuple(OPPONENTS), seed=HELD_OUT_SEED
) -> dict:
    """Win/draw/loss, invalid and format rates of `model` against each of `opponents`, on
    the examples of `seed` (the held-out games by default)."""
    rows = {}
    for opponent in opponents:
        random_move_prob = OPPONENTS[opponent]
        cfg = EvalConfig(
            env="tictactoe",
            model=model,
            env_args={
                "min_random_move_prob": random_move_prob,
                "max_random_move_prob": random_move_prob,
                "max_turns": args.max_turns,
                "reasoning": args.reasoning,
            },
            num_examples=games,
            max_tokens=args.max_tokens,
            temperature=0.0,
            concurrency=args.eval_concurrency,
            seed=seed,
            out_dir=str(Path(args.out) / "eval" / f"{label}-vs-{opponent}"),
            device=args.device,
        )
        started = time.monotonic()
        result = run_eval(cfg, ConsoleSink())
        summary = result.summary
        outcomes = summary["outcomes"]
        rows[opponent] = {
            "games": summary["num_rollouts"],
            "win": outcomes["win"]["rate"],
            "draw": outcomes["draw"]["rate"],
            "loss": outcomes["loss"]["rate"],
            "unfinished": outcomes["unfinished"]["rate"],
            "invalid_move_rate": summary["env_metrics"]["tictactoe/invalid_move_rate"],
            "format": summary["functions"]["format"]["mean"],
            "sound_move_rate": summary["env_metrics"]["tictactoe/sound_move_rate"],
            "think_correct_rate": summary["env_metrics"]["tictactoe/think_correct_rate"],
            # Replies a game that left a win on the spot, or the opponent's line unblocked.
            "missed_wins": summary["env_metrics"]["tictactoe/missed_wins"],
            "missed_blocks": summary["env_metrics"]["tictactoe/missed_blocks"],
            "seconds": round(time.monotonic() - started, 1),
        }
    return rows


def add_output_args(parser: argparse.ArgumentParser, name: str) -> None:
    """--device, and where a benchmark called `name` keeps its runs and writes its results."""
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--out", default=str(ROOT / "runs" / "bench" / name))
    parser.add_argument("--results", default=str(ROOT / "bench" / "results" / f"{name}.json"))


def settings(cls, **values):
    """A checked config of `cls`; a section's settings may be named alone (`lr`)."""
    return build_config(cls, [("bench", values)])


def teacher_games(teacher: str, games: int, env_args: dict, output_dir: Path) -> dict:
    """`games` games of `teacher` against opponents that blunder half the time or more,
    losses, unfinished games, malformed replies and invalid moves dropped (run_synth's
    report; its "path" is the dataset)."""
    return run_synth(
        SynthConfig(
            env="tictactoe",
            env_args={**env_args, "min_random_move_prob": 0.5, "max_random_move_prob": 1.0},
            model=teacher,
            num_examples=20 * games,
            max_kept=games,
            exclude_outcomes=["loss", "unfinished"],
            require_format=True,
            max_invalid_moves=0,
            output_dir=str(output_dir),
        ),
        ConsoleSink(),
    )


def warm_up(
    model: str,
    dataset: str,
    output_dir: Path,
    epochs: int,
    args,
    *,
    batch=16,
    lr=2e-3,
    min_lr_ratio=0.1,
) -> str:
    """SFT of `model` on `dataset` (cosine from `lr` down to `min_lr_ratio` times it);
    returns the final checkpoint directory."""
    return run_sft(
        settings(
            SFTConfig,
            model=model,
            dataset=dataset,
            output_dir=str(output_dir),
            epochs=epochs,
            batch_size=batch,
            micro_batch_size=batch,
            lr=lr,
            min_lr_ratio=min_lr_ratio,
            warmup_steps=10,
            seed=args.seed,
            device=args.device,
        ),
        ConsoleSink(metric_keys=["loss/sft", "optim/lr"]),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--budget-minutes", type=float, default=30.0, help="wall time for synth + SFT + RL together"
    )
    parser.add_argument(
        "--split-minutes",
        type=float,
        default=None,
        help="stop RL once the pipeline has run this long, save it and write a partial "
        "results file (no evaluation) for --resume",
    )
    parser.add_argument(
        "--resume",
        default=None,
        help="a partial results file of --split-minutes with the same settings: continue its "
        "RL for the rest of the budget, then evaluate",
    )
    parser.add_argument("--sft-games", type=int, default=200)
    parser.add_argument(
        "--reasoning",
        default="empty",
        choices=REASONING_FORMATS,
        help="the teacher's think block (env param `reasoning`): the empty cells, or also "
        "the cells that win and those that block, or nothing (`<think></think>`); the "
        "teacher's moves stay random",
    )
    parser.add_argument("--sft-epochs", type=int, default=40)
    parser.add_argument("--sft-lr", type=float, default=2e-3, help="SFT peak learning rate")
    parser.add_argument(
        "--sft-min-lr-ratio",
        type=float,
        default=0.1,
        help="SFT's cosine ends at this times --sft-lr (1: constant); a model that ends SFT "
        "at a higher rate may take RL at a higher one",
    )
    parser.add_argument("--rl-min-p", type=float, default=0.0)
    parser.add_argument("--rl-max-p", type=float, default=1.0)
    parser.add_argument("--rl-batch", type=int, default=64)
    parser.add_argument("--rl-group", type=int, default=8)
    parser.add_argument("--rl-lr", type=float, default=1e-4)
    parser.add_argument("--rl-warmup", type=int, default=0, help="RL warm-up steps")
    parser.add_argument("--rl-adam-eps", type=float, default=1e-8, help="RL AdamW epsilon")
    parser.add_argument("--rl-temperature", type=float, default=0.7)
    parser.add_argument("--rl-loss", default="grpo", choices=["grpo", "cispo", "dr_grpo"])
    parser.add_argument("--rl-aggregation", default="turn", choices=["token", "sequence", "turn"])
    parser.add_argument("--rl-advantage", default="tree", choices=["group", "tree", "none"])
    parser.add_argument(
        "--rl-opening-moves",
        type=int,
        default=2,
        help="exploring starts: up to this many random moves of each side open an RL game",
    )
    parser.add_argument(
        "--rl-no-think-loss",
        action="store_true",
        help="RL loss on the move tag only, not on the think block (train_think = false)",
    )
    parser.add_argument(
        "--rl-turn-reward-weight",
        type=float,
        default=0.0,
        help="weight of the env's per-move reward (1 for a move that keeps the game-theoretic "
        "value, 0 otherwise) in each move's advantage; 0: outcome rewards only",
    )
    parser.add_argument(
        "--rl-sound-mass",
        type=float,
        default=0.0,
        help="sound_mass_weight: at every judged move, this weight x -log of the policy's "
        "probability of the position's sound moves, every legal move judged (0: off)",
    )
    parser.add_argument(
        "--rl-beta", type=float, default=0.0, help="KL penalty to the SFT model (0: none)"
    )
    parser.add_argument(
        "--rl-iterations", type=int, default=1, help="clipped updates per batch of rollouts"
    )
    parser.add_argument(
        "--rl-micro-batch",
        type=int,
        default=32,
        help="sequences per RL forward/backward pass (the same gradient; larger is faster on a GPU)",
    )
    parser.add_argument("--rl-draw-reward", type=float, default=0.5)
    parser.add_argument(
        "--rl-think-reward",
        type=float,
        default=0.0,
        help="env param think_reward: per-turn reward for a think block that reads the board "
        "right (needs --rl-turn-reward-weight)",
    )
    parser.add_argument(
        "--rl-self-play",
        type=float,
        default=0.0,
        help="env param self_play: share of the RL games whose opponent is the policy itself",
    )
    parser.add_argument(
        "--rl-win-chances",
        action="store_true",
        help="env param win_chances: the sound mass also raises the oracle's moves (the most "
        "chances against a random opponent) above the other sound ones",
    )
    parser.add_argument(
        "--rl-loss-reward",
        type=float,
        default=0.0,
        help="outcome reward of a lost (or unfinished) RL game; a win is 1",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of SFT and RL")
    parser.add_argument(
        "--rl-select",
        type=int,
        default=0,
        help="choose the RL checkpoint among the last K saves by validation games, inside "
        "the budget (0: the last step)",
    )
    parser.add_argument("--rl-select-every", type=int, default=25, help="RL steps between saves")
    parser.add_argument(
        "--rl-select-average",
        type=int,
        default=0,
        help="with --rl-select, one more candidate: the weights averaged over the last K saves",
    )
    parser.add_argument(
        "--rl-select-games", type=int, default=500, help="validation games per opponent"
    )
    parser.add_argument("--rl-max-steps", type=int, default=10_000)
    parser.add_argument(
        "--rl-processes",
        type=int,
        default=1,
        help="data-parallel RL processes, each rolling out and training its share of a step",
    )
    parser.add_argument(
        "--rl-actors",
        type=int,
        default=0,
        help="rollout actor processes feeding the RL learner batches played by recent weights",
    )
    parser.add_argument(
        "--rl-compile",
        action="store_true",
        help="RLConfig.compile: the update's pass through torch.compile on CUDA (~1 minute of "
        "compile out of the budget, then a faster update)",
    )
    parser.add_argument("--eval-games", type=int, default=1000)
    parser.add_argument(
        "--base-games",
        type=int,
        default=200,
        help="games per opponent for the untrained model, whose every reply "
        "runs to max tokens; it loses them all either way",
    )
    parser.add_argument("--eval-concurrency", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-turns", type=int, default=6)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument(
        "--merges",
        type=int,
        default=0,
        help="the tiny model's tokenizer with up to this many byte-pair merges learned on "
        "tic-tac-toe games (about half the tokens a game; 0: one token a character)",
    )
    parser.add_argument("--skip-base", action="store_true", help="do not evaluate the base model")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny budget and 50-game evals: checks the plumbing only",
    )
    add_output_args(parser, "tictactoe_mastery")
    args = parser.parse_args(argv)
    if args.quick:
        args.budget_minutes, args.eval_games, args.sft_epochs = 2.0, 50, 2
        args.base_games = 20
    if args.rl_select < 0 or args.rl_select_every < 1 or args.rl_select_games < 1:
        parser.error(
            f"--rl-select {args.rl_select}, --rl-select-every {args.rl_select_every}, "
            f"--rl-select-games {args.rl_select_games}: the saves to choose among must be 0 "
            "or more, the steps between saves and the validation games 1 or more"
        )
    if args.split_minutes is not None and args.resume:
        parser.error("--split-minutes and --resume are the two parts of one run: give one")
    partial = load_partial(args) if args.resume else None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    budget_s = args.budget_minutes * 60
    pipeline_started = time.monotonic()
    env_args = {"max_turns": args.max_turns, "num_groups": 4, "reasoning": args.reasoning}

    if partial is None:
        times: dict[str, float] = {}
        checkpoints: dict[str, str] = {}
        base = ensure_tiny_model(
            hidden_size=args.hidden_size, num_layers=args.num_layers, merges=args.merges
        )
        checkpoints["base"] = base

        # 2. Teacher data from the random-valid player; losses and unfinished games dropped.
        started = time.monotonic()
        synth = teacher_games("random", args.sft_games, env_args, out / "synth")
        times["synth"] = time.monotonic() - started

        started = time.monotonic()
        sft_dir = warm_up(
            base,
            synth["path"],
            out / "sft",
            args.sft_epochs,
            args,
            lr=args.sft_lr,
            min_lr_ratio=args.sft_min_lr_ratio,
        )
        times["sft"] = time.monotonic() - started
        checkpoints["sft"] = sft_dir
    else:  # the second part of a split run: synth and SFT are the first part's
        times, checkpoints, synth = (
            partial["wall_seconds"],
            partial["checkpoints"],
            partial["synth"],
        )
        base, sft_dir = checkpoints["base"], checkpoints["sft"]
    spent = times.get("pipeline", 0.0)  # by the first part of a split run

    # 3. RL for whatever is left of the budget (or until the split).
    started = time.monotonic()
    candidates = args.rl_select + (args.rl_select > 1 and args.rl_select_average > 1)
    deadline = pipeline_started + budget_s - spent - candidates * times.get("select_probe", 0)
    split = pipeline_started + args.split_minutes * 60 if args.split_minutes is not None else None

    def probe(save: str) -> float:
        """What the choice among K saves will cost, from the first save's validation (a
        trained policy's games, on the card as loaded then): the room RL leaves for it."""
        started = time.monotonic()
        validate(save, args, "probe")
        times["select_probe"] = time.monotonic() - started
        return candidates * times["select_probe"]

    rl_config = settings(
        RLConfig,
        model=sft_dir,
        resume_from=checkpoints["rl"] if partial else None,
        env="tictactoe",
        env_args={
            **env_args,
            "min_random_move_prob": args.rl_min_p,
            "max_random_move_prob": args.rl_max_p,
            "opening_moves": args.rl_opening_moves,
            "draw_reward": args.rl_draw_reward,
            "loss_reward": args.rl_loss_reward,
            "think_reward": args.rl_think_reward,
            "self_play": args.rl_self_play,
            "win_chances": args.rl_win_chances,
        },
        output_dir=str(out / "rl"),
        max_steps=args.rl_max_steps,
        batch_size=args.rl_batch,
        rollouts_per_example=args.rl_group,
        loss_type=args.rl_loss,
        loss_aggregation=args.rl_aggregation,
        advantage=args.rl_advantage,
        turn_reward_weight=args.rl_turn_reward_weight,
        sound_mass_weight=args.rl_sound_mass,
        train_think=not args.rl_no_think_loss,
        beta=args.rl_beta,
        num_iterations=args.rl_iterations,
        seed=args.seed,
        lr=args.rl_lr,
        warmup_steps=args.rl_warmup,
        adam_eps=args.rl_adam_eps,
        temperature=args.rl_temperature,
        max_tokens=args.max_tokens,
        micro_batch_size=args.rl_micro_batch,
        save_every=args.rl_select_every if args.rl_select else 0,
        select={
            "keep": args.rl_select,
            "num_examples": args.rl_select_games,
            "seed": VALIDATION_SEED,
            "average": args.rl_select_average,
        },
        device=args.device,
        processes=args.rl_processes,
        actors=args.rl_actors,
        compile=args.rl_compile,
    )
    rl_dir = run_rl_ranks(
        rl_config,
        DeadlineSink(
            deadline,
            [
                "reward/mean",
                "outcome/win",
                "outcome/loss",
                "tictactoe/invalid_move_rate",
                "tictactoe/sound_move_rate",
                "tictactoe/think_correct_rate",
                "tictactoe/missed_wins",
                "tictactoe/missed_blocks",
                "sound_mass/mean",
            ],
            out / "rl" / "metrics.jsonl",
            append=partial is not None,
            split=split,
            probe=probe if args.rl_select and "select_probe" not in times else None,
        ),
    )
    times["rl"] = times.get("rl", 0.0) + time.monotonic() - started
    selection = None
    if args.rl_select and args.split_minutes is None:
        started = time.monotonic()
        rl_out = Path(rl_config.output_dir)
        checkpoints["rl_last"] = str(saved_steps(rl_out, rl_config.max_steps)[-1][1])
        if Path(rl_dir).name == BEST:  # the step limit came first: the trainer chose
            selection = json.loads((rl_out / "select.json").read_text())
        else:  # stopped at the deadline: the same choice, among the saves made
            _, selection = choose_save(rl_config, ConsoleSink())
        rl_dir = str(rl_out / selection["chosen"])
        times["select"] = time.monotonic() - started
    times["pipeline"] = spent + time.monotonic() - pipeline_started
    checkpoints["rl"] = rl_dir
    if args.split_minutes is not None:
        times["first_part"] = times["pipeline"]
        report = {"benchmark": "tictactoe_mastery", "partial": True, "args": vars(args)}
        report |= {"synth": synth, "wall_seconds": times, "checkpoints": checkpoints}
        Path(args.results).parent.mkdir(parents=True, exist_ok=True)
        Path(args.results).write_text(json.dumps(report, indent=2, default=str) + "\n")
        print(
            f"\nfirst part: {times['pipeline']:.0f} s of the {budget_s:.0f} s budget; RL saved "
            f"at {rl_dir}\ncontinue with the same command and --resume {args.results} in "
            "place of --split-minutes"
        )
        return 0

    # 4. Evaluation (not part of the training budget).
    stages = {"sft": sft_dir, "rl": rl_dir}
    if selection:  # the last step's save beside the chosen one, on the same held-out games
        stages["rl_last"] = checkpoints["rl_last"]
    if not args.skip_base:
        stages = {"base": base, **stages}
    results = {}
    for stage, model in stages.items():
        started = time.monotonic()
        games = args.base_games if stage == "base" else args.eval_games
        results[stage] = evaluate(model, games, args, stage)
        times[f"eval_{stage}"] = time.monotonic() - started

    report = {
        "benchmark": "tictactoe_mastery",
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "device": args.device,
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        },
        "args": vars(args),
        "synth": {k: v for k, v in synth.items() if k != "path"} | {"path": synth["path"]},
        "stages": results,
        "selection": selection,
        "wall_seconds": {k: round(v, 1) for k, v in times.items()},
        "checkpoints": checkpoints,
        "targets": {
            "vs_random_win": ">= 0.93",
            "vs_random_loss": "== 0",
            "vs_optimal_draw": ">= 0.99",
            "invalid_move_rate": "== 0",
            "format": "== 1",
        },
    }
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    Path(args.results).write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(format_table(results, times))
    print(f"\nresults: {args.results}\nRL checkpoint: {rl_dir}")
    return 0


def validate(model: str, args, label: str) -> dict:
    """`model`'s rows on the validation games (`--rl-select-games` per opponent)."""
    return evaluate(model, args.rl_select_games, args, f"select-{label}", seed=VALIDATION_SEED)


def load_partial(args) -> dict:
    """The first part's results file for --resume, checked: partial, and run with the same
    settings as this command (all but the split, the resume and where results go)."""
    path = Path(args.resume)
    if not path.is_file():
        raise SystemExit(f"--resume: no such file {path}")
    partial = json.loads(path.read_text())
    if not partial.get("partial"):
        raise SystemExit(f"--resume: {path} is not the partial results of --split-minutes")
    free = {"split_minutes", "resume", "results"}
    mine = {k: v for k, v in vars(args).items() if k not in free}
    theirs = {k: v for k, v in partial["args"].items() if k not in free}
    if differ := sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k)):
        raise SystemExit(f"--resume: {path} was run with other settings: {', '.join(differ)}")
    return partial


def format_table(results: dict, times: dict) -> str:
    header = (
        f"{'stage':<6} {'opponent':<8} {'games':>5} {'win':>7} {'draw':>7} {'loss':>7} "
        f"{'unfin':>6} {'invalid':>8} {'format':>7} {'sound':>7} {'think':>7} "
        f"{'missed win':>10} {'block':>6}"
    )
    lines = [header, "-" * len(header)]
    for stage, rows in results.items():
        for opponent, row in rows.items():
            lines.append(
                f"{stage:<6} {opponent:<8} {row['games']:>5} {row['win']:>7.1%} "
                f"{row['draw']:>7.1%} {row['loss']:>7.1%} {row['unfinished']:>6.1%} "
                f"{row['invalid_move_rate']:>8.2%} {row['format']:>7.1%} "
                f"{row['sound_move_rate']:>7.1%} {row.get('think_correct_rate', 0):>7.1%} "
                f"{row.get('missed_wins', 0):>10.3f} {row.get('missed_blocks', 0):>6.3f}"
            )
    lines.append("")
    lines.append("wall time: " + ", ".join(f"{k} {v:.0f}s" for k, v in times.items()))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
