"""The gateway scheduler's three calls per step, in process, at N running decodes.

    python -m bench.scheduler_phases [--running 64,256] [--steps 40]

The scheduler meets the real allocator core and a fake executor (tests/gateway/in_process.py,
the scheduler tests' harness), in the engine's pipelined order. N requests (16-token prompts)
decode together. Reported: the median per step of `schedule` (off the step's path when
pipelined: it overlaps the Execute), then `apply_result`, `apply_outcome` and `launch`, which
run between one Execute's return and the next one's send.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import markdown_table, write_results
from gateway.api.sampling import SamplingOptions
from gateway.core.batch import Budget
from gateway.core.request_state import Request
from gateway.core.scheduler import Scheduler
from gateway.engine.router import initial_sequences

PHASES = ("schedule", "apply_result", "apply_outcome", "launch")
BLOCK = 16
PROMPT = 16
# The scheduler tests' harness (the real allocator core, a fake executor), importable here.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "gateway"))


def _timed(fn: Callable[..., Any], into: list[float]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            into.append((time.perf_counter() - t0) * 1e6)

    return wrapper


def measure(running: int, steps: int) -> dict[str, float]:
    from in_process import CorePool, FakeModel
    from test_scheduler import drive

    sched = Scheduler(budget=Budget(max_num_seqs=running,
                                    max_num_batched_tokens=PROMPT * running),
                      block_size=BLOCK)
    for i in range(running):
        prompt = [1 + (i * 13 + j) % 29000 for j in range(PROMPT)]
        request = Request(request_id=f"r{i}", prompt_token_ids=prompt,
                          sampling=SamplingOptions(max_tokens=steps + 8), cache_salt="")
        for seq in initial_sequences(request):
            sched.add(seq)
    times: dict[str, list[float]] = {name: [] for name in PHASES}
    originals = {name: getattr(Scheduler, name) for name in PHASES}
    try:
        for name in PHASES:
            setattr(Scheduler, name, _timed(originals[name], times[name]))
        # Blocks for every request's whole length: no preemption, all N decode throughout.
        blocks_each = math.ceil((PROMPT + steps + 8) / BLOCK) + 1
        drive(sched, CorePool(num_blocks=running * blocks_each, block_size=BLOCK),
              FakeModel(block_size=BLOCK, vocab_size=30000), pipelined=True)
    finally:
        for name, original in originals.items():
            setattr(Scheduler, name, original)
    # The steps in which all N decode: after the prefill step, before the first finishes.
    return {name: statistics.median(times[name][2:steps]) for name in PHASES}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.scheduler_phases", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--running", default="64,256")
    p.add_argument("--steps", type=int, default=40, help="decode steps to time (>= 3)")
    args = p.parse_args(argv)
    if args.steps < 3:
        p.error("--steps must be at least 3 (the first two are the prefill and its follow-up)")
    rows, results = [], []
    for n in (int(x) for x in args.running.split(",")):
        med = measure(n, args.steps)
        results.append({"running": n, "median_us": med})
        on_path = med["apply_result"] + med["apply_outcome"] + med["launch"]
        rows.append([n, *(f"{med[name]:.1f}" for name in PHASES), f"{on_path:.1f}"])
    print("### Scheduler calls per step, in process (median us)\n")
    print(markdown_table(["running", *PHASES, "on the step's path"], rows))
    write_results("scheduler_phases", {"benchmark": "scheduler_phases", "steps": args.steps,
                                       "rows": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
