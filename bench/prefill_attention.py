"""The CPU prefill attention kernel against torch's SDPA, for prompts with no cached prefix.

    .venv/bin/python -m bench.prefill_attention [--repeats 5]

One layer of SmolLM2-135M's attention (9 query heads, 3 KV heads, head dim 64), two threads:
`prefill_attention` (cpu_kernels/csrc/prefill_attention.cpp: all prompts in one call over
their packed rows) against `F.scaled_dot_product_attention` (is_causal, enable_gqa) on the
same prompts as a [B, H, L, D] batch of equal lengths, the way the torch backend calls it.
Shapes: 1 x 128 tokens (a first token at concurrency 1), 16 x 128 (a prefill step of the
equal workload), 1 x 512 and 1 x 2,048; float32 and bfloat16. Each repeat times 30 calls of
each in turn (the order alternating), medians; the kernel / SDPA ratio of each repeat. The
outputs are checked against each other first. Writes bench/results/prefill_attention.json.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from bench.common import markdown_table, write_results
from executor_svc.cpu_kernels import load as load_kernels

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
SHAPES = ((1, 128), (16, 128), (1, 512), (1, 2048))
CALLS = 30


def median_us(call: Callable[[], object]) -> float:
    times = []
    for _ in range(CALLS):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.prefill_attention",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    kernels = load_kernels()
    if kernels is None:
        raise SystemExit("the CPU kernels did not build: run `make setup` first")
    torch.set_num_threads(2)
    gen = torch.Generator().manual_seed(0)
    scale = HEAD_DIM**-0.5
    results, table = {}, []
    for dtype in (torch.float32, torch.bfloat16):
        for count, length in SHAPES:
            rows = count * length
            q, k, v = (torch.randn(rows, heads, HEAD_DIM, generator=gen).to(dtype)
                       for heads in (HEADS, KV_HEADS, KV_HEADS))
            starts = torch.arange(count, dtype=torch.long) * length
            lengths = torch.full((count,), length, dtype=torch.long)
            out = torch.empty_like(q)
            qb, kb, vb = (t.unflatten(0, (count, length)).transpose(1, 2) for t in (q, k, v))

            def kernel() -> None:
                kernels.prefill_attention(out, q, k, v, starts, lengths, scale)  # noqa: B023

            def sdpa() -> torch.Tensor:
                return F.scaled_dot_product_attention(qb, kb, vb, is_causal=True,  # noqa: B023
                                                      scale=scale, enable_gqa=True)

            kernel()
            expected = sdpa().transpose(1, 2).flatten(0, 1)
            tolerance = 1e-4 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(out.float(), expected.float(), rtol=tolerance,
                                       atol=tolerance)
            samples: dict[str, list[float]] = {"kernel": [], "sdpa": []}
            for repeat in range(args.repeats):
                order = (("kernel", kernel), ("sdpa", sdpa))
                for name, call in order if repeat % 2 == 0 else order[::-1]:
                    samples[name].append(median_us(call))
            ratios = [a / b for a, b in zip(samples["kernel"], samples["sdpa"], strict=True)]
            key = f"{str(dtype).removeprefix('torch.')} {count} x {length}"
            results[key] = {**samples, "ratios": ratios}
            table.append([key, f"{statistics.median(samples['kernel']):.0f}",
                          f"{statistics.median(samples['sdpa']):.0f}",
                          f"{statistics.median(ratios):.2f}",
                          " ".join(f"{r:.2f}" for r in ratios)])
            print(table[-1], flush=True)
    print(markdown_table(["dtype, prompts x tokens", "kernel us", "SDPA us",
                          "kernel / SDPA", "each repeat"], table))
    path = write_results("prefill_attention", {
        "benchmark": "prefill_attention", "repeats": args.repeats, "calls": CALLS,
        "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "us": results})
    print(f"written to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
