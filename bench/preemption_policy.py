"""Whom to preempt: the allocator's `--preemption-policy cost` against `tail`, same run.

    python -m bench.preemption_policy [--quick] [--repeats N]

The overload workload of bench.preemption (one burst of mixed-length requests, the KV pool a
fraction of their demand) in each preemption mode (gateway `--preemption-mode`); for each
repeat, a fresh stack per policy, the two policies' order reversed every other repeat.
Reported per configuration: output tok/s and TTFT p50 (medians over repeats, with each
repeat's cost / tail ratio), the tokens computed again after recompute preemptions (the
allocator's resumed prefix lookups less their hits), the blocks swapped out and back in,
preemptions, and whether every request's greedy tokens equal the tail policy's.

`--shared-prefix N`: each prompt starts with one of four N-token system prompts (chats behind
shared instructions), so that a victim's leading blocks may be held by others and found
cached again: what the cost policy counts and the tail policy does not.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import sys
from typing import Any

from bench.baselines import BenchRequest
from bench.common import markdown_table, percentile, write_results
from bench.load import pool_stats, run_load, stack
from bench.serving import mixed_requests

MODEL = "models/small-llama"
SEED = 5  # bench.preemption's workload
BLOCK_SIZE = 16
POLICIES = ("tail", "cost")


def run_one(reqs: list[Any], mode: str, policy: str, blocks: int) -> dict[str, Any]:
    with stack(MODEL, executor_args=["--num-blocks", str(blocks)],
               gateway_args=["--preemption-mode", mode],
               allocator_args=["--preemption-policy", policy], seed=0) as running:
        run_load(running.gateway_addr, mixed_requests(4, seed=99), 4)  # warm-up
        before = pool_stats(running)[0]
        results, wall = run_load(running.gateway_addr, reqs, concurrency=len(reqs),
                                 timeout_s=900)
        after = pool_stats(running)[0]
    ok = [r for r in results if r.ok]

    def delta(name: str) -> int:
        return int(getattr(after, name) - getattr(before, name))

    return {
        "mode": mode, "policy": policy, "num_blocks": blocks,
        "completed": len(ok), "requests": len(results), "wall_s": wall,
        "tok_per_s": sum(len(r.tokens) for r in ok) / wall,
        "ttft_p50_s": percentile([r.ttft_s for r in ok], 50) if ok else None,
        "preemptions": delta("num_preemptions"),
        "recomputed_tokens": delta("num_resumed_prefix_queries")
        - delta("num_resumed_prefix_hits"),
        "swapped_blocks": delta("num_swapped_out_blocks") + delta("num_swapped_in_blocks"),
        "tokens": [r.tokens for r in results],
        "errors": sorted({r.error for r in results if not r.ok})[:3],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.preemption_policy", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="24 requests, the pool at 10%%")
    p.add_argument("--requests", type=int, default=None, help="default: 24 quick, 96 full")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--modes", default="recompute,swap")
    p.add_argument("--threads", type=int, default=1, help="executor torch threads")
    p.add_argument("--shared-prefix", type=int, default=0, metavar="N",
                   help="tokens of a system prompt (one of four) before every prompt")
    p.add_argument("--fractions", default=None, help="pool sizes as shares of demand "
                   "(default: 0.1 quick, 0.25,0.1 full)")
    args = p.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    count = args.requests or (24 if args.quick else 96)
    fractions = ([float(f) for f in args.fractions.split(",")] if args.fractions
                 else [0.1] if args.quick else [0.25, 0.1])
    reqs = mixed_requests(count, seed=SEED)
    if args.shared_prefix:
        rng = random.Random(SEED)
        systems = [[1, *(rng.randrange(3, 500) for _ in range(args.shared_prefix - 1))]
                   for _ in range(4)]
        reqs = [BenchRequest([*systems[i % 4], *r.prompt[1:]], r.output_len)
                for i, r in enumerate(reqs)]
    need = [math.ceil((len(r.prompt) + r.output_len) / BLOCK_SIZE) for r in reqs]
    demand, floor_blocks = sum(need), max(need) + 1
    runs: list[dict[str, Any]] = []
    for fraction in fractions:
        blocks = max(floor_blocks, round(demand * fraction))
        for mode in args.modes.split(","):
            for repeat in range(args.repeats):
                order = POLICIES if repeat % 2 == 0 else POLICIES[::-1]
                for policy in order:
                    run = run_one(reqs, mode, policy, blocks)
                    runs.append({**run, "fraction_of_demand": fraction, "repeat": repeat})
                    print(f"[preemption_policy] {mode} {fraction:.0%} #{repeat} {policy}: "
                          f"{run['tok_per_s']:.0f} tok/s, {run['preemptions']} preemptions, "
                          f"{run['recomputed_tokens']} recomputed, {run['swapped_blocks']} "
                          "blocks swapped", file=sys.stderr, flush=True)
    rows = summarise(runs)
    print(f"### Preemption policy: {count} mixed requests at once, demand {demand} blocks "
          f"(block {BLOCK_SIZE}), medians of {args.repeats} repeats\n")
    print(markdown_table(
        ["mode", "pool", "policy", "tok/s", "cost/tail each repeat", "TTFT p50 s",
         "recomputed tokens", "blocks swapped", "preemptions", "done", "tokens = tail's"],
        [[r["mode"], f"{r['fraction_of_demand']:.0%}", r["policy"], f"{r['tok_per_s']:.0f}",
          " ".join(f"{x:.2f}" for x in r["ratios"]) or "-", f"{r['ttft_p50_s']:.2f}",
          r["recomputed_tokens"], r["swapped_blocks"], r["preemptions"],
          f"{r['completed']}/{r['requests']}", f"{r['same_tokens_as_tail']:.0%}"]
         for r in rows]))
    for run in runs:
        del run["tokens"]
    write_results("preemption_policy" + (f"_prefix{args.shared_prefix}"
                                         if args.shared_prefix else ""), {
        "benchmark": "preemption_policy", "model": MODEL, "seed": SEED, "requests": count,
        "repeats": args.repeats, "torch_threads": args.threads, "demand_blocks": demand,
        "shared_prefix": args.shared_prefix,
        "rows": rows, "runs": runs,
    })
    return 0


def summarise(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (fraction, mode, policy): medians, and each repeat's ratio to tail."""
    rows = []
    keys = dict.fromkeys((r["fraction_of_demand"], r["mode"]) for r in runs)
    for fraction, mode in keys:
        group = [r for r in runs if (r["fraction_of_demand"], r["mode"]) == (fraction, mode)]
        tail = {r["repeat"]: r for r in group if r["policy"] == "tail"}
        for policy in POLICIES:
            mine = [r for r in group if r["policy"] == policy]
            same = [sum(a == b for a, b in zip(r["tokens"], tail[r["repeat"]]["tokens"],
                                               strict=True)) / len(r["tokens"]) for r in mine]
            rows.append({
                "fraction_of_demand": fraction, "mode": mode, "policy": policy,
                "tok_per_s": statistics.median(r["tok_per_s"] for r in mine),
                "ratios": [r["tok_per_s"] / tail[r["repeat"]]["tok_per_s"] for r in mine]
                if policy != "tail" else [],
                "ttft_p50_s": statistics.median(r["ttft_p50_s"] or 0.0 for r in mine),
                "recomputed_tokens": statistics.median(r["recomputed_tokens"] for r in mine),
                "swapped_blocks": statistics.median(r["swapped_blocks"] for r in mine),
                "preemptions": statistics.median(r["preemptions"] for r in mine),
                "completed": min(r["completed"] for r in mine),
                "requests": mine[0]["requests"],
                "same_tokens_as_tail": min(same),
            })
    return rows


if __name__ == "__main__":
    sys.exit(main())
