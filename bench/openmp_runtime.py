"""The whole stack's throughput under OpenMP runtime settings, interleaved in one run.

vLLM's CPU benchmark gives its engine Intel OpenMP, thread binding and tcmalloc; the services
here share two cores with the executor's OpenMP threads. This measures whether the executor's
runtime settings move the stack's throughput: each variant's environment goes to all three
services (each a fresh stack per repeat, variants in turn, the order reversed every other
repeat), 64 requests of a workload at once through the unary gRPC API after 8 to warm up.

    .venv/bin/python -m bench.openmp_runtime --variants default,passive,bind,iomp \\
        --workload mixed --dtype bfloat16 --repeats 3

Variants: default (torch's GNU OpenMP as it comes, every service at --nice 0), passive
(OMP_WAIT_POLICY=PASSIVE: idle threads sleep instead of spinning), bind (OMP_PROC_BIND=close,
OMP_PLACES=cores), iomp (Intel OpenMP from .venv-vllm preloaded, KMP_AFFINITY compact; make
bench-vllm builds it), nice10 (PAGEDKV_NICE=10: the gateway and the allocator behind the
executor's threads). Writes bench/results/openmp_runtime.json (medians and every repeat;
`--name` for another name).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Any

from bench.common import write_results
from bench.load import run_load, stack
from bench.vs_vllm import equal_requests, mixed_requests
from common.model_dirs import DEFAULT_MODEL, REPO_ROOT

IOMP = REPO_ROOT / ".venv-vllm" / "lib" / "libiomp5.so"
VARIANTS: dict[str, dict[str, str]] = {
    "default": {},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "bind": {"OMP_PROC_BIND": "close", "OMP_PLACES": "cores"},
    "iomp": {"LD_PRELOAD": str(IOMP), "KMP_AFFINITY": "granularity=fine,compact,1,0"},
    "nice10": {"PAGEDKV_NICE": "10"},
}
WORKLOADS = {"mixed": mixed_requests, "equal": equal_requests}
NUM_REQUESTS = 64


def one_run(variant: str, workload: str, dtype: str, repeat: int) -> float:
    """Output tok/s of one fresh stack started with the variant's environment."""
    saved = dict(os.environ)
    os.environ.update(VARIANTS[variant])  # the services inherit it
    try:
        with stack(str(DEFAULT_MODEL), executor_args=("--dtype", dtype),
                   load_format="auto") as running:
            os.environ.clear()
            os.environ.update(saved)
            make = WORKLOADS[workload]
            run_load(running.gateway_addr, make(8, 100 + repeat), concurrency=8, unary=True,
                     salt="warm-up")
            requests = make(NUM_REQUESTS, repeat)
            results, wall = run_load(running.gateway_addr, requests, concurrency=NUM_REQUESTS,
                                     unary=True, salt=f"{variant}-{repeat}")
    finally:
        os.environ.clear()
        os.environ.update(saved)
    failed = [r.error for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"{variant}: {len(failed)} requests failed, e.g. {failed[0]}")
    return sum(r.output_len for r in requests) / wall


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.openmp_runtime", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="default,passive,bind,iomp")
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="mixed")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--name", default="openmp_runtime", help="the results file's name")
    args = p.parse_args(argv)
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        p.error(f"unknown variant {unknown[0]!r}; choose from {', '.join(VARIANTS)}")
    if "iomp" in names and not IOMP.exists():
        p.error(f"{IOMP} is missing: `make bench-vllm` builds .venv-vllm")
    rates: dict[str, list[float]] = {n: [] for n in names}
    for repeat in range(args.repeats):
        for name in names if repeat % 2 == 0 else names[::-1]:
            rates[name].append(one_run(name, args.workload, args.dtype, repeat))
            print(f"[openmp_runtime] {name} repeat {repeat + 1}: {rates[name][-1]:.1f} tok/s",
                  file=sys.stderr, flush=True)
    base = rates.get("default")
    rows: dict[str, Any] = {}
    for name, samples in rates.items():
        rows[name] = {"tok_per_s": statistics.median(samples), "samples": samples}
        if base:
            rows[name]["ratio_to_default"] = [s / b for s, b in zip(samples, base, strict=True)]
    path = write_results(args.name, {"benchmark": "openmp_runtime",
                                            "workload": args.workload, "dtype": args.dtype,
                                            "num_requests": NUM_REQUESTS, "variants": rows})
    for name, row in rows.items():
        print(f"{name}: {row['tok_per_s']:.1f} tok/s", flush=True)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
