"""The executor's steps at this checkout against another, in turn, on one machine.

    .venv/bin/python -m bench.ab_steps --before DIR [--dtype bfloat16] [--repeats 3]

One lever at a time is judged by this: DIR is another checkout of the project (a `git
worktree` of the commit before the change, its stubs generated or linked), and each repeat
runs a fresh process in each checkout, alternating which goes first. A process builds the
executor's runner as `python -m executor_svc` does (two threads, malloc tuned) and times, as
`bench.vs_vllm_steps` does: one prefill step of 16 x 128 tokens, decode steps of 1, 16 and 64
sequences at 160 tokens of context, and the mixed and equal workloads (64 requests, fresh
prompts each repeat, the same in both checkouts) through its steps in a plain loop. Medians
and the ratio within each repeat; outputs compared. Writes bench/results/ab_steps_<dtype>.json.
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
from common.model_dirs import DEFAULT_MODEL, REPO_ROOT

# Runs inside each checkout with its own code: only names both sides have.
CHILD = """
import json, sys
from executor_svc.malloc_tuning import tune_malloc
tune_malloc()
import torch
from bench import vs_vllm_steps
from bench.vs_vllm import REQUESTS_PER_RUN
from executor_svc.runner import build_runner
from executor_svc.settings import ExecutorSettings
model, dtype, rep = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.set_num_threads(2)
runner = build_runner(ExecutorSettings(model=model, seed=0, dtype=dtype, kv_cache_memory=2**30,
                                       swap_space=0.0, max_num_batched_tokens=2048))
vs_vllm_steps.pagedkv_steps(runner, 99)  # warm-up
out = {"steps_ms": {k: v * 1e3 for k, v in vs_vllm_steps.pagedkv_steps(runner, rep).items()},
       "tok_per_s": {}, "outputs": {}}
for name, make in vs_vllm_steps.WORKLOADS.items():
    requests = make(REQUESTS_PER_RUN, 100 + rep)
    outputs, wall = vs_vllm_steps.run_workload(runner, requests)
    out["tok_per_s"][name] = sum(r.output_len for r in requests) / wall
    out["outputs"][name] = outputs
print("AB_RESULT " + json.dumps(out))
"""


def run_child(checkout: Path, dtype: str, rep: int) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(DEFAULT_MODEL), dtype, str(rep)], cwd=checkout,
        env=env, capture_output=True, text=True, check=False)
    for line in done.stdout.splitlines():
        if line.startswith("AB_RESULT "):
            return json.loads(line.removeprefix("AB_RESULT "))
    raise RuntimeError(f"{checkout} failed (exit {done.returncode}): {done.stderr[-2000:]}")


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ab_steps", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True, help="the other checkout")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    checkouts = {"before": args.before.resolve(), "after": REPO_ROOT}
    runs: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
    for rep in range(args.repeats):
        order = ("before", "after") if rep % 2 == 0 else ("after", "before")
        for side in order:
            print(f"[ab_steps] {args.dtype} rep {rep + 1}/{args.repeats}: {side}",
                  file=sys.stderr, flush=True)
            runs[side].append(run_child(checkouts[side], args.dtype, rep))
    rows = []
    for kind, unit in (("steps_ms", "ms"), ("tok_per_s", "tok/s")):
        for name in runs["after"][0][kind]:
            before = [r[kind][name] for r in runs["before"]]
            after = [r[kind][name] for r in runs["after"]]
            ratios = [a / b for a, b in zip(after, before, strict=True)]
            rows.append({"what": f"{name} ({unit})", "before": round(statistics.median(before), 1),
                         "after": round(statistics.median(after), 1),
                         "after/before": round(statistics.median(ratios), 3),
                         "ratios": [round(r, 3) for r in ratios]})
    identical = {name: sum(a == b for rb, ra in zip(runs["before"], runs["after"], strict=True)
                           for a, b in zip(ra["outputs"][name], rb["outputs"][name], strict=True))
                 for name in runs["after"][0]["outputs"]}
    total = {name: sum(len(r["outputs"][name]) for r in runs["after"]) for name in identical}
    print(markdown_table(list(rows[0]), [list(r.values()) for r in rows]))
    print("outputs identical: " + ", ".join(f"{n} {identical[n]}/{total[n]}" for n in identical))
    write_results(f"ab_steps_{args.dtype}", {
        "before": str(checkouts["before"]), "after": str(checkouts["after"]), "dtype": args.dtype,
        "threads": 2, "repeats": args.repeats, "rows": rows,
        "outputs_identical": {n: [identical[n], total[n]] for n in identical},
        "samples": {side: [{k: r[k] for k in ("steps_ms", "tok_per_s")} for r in got]
                    for side, got in runs.items()},
    })
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
