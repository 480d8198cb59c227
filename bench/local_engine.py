"""Decode speed of the local engine: the static decoder (CUDA graphs over a static KV
cache), the dynamic loop it replaced on GPUs, and Hugging Face `model.generate`, on the
same prompts in one process, against the memory roofline.

    python bench/local_engine.py [--device auto] [--models tiny,qwen2-0.5b]
        [--batches 1,32,256] [--max-tokens 128] [--repeats 3] [--out PATH]

Models: `tiny`, the built-in tiny model (1.1 M parameters), and `qwen2-0.5b`, Qwen2-0.5B's
config (hidden 896, 24 layers, 14 heads, 2 KV heads, MLP 4864, vocabulary 151,936: 494 M
parameters) with random weights, built on the fly and served with the tiny tokenizer
(which reads none of the ids past its 295 when decoding text). bf16 on CUDA, fp32 on CPU.
Every row decodes exactly `--max-tokens` tokens (eos ignored), at temperature 1, so the
three modes do the same work; tokens/s counts generated tokens over the whole call,
prefill included. Each figure is the median of `--repeats` timed runs after one untimed
run at the same size (graphs captured, kernels chosen).

Roofline: one decode step must read every weight once and the rows' KV cache (at the mean
context of the run), so tokens/s cannot exceed rows / ((weight bytes + KV bytes) /
bandwidth); the bandwidth is measured in the same run, as a device-to-device copy
(bytes read + written). After timing, a greedy check: the static decoder's replies to a
fixed prompt set against the dynamic loop's (identical replies, largest logprob gap), in
fp32 and in bf16, all in one batch and the first 8 one at a time (the one-row step). Prints a table and writes JSON (bench/results/local_engine_<device>.json).
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from benchlib import write_results  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config  # noqa: E402

from rlcore.policy.local import LocalEngine  # noqa: E402
from rlcore.policy.tiny import ensure_tiny_model  # noqa: E402
from rlcore.types import SamplingParams  # noqa: E402

QWEN2_05B = {
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}


def benchmark_prompts(count: int) -> list[list[dict]]:
    """Distinct prompts of varied length, like a batch of rollouts of different examples."""
    return [
        [
            {"role": "system", "content": "You play tic-tac-toe. Answer with <move>N</move>."},
            {"role": "user", "content": f"Board {index}: " + "X.O" * (1 + index % 7)},
        ]
        for index in range(count)
    ]


def load_model(name: str, device: str, dtype):
    """(model, tokenizer) for `name`, on `device` in `dtype`."""
    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model())
    if name == "tiny":
        model = AutoModelForCausalLM.from_pretrained(ensure_tiny_model(), dtype=dtype)
    elif name == "qwen2-0.5b":
        torch.manual_seed(0)
        config = Qwen2Config(
            **QWEN2_05B,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    else:
        raise SystemExit(f"unknown model {name!r}; accepted: tiny, qwen2-0.5b")
    return model.to(device).eval(), tokenizer


def engine_for(model, tokenizer, decode: str, ignore_eos: bool) -> LocalEngine:
    # No prefix store: each repeat prefills its prompts again, as plain `generate` does (a
    # repeat's prompts would otherwise come from the store, all but their last token).
    engine = LocalEngine(
        model=model, tokenizer=tokenizer, name=decode, decode=decode, prefix_cache_bytes=0
    )
    engine.max_batch_size = 4096
    if ignore_eos:
        engine.eos_token_ids = set()
    return engine


async def run_batched(engine, prompts, sampling):
    return await asyncio.gather(*(engine.generate(p, sampling) for p in prompts))


def run_engine(engine, prompts, sampling) -> int:
    generations = asyncio.run(run_batched(engine, prompts, sampling))
    return sum(g.completion_tokens for g in generations)


def run_hf_generate(engine, prompts, sampling) -> int:
    """The same requests as one left-padded `model.generate` call (eos suppressed until
    max_tokens), with each token's logprob taken from the returned logits one step at a
    time (what the engine would have to do on top of generate)."""
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
            top_p=1.0,
            top_k=0,
            max_new_tokens=sampling.max_tokens,
            min_new_tokens=sampling.max_tokens,
            pad_token_id=engine.pad_token_id,
            output_logits=True,
            return_dict_in_generate=True,
        )
        completions = output.sequences[:, longest:]
        total = 0.0
        for step, logits in enumerate(output.logits):
            scaled = torch.log_softmax(logits.float() / sampling.temperature, dim=-1)
            total += scaled.gather(1, completions[:, step, None]).sum()
        assert torch.isfinite(torch.as_tensor(total)).all()
    return completions.numel()


def timed(device: str, work) -> tuple[float, int]:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    started = time.perf_counter()
    tokens = work()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - started, tokens


def copy_bandwidth(device: str) -> float:
    """Bytes per second of a large device-to-device copy, read plus written (median of 10)."""
    size = (1 << 30) if device.startswith("cuda") else (1 << 27)
    source = torch.randn(size // 4, device=device)
    target = torch.empty_like(source)

    def copy() -> int:
        target.copy_(source)
        return 0

    times = [timed(device, copy)[0] for _ in range(12)]
    return 2 * size / statistics.median(times[2:])


def roofline_tokens_per_s(model, rows, prompt_tokens, max_tokens, bandwidth) -> float:
    """rows / (bytes one decode step must read / bandwidth): every weight once (tied ones
    once) and the rows' K and V at the run's mean context."""
    config = model.config
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    element = next(model.parameters()).element_size()
    kv_per_token = 2 * config.num_hidden_layers * kv_heads * head_dim * element
    mean_context = prompt_tokens + max_tokens / 2
    step_bytes = weight_bytes + rows * mean_context * kv_per_token
    return rows / (step_bytes / bandwidth)


def compare_replies(expected, got) -> tuple[int, float, list[int]]:
    """How many replies are identical, the largest logprob gap over the tokens they share,
    and where each of the others first differs."""
    identical, gap, first_divergence = 0, 0.0, []
    for theirs, mine in zip(expected, got, strict=True):
        common = 0
        shorter = min(len(mine.completion_ids), len(theirs.completion_ids))
        while common < shorter and mine.completion_ids[common] == theirs.completion_ids[common]:
            common += 1
        if mine.completion_ids == theirs.completion_ids:
            identical += 1
        else:
            first_divergence.append(common)
        for a, b in zip(mine.logprobs[:common], theirs.logprobs[:common], strict=True):
            gap = max(gap, abs(a - b))
    return identical, gap, first_divergence


def greedy_check(
    name: str, device: str, dtype, prompts: int = 32, tokens: int = 64, one_row: int = 8
) -> dict:
    """The static decoder's greedy replies against the dynamic loop's, same prompts: all
    in one batch, and the first `one_row` one at a time (a decode step of one row)."""
    model, tokenizer = load_model(name, device, dtype)
    greedy = SamplingParams(temperature=0.0, max_tokens=tokens)
    replies, alone = {}, {}
    for decode in ("dynamic", "static"):
        engine = engine_for(model, tokenizer, decode, ignore_eos=False)
        replies[decode] = asyncio.run(run_batched(engine, benchmark_prompts(prompts), greedy))
        alone[decode] = [
            asyncio.run(run_batched(engine, [prompt], greedy))[0]
            for prompt in benchmark_prompts(one_row)
        ]
    identical, gap, first_divergence = compare_replies(replies["dynamic"], replies["static"])
    alone_identical, alone_gap, _ = compare_replies(alone["dynamic"], alone["static"])
    return {
        "model": name,
        "dtype": str(dtype).replace("torch.", ""),
        "prompts": prompts,
        "max_tokens": tokens,
        "identical_replies": identical,
        "first_divergence_at": first_divergence,
        "max_logprob_gap": gap,
        "one_row_prompts": one_row,
        "one_row_identical_replies": alone_identical,
        "one_row_max_logprob_gap": alone_gap,
    }


def measure_model(name, device, dtype, batches, max_tokens, repeats, modes, bandwidth):
    model, tokenizer = load_model(name, device, dtype)
    sampling = SamplingParams(temperature=1.0, max_tokens=max_tokens)
    engines = {
        mode: engine_for(model, tokenizer, mode, ignore_eos=True)
        for mode in modes
        if mode != "generate"
    }
    any_engine = next(iter(engines.values())) if engines else engine_for(model, tokenizer, "dynamic", True)  # fmt: skip
    rows_out = []
    for rows in batches:
        prompts = benchmark_prompts(rows)
        prompt_tokens = statistics.mean(len(any_engine.encode_prompt(p)) for p in prompts)
        roofline = roofline_tokens_per_s(model, rows, prompt_tokens, max_tokens, bandwidth)
        for mode in modes:
            if mode == "generate":

                def work(prompts=prompts):
                    return run_hf_generate(any_engine, prompts, sampling)

            else:

                def work(engine=engines[mode], prompts=prompts):
                    return run_engine(engine, prompts, sampling)

            timed(device, work)  # untimed: graphs captured, kernels chosen
            runs = [timed(device, work) for _ in range(repeats)]
            seconds = statistics.median(s for s, _ in runs)
            tokens = runs[0][1]
            rows_out.append(
                {
                    "model": name,
                    "mode": mode,
                    "rows": rows,
                    "seconds": round(seconds, 4),
                    "tokens": tokens,
                    "tokens_per_s": round(tokens / seconds, 1),
                    "ms_per_step": round(1000 * seconds / max_tokens, 3),
                    "roofline_tokens_per_s": round(roofline, 1),
                    "percent_of_roofline": round(100 * tokens / seconds / roofline, 2),
                }
            )
            print(
                f"  {name} {mode:<8} rows {rows:>4}: {tokens / seconds:>12,.0f} tok/s", flush=True
            )
    parameters = sum(p.numel() for p in model.parameters())
    del engines, model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return parameters, rows_out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda")
    parser.add_argument(
        "--models", default=None, help="tiny, qwen2-0.5b (default: both on CUDA, tiny on CPU)"
    )
    parser.add_argument("--batches", default="1,32,256", help="rows per batch, comma-separated")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens decoded per row")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per figure")
    parser.add_argument(
        "--modes", default="static,dynamic,generate", help="static, dynamic, generate"
    )
    parser.add_argument("--skip-check", action="store_true", help="no greedy check")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--out", default=None, help="JSON path (default by device)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    models = (args.models or ("tiny,qwen2-0.5b" if device.startswith("cuda") else "tiny")).split(
        ","
    )
    batches = [int(n) for n in args.batches.split(",")]
    modes = args.modes.split(",")
    card = (
        torch.cuda.get_device_name()
        if device.startswith("cuda")
        else platform.processor() or platform.machine()
    )
    print(f"device {device} ({card}), torch {torch.__version__}", flush=True)

    bandwidth = copy_bandwidth(device)
    print(f"  copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + written)", flush=True)
    rows, parameters = [], {}
    for name in models:
        parameters[name], model_rows = measure_model(
            name, device, dtype, batches, args.max_tokens, args.repeats, modes, bandwidth
        )
        rows += model_rows
    # The greedy checks after the timings: on an H200 a 256-row run timed after them once
    # came out at half its speed (docs/BENCHMARKS.md, seventeenth session; not traced).
    checks = []
    if not args.skip_check:
        for name in models:
            for check_dtype in dict.fromkeys([torch.float32, dtype]):
                checks.append(greedy_check(name, device, check_dtype))
                print(f"  greedy check: {checks[-1]}", flush=True)

    print(
        f"\n{args.max_tokens} tokens per row, temperature 1, eos ignored; {device} ({card}); "
        f"copy bandwidth {bandwidth / 1e12:.2f} TB/s"
    )
    header = (
        f"{'card':<22}{'model':<12}{'rows':>5}  {'mode':<9}{'tok/s':>12}{'ms/step':>9}"
        f"{'roofline':>9}{'vs dynamic':>11}{'vs generate':>12}"
    )
    print(header)
    for row in rows:
        same = [r for r in rows if r["model"] == row["model"] and r["rows"] == row["rows"]]
        base = {r["mode"]: r["tokens_per_s"] for r in same}
        ratio = {
            mode: f"{row['tokens_per_s'] / base[mode]:.2f}x" if mode in base else "-"
            for mode in ("dynamic", "generate")
        }
        print(
            f"{card[:21]:<22}{row['model']:<12}{row['rows']:>5}  {row['mode']:<9}"
            f"{row['tokens_per_s']:>12,.0f}{row['ms_per_step']:>9.2f}"
            f"{row['percent_of_roofline']:>8.1f}%{ratio['dynamic']:>11}{ratio['generate']:>12}"
        )
        row["card"] = card
    for check in checks:
        print(
            f"greedy check {check['model']} {check['dtype']}: {check['identical_replies']} of "
            f"{check['prompts']} replies identical to the dynamic loop's, largest logprob gap "
            f"{check['max_logprob_gap']:.2e} (first divergences at {check['first_divergence_at']}); "
            f"one row at a time: {check['one_row_identical_replies']} of "
            f"{check['one_row_prompts']} identical, gap {check['one_row_max_logprob_gap']:.2e}"
        )
    results = {
        "benchmark": "local_engine",
        "device": device,
        "card": card,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "copy_bandwidth_bytes_per_s": round(bandwidth),
        "parameters": parameters,
        "greedy_checks": checks,
        "rows": rows,
    }
    return write_results(results, args.out, f"local_engine_{device.split(':')[0]}.json")


if __name__ == "__main__":
    main()
