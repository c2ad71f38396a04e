"""`python -m bench.run`: the benchmark suite (issue 5), quick by default, `--full` for all.

Runs every benchmark as its own process (a fresh interpreter and stack each; a crash in one
does not stop the others), in this order: KV utilisation, allocator, serving, prefix caching,
preemption, control plane. Each writes bench/results/<name>.json (and plots); this writes
bench/results/SUMMARY.md with every table they printed and bench/results/run.json with what
ran, how long it took and its exit status. The GPU benchmark (bench/gpu.py) is not part of it:
it needs a lent GPU machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from bench.common import RESULTS_DIR, machine

STEPS = (
    ("kv_utilisation", "KV memory utilisation (part 1)", False),
    ("allocator_bench", "Allocator hot path", False),
    ("rpc_floor", "The gRPC floor under both", False),
    ("serving", "End-to-end serving (part 2)", True),
    ("prefix_caching", "Prefix caching (part 3)", True),
    ("preemption", "Preemption (part 4)", True),
    ("control_plane", "Control plane (part 5)", True),
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--full", action="store_true", help="the full suite (much longer)")
    p.add_argument("--only", default="", help="comma-separated benchmark names")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads for the model benchmarks (baselines and executor)")
    args = p.parse_args(argv)
    selected = [s for s in STEPS if not args.only or s[0] in args.only.split(",")]
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    runs = []
    sections = []
    for name, title, takes_threads in selected:
        argv_step = [sys.executable, "-m", f"bench.{name}"]
        if not args.full:
            argv_step.append("--quick")
        if takes_threads:
            argv_step += ["--threads", str(args.threads)]
        print(f"== bench.run: {' '.join(argv_step[1:])}", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        proc = subprocess.run(argv_step, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
        seconds = time.perf_counter() - t0
        sys.stdout.write(proc.stdout)
        sys.stdout.flush()
        runs.append({"name": name, "argv": argv_step[1:], "seconds": round(seconds, 1),
                     "returncode": proc.returncode})
        tables = proc.stdout.strip() or "(no output)"
        status = "" if proc.returncode == 0 else f" - FAILED (exit {proc.returncode})"
        sections.append(f"## {title}{status}\n\n`python {' '.join(argv_step[1:])}` "
                        f"({seconds:.0f} s)\n\n{tables}\n")
    total = time.perf_counter() - started
    header = (f"# Benchmark summary ({'full' if args.full else 'quick'} suite)\n\n"
              f"`python -m bench.run{' --full' if args.full else ''}` on "
              f"{machine()['platform']}, {os.cpu_count()} CPUs, torch threads "
              f"{args.threads}; total {total:.0f} s; JSON per benchmark and plots in "
              "bench/results/.\n")
    (RESULTS_DIR / "SUMMARY.md").write_text("\n".join([header, *sections]))
    (RESULTS_DIR / "run.json").write_text(json.dumps(
        {"machine": machine(), "full": args.full, "threads": args.threads,
         "total_s": round(total, 1), "runs": runs}, indent=2))
    print(f"\nbench.run: {len(runs)} benchmarks in {total:.0f} s; "
          f"summary in {RESULTS_DIR / 'SUMMARY.md'}", file=sys.stderr)
    return 0 if all(r["returncode"] == 0 for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
