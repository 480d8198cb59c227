"""The tiny model's captured decode step with cuBLAS's matrix products (the shipped step)
against small-grid Triton products, alone on the card and with other processes replaying
the same step beside it, as a data-parallel run's ranks share one card through MPS.

    python3 bench/decode_products.py [--model tiny-master] [--rows 8,128] [--neighbours 0,7]
        [--replays 300] [--out PATH]

An experiment, not a shipped path: the fifty-first session's profile of a rank's 1,024-game
rollout (8 ranks on one H100) saw the decode step's fp32 products run as kernels spread over
the whole card (grid 1 x 1 x 264, ~50 us a launch whatever the rows), and the fifty-second
session's per-rank SM limits made every step faster. If products whose grid fits the work
(a few dozen programs for the tiny model's 128-row step) let the ranks' steps run side by
side, the 1,024-game step, which is bound by the shared card, gains more than the 64-game
one. "triton" swaps every product the captured step makes (the q/k/v, o, gate/up and down
projections and the head) for `rows_linear` below; the rest of the step is the shipped one.

For each variant and row count: a StaticDecoder (CUDA graphs, the fused kernels) generates
one round of `rows` prompts (never stopping, sampled), which captures its steps; then
`--replays` replays of one captured step are timed (its state put back before each), first
alone, then with each count of `--neighbours` processes replaying their own copy nonstop
beside it. The check: greedy replies of both variants on the same prompts (tokens equal,
largest logprob gap). A profile of ten replays alone lists each variant's kernels (grid,
microseconds). MPS: the run's own daemon, as the lab starts one (distributed.share_card).
Writes bench/results/decode_products_<device>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from benchlib import write_results  # noqa: E402

from rlcore.policy.static_decode import DecodeRequest, StaticDecoder  # noqa: E402
from rlcore.train.common import load_model_and_tokenizer  # noqa: E402
from rlcore.train.distributed import share_card  # noqa: E402

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

PROMPT = (
    "You play X. Board:\n. X O\n. O .\nX . .\nReply with the square you take, 1-9, "
    "in <move></move> tags."
)
NEW_TOKENS = 24
VARIANTS = ("cublas", "triton")

if triton is not None:

    @triton.jit
    def _rows_linear_kernel(x, w, out, M, N, x_row, w_row, out_row, K: tl.constexpr,
                            IEEE: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr):  # fmt: skip
        """out[M, N] = x[M, K] @ w[N, K]^T, one BLOCK_M x BLOCK_N tile a program."""
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for start in tl.static_range(0, K, BLOCK_K):  # K known: unrolled
            ks = start + tl.arange(0, BLOCK_K)
            a = tl.load(
                x + rows[:, None] * x_row + ks[None, :],
                mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0,
            )  # fmt: skip
            b = tl.load(
                w + cols[None, :] * w_row + ks[:, None],
                mask=(cols[None, :] < N) & (ks[:, None] < K), other=0.0,
            )  # fmt: skip
            if IEEE:  # float32 as float32, as cuBLAS multiplies it without TF32
                acc += tl.dot(a, b, input_precision="ieee")
            else:
                acc += tl.dot(a, b)
        inside = (rows[:, None] < M) & (cols[None, :] < N)
        tl.store(
            out + rows[:, None] * out_row + cols[None, :], acc.to(out.dtype.element_ty),
            mask=inside,
        )  # fmt: skip


def rows_linear(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    """F.linear over the rows of `x` ([M, K]) with a grid of ceil(M / 64) x ceil(N / 64)
    programs (bias added after)."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    (m, k), n = x.shape, weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_m = min(64, max(16, triton.next_power_of_2(m)))
    block_n, block_k = 64, 32
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _rows_linear_kernel[grid](
        x, weight, out, m, n, x.stride(0), weight.stride(0), out.stride(0), K=k,
        IEEE=x.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip
    return out if bias is None else out.add_(bias)


class TritonProducts:
    """While entered, the products of a CUDA graph being captured (two-dimensional inputs)
    run through rows_linear; everything else, the prefill included, keeps F.linear."""

    def __init__(self) -> None:
        self.swapped = 0

    def __enter__(self):
        self.original = F.linear

        def linear(x, weight, bias=None):
            if x.dim() == 2 and x.is_cuda and torch.cuda.is_current_stream_capturing():
                self.swapped += 1
                return rows_linear(x, weight, bias)
            return self.original(x, weight, bias)

        F.linear = linear  # static_decode's F and nn.Linear.forward's are this module
        return self

    def __exit__(self, *exc) -> None:
        F.linear = self.original


def install() -> None:
    """Every StaticDecoder of this process captures its steps with rows_linear's products.
    For whole runs (bench/rl_processes.py): a `sitecustomize.py` on PYTHONPATH that calls
    this puts it in each rank, as the spawned ranks import it too (docs/BENCHMARKS.md,
    fifty-sixth session)."""
    original = StaticDecoder._capture

    def capture(self, ws, key):
        with TritonProducts():
            return original(self, ws, key)

    StaticDecoder._capture = capture
    print(f"rows_linear products in process {os.getpid()}", file=sys.stderr)


def build(model_name: str, variant: str, rows: int, temperature: float = 1.0):
    """A decoder of `variant` that has captured its step for `rows` rows, and the replies."""
    model, tokenizer = load_model_and_tokenizer(model_name, torch.device("cuda"))
    model.eval()
    decoder = StaticDecoder(model, [], tokenizer.pad_token_id or 0, use_graphs=True)
    ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    requests = [
        DecodeRequest(ids + [ids[row % len(ids)]], temperature, 1.0, row, NEW_TOKENS)
        for row in range(rows)
    ]
    swap = TritonProducts() if variant == "triton" else contextlib.nullcontext()
    with torch.no_grad(), swap:
        replies = decoder.generate(requests)
    if variant == "triton" and not swap.swapped:
        raise RuntimeError("no product was swapped: the step was not captured")
    return decoder, replies


def timed_replays(decoder, rows: int, replays: int) -> list[float]:
    """Microseconds a replay of the captured step for `rows` rows, in blocks of 10."""
    key = [key for key in decoder.graphs if key[0] == rows][-1]  # the widest captured
    graph, ws = decoder.graphs[key], decoder.workspace
    saved = ws.save()
    times = []
    for _ in range(max(1, replays // 10)):
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(10):
            ws.restore(saved)
            graph.replay()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - started) / 10 * 1e6)
    ws.restore(saved)
    return times


def neighbour(model_name: str, variant: str, rows: int, ready, stop) -> None:
    decoder, _ = build(model_name, variant, rows)
    timed_replays(decoder, rows, 20)
    ready.release()
    while not stop.is_set():
        timed_replays(decoder, rows, 50)


def kernels_of(decoder, rows: int) -> list[dict]:
    """Each kernel of ten replays alone: name, grid, count, mean microseconds."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        timed_replays(decoder, rows, 10)
    with tempfile.NamedTemporaryFile(suffix=".json") as trace:
        prof.export_chrome_trace(trace.name)
        events = json.loads(Path(trace.name).read_text())["traceEvents"]
    by_kernel = defaultdict(list)
    for event in events:
        if event.get("cat") == "kernel":
            grid = tuple(event.get("args", {}).get("grid", ()))
            by_kernel[(event["name"][:90], grid)].append(event["dur"])
    rows_out = [
        {"kernel": name, "grid": list(grid), "count": len(durs), "mean_us": statistics.fmean(durs)}
        for (name, grid), durs in by_kernel.items()
    ]
    return sorted(rows_out, key=lambda r: -r["count"] * r["mean_us"])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-master")
    parser.add_argument("--rows", default="8,128", help="rows a step, comma-separated")
    parser.add_argument("--neighbours", default="0,7", help="processes beside, comma-separated")
    parser.add_argument("--replays", type=int, default=300, help="timed replays a row")
    parser.add_argument("--out", default=None, help="JSON path")
    args = parser.parse_args(argv)
    if triton is None or torch.cuda.device_count() == 0:
        raise SystemExit("decode_products needs a CUDA card and Triton")
    row_counts = [int(r) for r in args.rows.split(",")]
    neighbour_counts = [int(n) for n in args.neighbours.split(",")]
    mps = share_card("cuda", 1 + max(neighbour_counts))
    print(mps or "no MPS")
    card = torch.cuda.get_device_name(0)
    context = mp.get_context("spawn")
    results = {"card": card, "mps": mps, "model": args.model, "rows": []}
    for rows in row_counts:
        greedy = {v: build(args.model, v, rows, temperature=0.0)[1] for v in VARIANTS}
        same = [a[0] for a in greedy["cublas"]] == [b[0] for b in greedy["triton"]]
        gap = max(
            abs(x - y)
            for a, b in zip(greedy["cublas"], greedy["triton"], strict=True)
            for x, y in zip(a[1], b[1], strict=False)
        )
        print(f"{rows} rows: greedy replies the same: {same}; largest logprob gap {gap:.2e}")
        for variant in VARIANTS:
            decoder, _ = build(args.model, variant, rows)
            try:
                profile_rows = kernels_of(decoder, rows)
            except Exception as error:  # the profile is a diagnostic: the timings go on
                print(f"    no kernel profile: {error!r}")
                profile_rows = []
            for count in neighbour_counts:
                ready, stop = context.Semaphore(0), context.Event()
                others = [
                    context.Process(target=neighbour, args=(args.model, variant, rows, ready, stop))
                    for _ in range(count)
                ]
                for process in others:
                    process.start()
                for _ in others:
                    ready.acquire()
                times = timed_replays(decoder, rows, args.replays)
                stop.set()
                for process in others:
                    process.join()
                row = {
                    "variant": variant, "rows": rows, "neighbours": count,
                    "replay_us_median": statistics.median(times), "replay_us_min": min(times),
                    "greedy_same": same, "logprob_gap": gap,
                    "kernels": profile_rows if count == neighbour_counts[0] else None,
                }  # fmt: skip
                results["rows"].append(row)
                print(
                    f"{variant:7} rows {rows:4} neighbours {count:2}: "
                    f"{row['replay_us_median']:8.1f} us a step (min {row['replay_us_min']:.1f})"
                )
            for kernel in profile_rows[:6]:
                print(
                    f"    {kernel['count']:4} x {kernel['mean_us']:6.1f} us grid "
                    f"{kernel['grid']} {kernel['kernel'][:70]}"
                )
            del decoder
            torch.cuda.empty_cache()
    print(f"\ncaptured decode step, {args.model}, {card}")
    print(f"{'rows':>5} {'neighbours':>10} {'cublas us':>10} {'triton us':>10} {'speed-up':>9}")
    for rows in row_counts:
        for count in neighbour_counts:
            pick = {
                r["variant"]: r["replay_us_median"]
                for r in results["rows"]
                if r["rows"] == rows and r["neighbours"] == count
            }
            print(
                f"{rows:5} {count:10} {pick['cublas']:10.1f} {pick['triton']:10.1f} "
                f"{pick['cublas'] / pick['triton']:8.2f}x"
            )
    return write_results(results, args.out, "decode_products_cuda.json")


if __name__ == "__main__":
    main()
