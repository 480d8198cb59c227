"""Diagnostic (the twenty-seventh session; deleted after its round, docs/mastery.md): how much
the greedy play of the GPU recipe's checkpoints moves from one save to the next, and whether
the mean of the last 2, 4 or 8 saves' weights (the iterates' average) plays better than any
one of them.

    python3 bench/tictactoe_checkpoint_jitter.py --seed S --steps 450 --save-every 25 \
        --keep 6 --root runs/jitter --games 1000 --device cuda --results OUT.json

One run: synth and SFT as `recipes/tictactoe_tiny/synth.toml` and `sft.toml`, RL as
`rl_gpu.toml` for `--steps` steps saving every `--save-every`, then the last `--keep` saves
and the averages, each `--games` held-out greedy games per opponent (the mastery benchmark's
`evaluate`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

R = "recipes/tictactoe_tiny/"


def sh(*argv):
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "rlcore", *argv], check=True, stdout=subprocess.DEVNULL)
    return round(time.monotonic() - started, 1)


def average(dirs: list[Path], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    total = None
    for d in dirs:
        weights = load_file(str(d / "model.safetensors"))
        if total is None:
            total = {k: v.double().clone() for k, v in weights.items()}
        else:
            for k, v in weights.items():
                total[k] += v.double()
    dtype = load_file(str(dirs[-1] / "model.safetensors"))
    save_file(
        {k: (v / len(dirs)).to(dtype[k].dtype).contiguous() for k, v in total.items()},
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )
    for f in dirs[-1].iterdir():
        if f.name not in ("model.safetensors", "trainer_state.pt") and f.is_file():
            shutil.copy(f, out / f.name)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=550)
    p.add_argument("--save-every", type=int, default=25)
    p.add_argument("--keep", type=int, default=8, help="last saves evaluated one by one")
    p.add_argument("--root", default="runs/avg")
    p.add_argument("--games", type=int, default=1000)
    p.add_argument("--device", default="cuda")
    p.add_argument("--results", required=True)
    a = p.parse_args()
    from tictactoe_mastery import evaluate

    root = Path(a.root) / f"s{a.seed}"
    times = {}
    times["synth"] = sh("synth", "--config", R + "synth.toml", f"seed={a.seed}",
                        f"output_dir={root}/synth")  # fmt: skip
    times["sft"] = sh("sft", "--config", R + "sft.toml", f"seed={a.seed}", f"device={a.device}",
                      f"dataset={root}/synth/dataset.jsonl", f"output_dir={root}/sft")  # fmt: skip
    times["rl"] = sh("rl", "--config", R + "rl_gpu.toml", f"seed={a.seed}", f"device={a.device}",
                     f"model={root}/sft/final", f"output_dir={root}/rl", f"max_steps={a.steps}",
                     f"save_every={a.save_every}", "log_rollouts=0")  # fmt: skip
    saves = sorted(d for d in (root / "rl").glob("step_*") if d.is_dir())
    saves += [root / "rl" / "final"]
    models = {d.name: d for d in saves[-a.keep :]}
    for k in (2, 4, 8):
        if len(saves) >= k:
            out = root / f"avg{k}"
            average(saves[-k:], out)
            models[f"avg{k}"] = out
    args = argparse.Namespace(max_turns=6, reasoning="none", max_tokens=64,
                              eval_concurrency=256, out=str(root), device=a.device)  # fmt: skip
    rows = {}
    for name, d in models.items():
        rows[name] = evaluate(str(d), a.games, args, name)
        r, o = rows[name]["random"], rows[name]["optimal"]
        print(f"s{a.seed} {name:12s} {r['win']:.3f}/{r['draw']:.3f}/{r['loss']:.3f} "
              f"opt {o['draw']:.3f} inv {r['invalid_move_rate']:.4f}/{o['invalid_move_rate']:.4f}",
              flush=True)  # fmt: skip
        Path(a.results).write_text(json.dumps({"seed": a.seed, "times": times, "saves": [d.name for d in saves], "rows": rows}, indent=1))  # fmt: skip
    Path(a.results).write_text(json.dumps({"seed": a.seed, "times": times, "saves": [d.name for d in saves], "rows": rows}, indent=1))  # fmt: skip


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
