"""The CPU decode attention kernel at this checkout against another's, in turn, on one machine.

    .venv/bin/python -m bench.decode_attention --before DIR [--repeats 5]

DIR is another checkout (a `git worktree` of the commit before a kernel change) with its
kernels built (`python -m executor_svc.cpu_kernels` there). Each repeat runs a fresh process
in each checkout, alternating which goes first; a process loads its checkout's kernels and
times `paged_decode_attention` over SmolLM2-135M's shapes (9 query heads, 3 KV heads of 64,
blocks of 16) for 30 layers, each layer's blocks scattered over a pool as an allocator leaves
them, two threads: the median of five calls of all 30 layers, per dtype and (sequences,
context). The larger cases' K/V (50-240 MB) come from DRAM, as inside the model; one
sequence's (4-11 MB) may stay in the last-level cache. Medians and the ratio within each
repeat.
Writes bench/results/decode_attention.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.common import markdown_table, write_results
from common.model_dirs import REPO_ROOT

CASES = ((1, 160), (1, 480), (4, 300), (16, 160), (16, 480), (64, 160))  # sequences, context

# Runs inside each checkout with its own kernels.
CHILD = """
import json, statistics, sys, time
import torch
from executor_svc import cpu_kernels
kernels = cpu_kernels.load()
assert kernels is not None, "this checkout's kernels are not built"
torch.set_num_threads(2)
heads, kv_heads, dim, block, layers = 9, 3, 64, 16, 30
out = {}
for dtype in (torch.bfloat16, torch.float32):
    for seqs, context in json.loads(sys.argv[1]):
        blocks = -(-context // block)
        pool = blocks * seqs * layers + 1
        gen = torch.Generator().manual_seed(seqs * 1000 + context)
        key = torch.randn(pool, block, kv_heads, dim, generator=gen).to(dtype)
        value = torch.randn(pool, block, kv_heads, dim, generator=gen).to(dtype)
        query = torch.randn(seqs, heads, dim, generator=gen).to(dtype)
        scattered = torch.randperm(pool - 1, generator=gen).to(torch.int32) + 1
        tables = [scattered[i * seqs * blocks:(i + 1) * seqs * blocks].view(seqs, blocks)
                  .contiguous() for i in range(layers)]
        rows, lens = torch.arange(seqs), torch.full((seqs,), context, dtype=torch.int32)
        result = torch.empty_like(query)
        times = []
        for _ in range(6):  # the first warms up
            start = time.perf_counter()
            for table in tables:
                kernels.paged_decode_attention(result, query, rows, key, value, table, lens,
                                               dim ** -0.5)
            times.append(time.perf_counter() - start)
        out[f"{str(dtype).removeprefix('torch.')}, {seqs} x {context}"] = (
            statistics.median(times[1:]) * 1e3)
print("AB_RESULT " + json.dumps(out))
"""


def run_child(checkout: Path) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(CASES)], cwd=checkout,
                          env=env, capture_output=True, text=True, check=False)
    for line in done.stdout.splitlines():
        if line.startswith("AB_RESULT "):
            return dict(json.loads(line.removeprefix("AB_RESULT ")))
    raise RuntimeError(f"{checkout} failed (exit {done.returncode}): {done.stderr[-2000:]}")


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.decode_attention", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True, help="the other checkout")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    checkouts = {"before": args.before.resolve(), "after": REPO_ROOT}
    runs: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    for rep in range(args.repeats):
        for side in ("before", "after") if rep % 2 == 0 else ("after", "before"):
            print(f"[decode_attention] rep {rep + 1}/{args.repeats}: {side}", file=sys.stderr,
                  flush=True)
            runs[side].append(run_child(checkouts[side]))
    rows: list[dict[str, Any]] = []
    for case in runs["after"][0]:
        before = [r[case] for r in runs["before"]]
        after = [r[case] for r in runs["after"]]
        ratios = [a / b for a, b in zip(after, before, strict=True)]
        rows.append({"dtype, sequences x context": case,
                     "before ms": round(statistics.median(before), 2),
                     "after ms": round(statistics.median(after), 2),
                     "after/before": round(statistics.median(ratios), 2),
                     "ratios": [round(r, 2) for r in ratios]})
    print(markdown_table(list(rows[0]), [list(r.values()) for r in rows]))
    write_results("decode_attention", {
        "before": str(checkouts["before"]), "after": str(checkouts["after"]), "threads": 2,
        "repeats": args.repeats, "layers": 30, "rows": rows, "samples_ms": runs,
    })
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
