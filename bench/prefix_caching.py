"""Prefix caching: a long shared system prompt, caching on vs off.

    python -m bench.prefix_caching [--quick] [--model DIR]

The model is the embedded SmolLM2-135M-Instruct with its real weights unless --model names a
preset (then seeded dummy weights).

Every request's prompt is one shared system prompt (90% of its tokens) followed by a distinct
user part (10%); outputs are short (greedy, ignore_eos), so time to first token is mostly the
prompt's prefill. Two stacks run side by side, identical but for the gateway's
`--enable-prefix-caching`; each gets one warm-up request carrying the system prompt, then the
same requests, closed loop at concurrency 1 (pure TTFT) and 8 (throughput). Runs alternate
between the two stacks; medians over repeats. The hit rate is the allocator's own count
(GetStats: prompt tokens served from cache / prompt tokens looked up) over the measured
requests.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
from pathlib import Path
from typing import Any

import torch  # noqa: F401 - imported for the machine description (bench.common)
from tqdm import tqdm

from bench.baselines import BenchRequest
from bench.common import RESULTS_DIR, markdown_table, percentile, write_results
from bench.load import pool_stats, run_load, stack
from common.model_dirs import DEFAULT_MODEL, ModelDir
from tools.launch import Stack

SEED = 0
SHARED_FRACTION = 0.9
TARGET = 8.0  # the limit is ~9-10x: a tenth of the tokens to prefill, over the whole context
FIRST_ID = 17  # below: special tokens in SmolLM2's vocabulary (3 and up in the presets')


def make_requests(count: int, prompt_len: int, output_len: int, seed: int, vocab: int
                  ) -> tuple[list[int], list[BenchRequest]]:
    """The same system prompt every time (seeded by SEED); user parts seeded by `seed`."""
    shared_len = round(prompt_len * SHARED_FRACTION)
    system_rng = random.Random(SEED)
    system = [system_rng.randrange(FIRST_ID, vocab) for _ in range(shared_len)]
    rng = random.Random(seed)
    reqs = [BenchRequest(system + [rng.randrange(FIRST_ID, vocab) for _ in range(prompt_len
                                                                                 - shared_len)],
                         output_len) for _ in range(count)]
    return system, reqs


def _counters(running: Stack) -> tuple[int, int]:
    pools = pool_stats(running)
    return sum(p.num_prefix_hits for p in pools), sum(p.num_prefix_queries for p in pools)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.prefix_caching", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--repeats", type=int, default=None, help="default: 2 quick, 3 full")
    p.add_argument("--threads", type=int, default=1, help="executor torch threads")
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="model directory")
    args = p.parse_args(argv)
    model = args.model
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    load_format = "auto" if ModelDir.inspect(model).weight_files else "dummy"
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    repeats = args.repeats or (2 if args.quick else 3)
    plan = [(1, 8), (8, 24)] if args.quick else [(1, 16), (8, 64), (32, 128)]
    modes = {"on": "true", "off": "false"}
    samples: dict[tuple[str, int], list[dict[str, float]]] = {}
    tokens: dict[tuple[str, int], list[list[int]]] = {}
    with stack(model, seed=SEED, gateway_args=("--enable-prefix-caching", "true"),
               load_format=load_format) as on, \
            stack(model, seed=SEED, gateway_args=("--enable-prefix-caching", "false"),
                  load_format=load_format) as off:
        stacks = {"on": on, "off": off}
        system, _ = make_requests(1, args.prompt_len, args.output_len, SEED, vocab)
        for running in stacks.values():  # warm-up: the system prompt (+ a suffix) once
            run_load(running.gateway_addr, [BenchRequest(system + [7, 8, 9], 4)], 1)
        bar = tqdm(total=repeats * len(plan) * 2, desc="prefix caching", file=sys.stderr)
        for rep in range(repeats):
            for concurrency, count in plan:
                _, reqs = make_requests(count, args.prompt_len, args.output_len,
                                        SEED + 1000 * rep + concurrency, vocab)
                order = ("on", "off") if rep % 2 == 0 else ("off", "on")
                for mode in order:
                    running = stacks[mode]
                    hits0, queries0 = _counters(running)
                    results, wall = run_load(running.gateway_addr, reqs, concurrency)
                    hits1, queries1 = _counters(running)
                    ok = [r for r in results if r.ok]
                    ttft = [r.ttft_s * 1e3 for r in ok]
                    samples.setdefault((mode, concurrency), []).append({
                        "ttft_p50_ms": percentile(ttft, 50),
                        "ttft_p99_ms": percentile(ttft, 99),
                        "req_per_s": len(ok) / wall,
                        "tok_per_s": sum(len(r.tokens) for r in ok) / wall,
                        "prompt_tok_per_s": len(ok) * args.prompt_len / wall,
                        "hit_rate": (hits1 - hits0) / max(1, queries1 - queries0),
                        "completed": len(ok), "requests": len(results),
                    })
                    tokens.setdefault((mode, concurrency), []).extend(r.tokens for r in results)
                    bar.update(1)
        bar.close()
    rows, out_rows = [], []
    for concurrency, count in plan:
        med = {mode: {k: statistics.median(s[k] for s in samples[(mode, concurrency)])
                      for k in samples[(mode, concurrency)][0]} for mode in modes}
        same = sum(a == b for a, b in zip(tokens[("on", concurrency)],
                                          tokens[("off", concurrency)], strict=True))
        speedup = med["off"]["ttft_p50_ms"] / med["on"]["ttft_p50_ms"]
        rows.append({"concurrency": concurrency, "requests": count, **{m: med[m] for m in modes},
                     "ttft_speedup": speedup, "same_tokens": same / len(tokens[("on",
                                                                                concurrency)]),
                     "samples": {m: samples[(m, concurrency)] for m in modes}})
        for mode in modes:
            m = med[mode]
            out_rows.append([concurrency, mode, f"{m['hit_rate']:.1%}", f"{m['ttft_p50_ms']:.0f}",
                             f"{m['ttft_p99_ms']:.0f}", f"{m['req_per_s']:.2f}",
                             f"{m['prompt_tok_per_s']:.0f}", f"{m['tok_per_s']:.0f}",
                             f"{m['completed']:.0f}/{m['requests']:.0f}",
                             f"{speedup:.1f}x" if mode == "on" else ""])
    table = markdown_table(["concurrency", "caching", "hit rate", "TTFT p50 ms", "TTFT p99 ms",
                            "req/s", "prompt tok/s", "output tok/s", "done",
                            "TTFT off/on"], out_rows)
    at1 = rows[0]["ttft_speedup"]
    print(f"### Prefix caching: {args.prompt_len}-token prompts, {SHARED_FRACTION:.0%} shared, "
          f"{args.output_len} new tokens\n")
    print(table)
    print(f"\nTarget TTFT >= {TARGET:g}x lower with caching on (concurrency 1): {at1:.1f}x - "
          f"{'met' if at1 >= TARGET else 'MISSED'}; same tokens on/off: "
          f"{statistics.fmean(r['same_tokens'] for r in rows):.0%}")
    try:
        plots = plot(rows)
    except Exception as exc:  # noqa: BLE001 - a plot must not lose the figures
        print(f"plot failed: {exc!r}", file=sys.stderr)
        plots = []
    write_results("prefix_caching", {
        "benchmark": "prefix_caching", "model": Path(model).name, "load_format": load_format,
        "seed": SEED,
        "prompt_len": args.prompt_len, "shared_fraction": SHARED_FRACTION,
        "output_len": args.output_len, "repeats": repeats, "quick": args.quick,
        "torch_threads": args.threads, "rows": rows, "target_ttft_speedup": TARGET,
        "met": at1 >= TARGET, "plots": plots,
    })
    return 0


def plot(rows: list[dict[str, Any]]) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    labels = [f"c={r['concurrency']}" for r in rows]
    xs = range(len(rows))
    width = 0.38
    ax.bar([x - width / 2 for x in xs], [r["off"]["ttft_p50_ms"] for r in rows], width,
           label="caching off")
    ax.bar([x + width / 2 for x in xs], [r["on"]["ttft_p50_ms"] for r in rows], width,
           label="caching on")
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("TTFT p50 (ms)")
    ax.set_yscale("log")
    ax.set_title("TTFT with and without prefix caching (90% shared prompt)")
    ax.legend()
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    path = str(RESULTS_DIR / "prefix_caching_ttft.png")
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


if __name__ == "__main__":
    raise SystemExit(main())
