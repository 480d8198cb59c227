"""Seconds per RL step: this lab's GRPO trainer against TRL's `GRPOTrainer`, same model,
task and settings, one process, one device.

    pip install -r requirements-bench.txt        # TRL and its datasets, for this only
    python bench/rl_vs_trl.py [--device auto] [--steps 8] [--threads N]

The task of issue 14: the built-in tiny model on `reverse_text` (paragraph mode), 64
completions a step as 8 prompts x 8, at most 48 new tokens, temperature 1, loss `grpo`
with no KL term, lr 1e-4 constant, one update per batch; the reward is the env's LCS
ratio (its format reward has weight 0). Ours is `run_rl` (the step time it reports);
TRL's is the time between its trainer's step callbacks. The first step of each (model
load, warm-up, graph capture) is left out; figures are medians. bf16 autocast on CUDA for
both, fp32 on CPU. Writes bench/results/rl_vs_trl_<device>.json.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from benchlib import write_results  # noqa: E402

from rlcore.envs.registry import load_environment  # noqa: E402
from rlcore.envs.reverse_text import lcs_ratio, parse_reversal  # noqa: E402
from rlcore.events import NullSink  # noqa: E402
from rlcore.policy.tiny import ensure_tiny_model  # noqa: E402
from rlcore.train.config import RLConfig, load_config  # noqa: E402
from rlcore.train.grpo import run_rl  # noqa: E402

PROMPTS, GROUP, MAX_TOKENS, LR = 8, 8, 48, 1e-4


class StepTimes(NullSink):
    def __init__(self):
        self.seconds: list[list[float]] = []

    def metric(self, step, values):
        self.seconds.append(
            [
                values["perf/step_seconds"],
                values["perf/rollout_seconds"],
                values["perf/train_seconds"],
            ]
        )


def run_ours(device: str, steps: int) -> dict:
    settings = [
        "model=tiny", "env=reverse_text", f"batch_size={PROMPTS * GROUP}",
        f"rollouts_per_example={GROUP}", f"max_tokens={MAX_TOKENS}", f"lr={LR}",
        "lr_schedule=constant", "warmup_steps=0", "temperature=1.0", "loss_type=grpo",
        f"micro_batch_size={PROMPTS * GROUP}", "save_every=0", "log_rollouts=0",
        f"device={device}", f"max_steps={steps + 1}",
    ]  # fmt: skip
    sink = StepTimes()
    with tempfile.TemporaryDirectory() as output_dir:
        cfg = load_config(RLConfig, None, [*settings, f"output_dir={output_dir}"])
        run_rl(cfg, sink)
    timed = sink.seconds[1:]
    return {
        "step": statistics.median(s[0] for s in timed),
        "rollout": statistics.median(s[1] for s in timed),
        "train": statistics.median(s[2] for s in timed),
        "steps": sink.seconds,
    }


def run_trl(device: str, steps: int) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    env = load_environment("reverse_text")
    examples = env.examples(PROMPTS * (steps + 1), seed=0)
    dataset = Dataset.from_list(
        [{"prompt": list(e.prompt), "answer": str(e.answer)} for e in examples]
    )

    def lcs(completions, answer, **_):
        rewards = []
        for completion, target in zip(completions, answer, strict=True):
            text = completion[-1]["content"] if isinstance(completion, list) else completion
            parsed = parse_reversal(text)
            rewards.append(0.0 if parsed is None else lcs_ratio(parsed, target.strip()))
        return rewards

    class Clock(TrainerCallback):
        def __init__(self):
            self.seconds: list[float] = []
            self.started = None

        def on_step_begin(self, args, state, control, **kwargs):
            if device == "cuda":
                torch.cuda.synchronize()
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if device == "cuda":
                torch.cuda.synchronize()
            self.seconds.append(time.perf_counter() - self.started)

    path = ensure_tiny_model()
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    clock = Clock()
    with tempfile.TemporaryDirectory() as output_dir:
        config = GRPOConfig(
            output_dir=output_dir,
            per_device_train_batch_size=PROMPTS * GROUP,
            num_generations=GROUP,
            max_completion_length=MAX_TOKENS,
            learning_rate=LR,
            lr_scheduler_type="constant",
            warmup_steps=0,
            beta=0.0,
            loss_type="grpo",
            temperature=1.0,
            max_steps=steps + 1,
            gradient_accumulation_steps=1,
            num_iterations=1,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            bf16=device == "cuda",
            use_cpu=device == "cpu",
            dataloader_num_workers=0,
            seed=0,
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=[lcs],
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[clock],
        )
        trainer.train()
    timed = clock.seconds[1:]
    return {"step": statistics.median(timed), "steps": clock.seconds}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda")
    parser.add_argument("--steps", type=int, default=8, help="timed steps of each")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--out", default=None, help="JSON path (default by device)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    card = (
        torch.cuda.get_device_name()
        if device == "cuda"
        else f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    )
    ours = run_ours(device, args.steps)
    print(f"  ours: {ours['step']:.3f} s/step", flush=True)
    trl = run_trl(device, args.steps)
    print(f"  trl: {trl['step']:.3f} s/step", flush=True)
    import trl as trl_package

    print(f"\nGRPO step, tiny model, reverse_text, {PROMPTS} x {GROUP}, {MAX_TOKENS} tokens")
    print(
        f"{'card':<28}{'trainer':<22}{'s/step':>8}{'rollout s':>11}{'train s':>9}{'speed-up':>10}"
    )
    print(
        f"{card[:27]:<28}{'rlcore run_rl':<22}{ours['step']:>8.3f}{ours['rollout']:>11.3f}"
        f"{ours['train']:>9.3f}{trl['step'] / ours['step']:>9.2f}x"
    )
    print(
        f"{card[:27]:<28}{'TRL ' + trl_package.__version__ + ' GRPOTrainer':<22}"
        f"{trl['step']:>8.3f}{'-':>11}{'-':>9}{1:>9.2f}x"
    )
    results = {
        "benchmark": "rl_vs_trl",
        "device": device,
        "card": card,
        "torch": torch.__version__,
        "trl": trl_package.__version__,
        "ours": ours,
        "trl_grpo_trainer": trl,
        "speedup": trl["step"] / ours["step"],
    }
    return write_results(results, args.out, f"rl_vs_trl_{device}.json")


if __name__ == "__main__":
    main()
