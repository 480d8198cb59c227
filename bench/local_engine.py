"""Benchmark of the local engine on the built-in tiny model: N concurrent requests served
by the batching engine versus the same requests one at a time, measured side by side in
one run, plus Hugging Face `model.generate` on the same batch (the alternative the engine's
hand-written sampling loop was chosen over).

    .venv/bin/python bench/local_engine.py [--requests 8,32,64] [--max-tokens 64] [--device auto]
        [--max-batch-size 64] [--threads N]

Prints a table and writes bench/results/local_engine.json. Every mode samples at
temperature 1 and returns the same things (ids and per-token logprobs). Runs in well under
two minutes on a CPU; on a GPU machine `--device auto` picks CUDA.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from rlcore.policy.local import ROW_BUCKET, LocalEngine  # noqa: E402
from rlcore.policy.tiny import ensure_tiny_model  # noqa: E402
from rlcore.types import SamplingParams  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "local_engine.json"


def benchmark_prompts(count: int) -> list[list[dict]]:
    """Distinct prompts of varied length, like a batch of rollouts of different examples."""
    return [
        [
            {"role": "system", "content": "You play tic-tac-toe. Answer with <move>N</move>."},
            {"role": "user", "content": f"Board {index}: " + "X.O" * (1 + index % 7)},
        ]
        for index in range(count)
    ]


async def run_batched(engine, prompts, sampling):
    return await asyncio.gather(*(engine.generate(p, sampling) for p in prompts))


async def run_one_at_a_time(engine, prompts, sampling):
    return [await engine.generate(p, sampling) for p in prompts]


def run_hf_generate(engine, prompts, sampling):
    """The same requests as one left-padded `model.generate` call, with per-token logprobs
    taken from the returned logits (what the engine would have to do on top of generate)."""
    prompt_ids = [engine.encode_prompt(p) for p in prompts]
    longest = max(len(ids) for ids in prompt_ids)
    input_ids = torch.full((len(prompt_ids), longest), engine.pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, ids in enumerate(prompt_ids):
        input_ids[row, longest - len(ids) :] = torch.tensor(ids)
        attention_mask[row, longest - len(ids) :] = 1
    with torch.no_grad():
        output = engine.model.generate(
            input_ids=input_ids.to(engine.device),
            attention_mask=attention_mask.to(engine.device),
            do_sample=True,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=0,
            max_new_tokens=sampling.max_tokens,
            eos_token_id=sorted(engine.eos_token_ids),
            pad_token_id=engine.pad_token_id,
            output_logits=True,
            return_dict_in_generate=True,
        )
    completions = output.sequences[:, longest:]
    logits = torch.stack(output.logits, dim=1).float() / sampling.temperature
    logprobs = torch.log_softmax(logits, dim=-1).gather(2, completions[..., None])[..., 0]
    tokens = 0
    for row in completions.tolist():
        length = len(row)
        for position, token in enumerate(row):
            if token in engine.eos_token_ids:
                length = position + 1
                break
        tokens += length
    assert torch.isfinite(logprobs).all()
    return tokens


def measure(label, requests, work):
    started = time.perf_counter()
    tokens = work()
    seconds = time.perf_counter() - started
    return {
        "mode": label,
        "requests": requests,
        "seconds": round(seconds, 4),
        "requests_per_s": round(requests / seconds, 2),
        "tokens": tokens,
        "tokens_per_s": round(tokens / seconds, 1),
    }


def compare(engine, requests: int, sampling: SamplingParams) -> dict:
    """The three modes on the same `requests` prompts, one after another."""
    prompts = benchmark_prompts(requests)
    # An untimed pass of each batched mode at this size, for the same first-use reason.
    asyncio.run(run_batched(engine, prompts, sampling))
    run_hf_generate(engine, prompts, sampling)

    def batched():
        batches_before = engine.batches_run
        generations = asyncio.run(run_batched(engine, prompts, sampling))
        batched.batches = engine.batches_run - batches_before
        return sum(g.completion_tokens for g in generations)

    def one_at_a_time():
        generations = asyncio.run(run_one_at_a_time(engine, prompts, sampling))
        return sum(g.completion_tokens for g in generations)

    rows = [
        measure("engine, batched", requests, batched),
        measure("engine, one at a time", requests, one_at_a_time),
        measure(
            "hf generate, batched", requests, lambda: run_hf_generate(engine, prompts, sampling)
        ),
    ]
    rows[0]["batches"] = batched.batches
    return {
        "requests": requests,
        "rows": rows,
        "batched_over_one_at_a_time": round(rows[0]["tokens_per_s"] / rows[1]["tokens_per_s"], 2),
        "engine_loop_over_hf_generate": round(rows[0]["tokens_per_s"] / rows[2]["tokens_per_s"], 2),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--requests", default="8,32,64", help="concurrent requests, one run per comma-separated N"
    )
    parser.add_argument("--max-tokens", type=int, default=64, help="max tokens per reply")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda")
    parser.add_argument(
        "--max-batch-size", type=int, default=64, help="the engine's max_batch_size"
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)"
    )
    parser.add_argument("--out", default=str(RESULTS), help="where to write the JSON results")
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.requests.split(",")]
    if args.threads:
        torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    engine = LocalEngine(
        ensure_tiny_model(), device=args.device, name="tiny", max_batch_size=args.max_batch_size
    )
    sampling = SamplingParams(temperature=1.0, max_tokens=args.max_tokens)
    # Steady state is what is measured: CUDA pays a first-use cost per new matrix shape, so
    # every batch size the engine can run (one, and multiples of ROW_BUCKET as finished rows
    # leave) is seen once before timing. A long job pays it once; a benchmark would pay it
    # in whichever mode ran first.
    asyncio.run(run_one_at_a_time(engine, benchmark_prompts(2), sampling))
    short = SamplingParams(temperature=1.0, max_tokens=4)
    for size in range(ROW_BUCKET, engine.max_batch_size + 1, ROW_BUCKET):
        asyncio.run(run_batched(engine, benchmark_prompts(size), short))
    runs = [compare(engine, count, sampling) for count in counts]

    device_name = (
        torch.cuda.get_device_name()
        if engine.device.startswith("cuda")
        else platform.processor() or platform.machine()
    )
    print(
        f"tiny model on {engine.device} ({device_name}), max_tokens={args.max_tokens}, "
        f"max_batch_size={engine.max_batch_size}, torch threads={torch.get_num_threads()}"
    )
    print(f"{'N':>4}  {'mode':<24}{'seconds':>9}{'req/s':>9}{'tokens':>8}{'tok/s':>10}{'ratio':>8}")
    for run in runs:
        for row in run["rows"]:
            ratio = row["tokens_per_s"] / run["rows"][1]["tokens_per_s"]
            print(
                f"{run['requests']:>4}  {row['mode']:<24}{row['seconds']:>9.3f}"
                f"{row['requests_per_s']:>9.1f}{row['tokens']:>8}{row['tokens_per_s']:>10.1f}"
                f"{ratio:>7.1f}x"
            )
    print("ratio: tokens/s relative to the engine serving the same requests one at a time")

    results = {
        "benchmark": "local_engine",
        "model": "tiny",
        "device": engine.device,
        "device_name": device_name,
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "max_tokens": args.max_tokens,
        "max_batch_size": engine.max_batch_size,
        "temperature": sampling.temperature,
        "runs": runs,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")
    return results


if __name__ == "__main__":
    main()
