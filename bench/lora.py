"""Multi-LoRA serving: what adapters cost, same run.

    python -m bench.lora [--repeats 3] [--rank 8] [--dtype float32]

The embedded SmolLM2-135M-Instruct with its real weights, the whole stack, bench.vs_vllm's
mixed workload (64 requests of random token ids, greedy, ignore_eos) at concurrency 16, a
fresh stack per configuration and repeat, the order reversed every other repeat:
  base        LoRA off (the defaults)
  lora-on     --max-loras 4 --max-lora-rank `--rank` (slots the adapters' size: a larger
              one pads each with zeros, which are read and multiplied) with four adapters
              loaded, every request of the base model: what LoRA costs requests without one
  1-adapter   every request of one adapter
  4-adapters  the requests spread over four adapters (one step holds rows of each: the
              grouped product, executor_svc/lora.py)
The adapters are PEFT adapters of seeded random weights (tools/make_lora_adapter.py, rank
`--rank`, every projection), loaded by --lora-modules. Reported: output tok/s (medians over
repeats, each repeat's ratio to base), the inter-token time per request, and whether lora-on's
outputs equal base's (they must: no adapter rows, no adapter arithmetic). Writes
bench/results/lora.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.common import markdown_table, percentile, write_results
from bench.load import run_load, stack
from bench.vs_vllm import mixed_requests
from common.model_dirs import DEFAULT_MODEL
from tools.make_lora_adapter import make_adapter

CONFIGS = ("base", "lora-on", "1-adapter", "4-adapters")
NUM_ADAPTERS = 4


def run_one(config: str, adapters: dict[str, Path], rank: int, dtype: str, num_requests: int,
            width: int) -> dict[str, Any]:
    requests = mixed_requests(num_requests, seed=7)
    executor_args = ["--dtype", dtype]
    if config != "base":
        modules = ",".join(f"{name}={path}" for name, path in adapters.items())
        executor_args += ["--max-loras", str(NUM_ADAPTERS), "--max-lora-rank", str(rank),
                          "--lora-modules", modules]
    names = sorted(adapters)
    if config == "1-adapter":
        requests = [replace(r, model=names[0]) for r in requests]
    elif config == "4-adapters":
        requests = [replace(r, model=names[i % len(names)]) for i, r in enumerate(requests)]
    with stack(str(DEFAULT_MODEL), executor_args=executor_args, load_format="auto") as running:
        run_load(running.gateway_addr, mixed_requests(4, seed=99), 4)  # warm-up
        results, wall = run_load(running.gateway_addr, requests, concurrency=width)
    ok = [r for r in results if r.ok]
    itl = [t for r in ok if (t := r.tpot_s) is not None]
    return {"config": config, "completed": len(ok), "requests": len(results),
            "tok_per_s": sum(len(r.tokens) for r in ok) / wall,
            "itl_p50_ms": percentile(itl, 50) * 1e3 if itl else None,
            "tokens": [r.tokens for r in results],
            "errors": sorted({r.error for r in results if not r.ok})[:3]}


def summarise(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    per = {c: [r for r in runs if r["config"] == c] for c in CONFIGS}
    rows = []
    for config in CONFIGS:
        ratios = [b["tok_per_s"] / a["tok_per_s"]
                  for a, b in zip(per["base"], per[config], strict=True)]
        rows.append({
            "config": config,
            "tok_per_s": statistics.median(r["tok_per_s"] for r in per[config]),
            "ratios": [round(x, 3) for x in ratios], "ratio": statistics.median(ratios),
            "itl_p50_ms": statistics.median(r["itl_p50_ms"] for r in per[config]),
            "completed": all(r["completed"] == r["requests"] for r in per[config]),
        })
    same = all(a["tokens"] == b["tokens"] for a in per["base"] for b in per["lora-on"])
    return [{**row, "identical_to_base": same if row["config"] == "lora-on" else None}
            for row in rows]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.lora", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--quick", action="store_true", help="one repeat, 16 requests")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    root = Path(tempfile.mkdtemp(prefix="pagedkv-bench-lora-"))
    adapters = {f"adapter{i}": make_adapter(DEFAULT_MODEL, root / f"adapter{i}", rank=args.rank,
                                            seed=i + 1) for i in range(NUM_ADAPTERS)}
    runs = []
    for repeat in range(1 if args.quick else args.repeats):
        order = CONFIGS if repeat % 2 == 0 else CONFIGS[::-1]
        for config in order:
            print(f"repeat {repeat}: {config}", file=sys.stderr, flush=True)
            runs.append(run_one(config, adapters, args.rank, args.dtype,
                                16 if args.quick else 64, 16))
    rows = summarise(runs)
    print(markdown_table(
        ["configuration", "tok/s", "/base (each repeat)", "ITL p50 ms", "completed",
         "outputs = base"],
        [[r["config"], f"{r['tok_per_s']:.1f}",
          f"{r['ratio']:.2f} ({' / '.join(map(str, r['ratios']))})",
          f"{r['itl_p50_ms']:.1f}", r["completed"],
          "" if r["identical_to_base"] is None else r["identical_to_base"]] for r in rows]))
    for run in runs:
        run.pop("tokens")
    write_results("lora", {"model": str(DEFAULT_MODEL), "dtype": args.dtype, "rank": args.rank,
                           "num_adapters": NUM_ADAPTERS, "repeats": args.repeats, "rows": rows,
                           "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
