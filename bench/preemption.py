"""Preemption (issue 5, part 4): the KV pool shrinks from ample to 10% of demand.

    python -m bench.preemption [--quick]

One burst of mixed-length requests (the serving benchmark's `mixed` workload) arrives at once;
demand is the number of KV blocks they would hold if all ran together (sum of
ceil((prompt + output) / block_size)). For each pool size (executor `--num-blocks`, a fraction
of demand, never below the largest single request) and each preemption mode (gateway
`--preemption-mode recompute`, or `swap` with the executor's CPU swap space) a fresh stack
serves the burst. Reported: output tokens/s, completed requests, preemptions (allocator
GetStats), latency, and whether every request's greedy tokens equal those of the ample pool.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from typing import Any

from tqdm import tqdm

from bench.common import RESULTS_DIR, markdown_table, percentile, write_results
from bench.load import pool_stats, run_load, stack
from bench.serving import mixed_requests

MODEL = "models/small-llama"
SEED = 0
BLOCK_SIZE = 16


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.preemption", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--requests", type=int, default=None, help="default: 24 quick, 96 full")
    p.add_argument("--threads", type=int, default=1, help="executor torch threads")
    args = p.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    count = args.requests or (24 if args.quick else 96)
    fractions = [0.25, 0.1] if args.quick else [0.75, 0.5, 0.25, 0.1]
    reqs = mixed_requests(count, seed=SEED + 5)
    need = [math.ceil((len(r.prompt) + r.output_len) / BLOCK_SIZE) for r in reqs]
    demand = sum(need)
    floor_blocks = max(need) + 1
    configs: list[tuple[str, float, int]] = [("ample", 1.0, 0)]  # 0: the default pool
    for fraction in fractions:
        blocks = max(floor_blocks, round(demand * fraction))
        configs += [("recompute", fraction, blocks), ("swap", fraction, blocks)]
    rows: list[dict[str, Any]] = []
    reference: list[list[int]] | None = None
    for mode, fraction, blocks in tqdm(configs, desc="preemption", file=sys.stderr):
        executor_args = ["--num-blocks", str(blocks)] if blocks else []
        gateway_args = ["--preemption-mode", "swap" if mode == "swap" else "recompute"]
        with stack(MODEL, executor_args=executor_args, gateway_args=gateway_args,
                   seed=SEED) as running:
            run_load(running.gateway_addr, mixed_requests(4, seed=99), 4)  # warm-up
            before = sum(p.num_preemptions for p in pool_stats(running))
            results, wall = run_load(running.gateway_addr, reqs, concurrency=len(reqs),
                                     timeout_s=600)
            pools = pool_stats(running)
        preemptions = sum(p.num_preemptions for p in pools) - before
        ok = [r for r in results if r.ok]
        tokens = [r.tokens for r in results]
        if reference is None:
            reference = tokens
        latency = [r.last_s - r.sent_s for r in ok]
        rows.append({
            "mode": mode, "fraction_of_demand": fraction,
            "num_blocks": blocks or pools[0].num_blocks, "demand_blocks": demand,
            "completed": len(ok), "requests": len(results), "wall_s": wall,
            "tok_per_s": sum(len(r.tokens) for r in ok) / wall, "preemptions": preemptions,
            "ttft_p50_ms": percentile([r.ttft_s * 1e3 for r in ok], 50) if ok else None,
            "latency_p50_s": percentile(latency, 50) if ok else None,
            "latency_p99_s": percentile(latency, 99) if ok else None,
            "same_tokens_as_ample": sum(a == b for a, b in zip(tokens, reference, strict=True))
            / len(reqs),
            "errors": sorted({r.error for r in results if not r.ok})[:3],
        })
        row = rows[-1]
        print(f"[preemption] {mode} {fraction:.0%}: {row['tok_per_s']:.0f} tok/s, "
              f"{row['completed']}/{row['requests']} done, {preemptions} preemptions",
              file=sys.stderr, flush=True)
    ample = rows[0]["tok_per_s"]
    body = [[r["mode"], f"{r['fraction_of_demand']:.0%}", r["num_blocks"],
             f"{r['tok_per_s']:.0f}", f"{r['tok_per_s'] / ample:.2f}x",
             f"{r['completed']}/{r['requests']}", r["preemptions"],
             f"{r['latency_p50_s']:.1f}" if r["latency_p50_s"] is not None else "-",
             f"{r['latency_p99_s']:.1f}" if r["latency_p99_s"] is not None else "-",
             f"{r['same_tokens_as_ample']:.0%}"] for r in rows]
    print(f"### Preemption: {count} mixed requests at once, demand {demand} blocks "
          f"(block {BLOCK_SIZE}); pool as a share of demand\n")
    print(markdown_table(["mode", "pool", "blocks", "tok/s", "vs ample", "done", "preemptions",
                          "latency p50 s", "latency p99 s", "tokens = ample"], body))
    all_done = all(r["completed"] == r["requests"] for r in rows)
    print(f"\nEvery request completed in every configuration: {'yes' if all_done else 'NO'}")
    try:
        plots = plot(rows)
    except Exception as exc:  # noqa: BLE001 - a plot must not lose the figures
        print(f"plot failed: {exc!r}", file=sys.stderr)
        plots = []
    write_results("preemption", {
        "benchmark": "preemption", "model": MODEL, "seed": SEED + 5, "requests": count,
        "quick": args.quick, "torch_threads": args.threads, "demand_blocks": demand,
        "floor_blocks": floor_blocks, "rows": rows, "all_completed": all_done, "plots": plots,
        "mean_prompt": statistics.fmean(len(r.prompt) for r in reqs),
        "mean_output": statistics.fmean(r.output_len for r in reqs),
    })
    return 0


def plot(rows: list[dict[str, Any]]) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    ample = rows[0]
    for mode in ("recompute", "swap"):
        pts = sorted([(1.0, ample["tok_per_s"])] + [
            (r["fraction_of_demand"], r["tok_per_s"]) for r in rows if r["mode"] == mode])
        ax.plot([x * 100 for x, _ in pts], [y for _, y in pts], marker="o", label=mode)
    ax.set_xlabel("KV pool, % of demand")
    ax.set_ylabel("output tokens/s")
    ax.set_title("Throughput as the KV pool shrinks")
    ax.invert_xaxis()
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = str(RESULTS_DIR / "preemption.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


if __name__ == "__main__":
    raise SystemExit(main())
