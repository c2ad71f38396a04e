"""Where one decode step's time goes, by operator, per dtype: the executor's runner in process
under torch.profiler.

    .venv/bin/python -m bench.step_profile [--dtypes float32,bfloat16] [--batches 1,64]

For each dtype and batch: the executor's runner as `python -m executor_svc` builds it (the
embedded SmolLM2-135M, two threads, malloc tuned), N sequences of 160 tokens of context, one
warm-up decode step, then STEPS decode steps timed plain and STEPS more under the profiler.
Reported per step: the plain wall time, and each operator's self CPU time (the profiler's
`self_cpu_time_total` / STEPS), largest first, with its share of the profiled step's wall
time (the C++ kernels of executor_svc/cpu_kernels as `pagedkv::<kernel>`, wrapped here in
profiler ranges), and the rest of that step (Python, the profiler's own cost); the tokens
of both dtypes are not compared (bf16 rounds differently: tests/executor/test_bfloat16.py).
Writes bench/results/step_profile.json.
"""

from __future__ import annotations

from executor_svc.malloc_tuning import tune_malloc

tune_malloc()  # before torch allocates, as executor_svc/__main__.py does

import argparse  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

from bench.common import markdown_table, write_results  # noqa: E402
from bench.fused_layers import CONTEXT, _admit, _prompts  # noqa: E402
from common.model_dirs import DEFAULT_MODEL, REPO_ROOT  # noqa: E402
from executor_svc import cpu_kernels  # noqa: E402
from executor_svc.runner import ModelRunner, build_runner  # noqa: E402
from executor_svc.settings import ExecutorSettings  # noqa: E402
from executor_svc.step import SequenceWork, StepRequest  # noqa: E402

STEPS = 4
TOP = 14
# The C++ kernels the layers call (executor_svc/cpu_kernels), named for the profiler.
KERNELS = ("paged_decode_attention", "rms_norm", "silu_mul", "rotary_", "argmax_logsumexp",
           "mkl_packed_linear")


def name_kernels() -> None:
    """Wrap each C++ kernel in a profiler range, here only: the layers call them through the
    module's attributes, and the executor itself pays nothing for this."""
    module = cpu_kernels.load()
    if module is None:
        return
    for name in KERNELS:
        kernel = getattr(module, name, None)
        if kernel is None or getattr(kernel, "named", False):
            continue

        def named(*args: object, _kernel=kernel, _name=f"pagedkv::{name}") -> object:
            with record_function(_name):
                return _kernel(*args)

        named.named = True  # type: ignore[attr-defined]
        setattr(module, name, named)


def build(dtype: str) -> ModelRunner:
    return build_runner(ExecutorSettings(
        model=str(DEFAULT_MODEL), seed=0, dtype=dtype, kv_cache_memory=2**30, swap_space=0.0,
        max_num_batched_tokens=2048))


def decode_steps(runner: ModelRunner, ids: list[str], first: int, count: int) -> None:
    for step in range(count):
        seqs = tuple(SequenceWork(i, (5,), CONTEXT + first + step, None, None, True)
                     for i in ids)
        runner.execute(StepRequest(seqs=seqs))


def profile_batch(runner: ModelRunner, batch: int) -> dict[str, object]:
    prompts = _prompts(batch, batch, CONTEXT, runner.info.vocab_size)
    ids = _admit(runner, f"p{batch}", prompts, 1 + 2 * STEPS)
    decode_steps(runner, ids, 0, 1)  # warm-up
    start = time.perf_counter()
    decode_steps(runner, ids, 1, STEPS)
    wall_ms = (time.perf_counter() - start) / STEPS * 1e3
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        decode_steps(runner, ids, 1 + STEPS, STEPS)
        profiled_us = (time.perf_counter() - start) / STEPS * 1e6
    runner.release(tuple(ids))
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0
              and e.key != "cudaDeviceSynchronize"]
    events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    ops_us = sum(e.self_cpu_time_total for e in events) / STEPS
    ops = [{"op": e.key, "ms_per_step": round(e.self_cpu_time_total / STEPS / 1e3, 3),
            "share": round(e.self_cpu_time_total / STEPS / profiled_us, 3),
            "calls_per_step": e.count // STEPS} for e in events[:TOP]]
    rest_us = max(0.0, profiled_us - ops_us)
    ops.append({"op": "(outside every operator and kernel: Python, the profiler)",
                "ms_per_step": round(rest_us / 1e3, 3), "share": round(rest_us / profiled_us, 3),
                "calls_per_step": 0})
    return {"batch": batch, "wall_ms": round(wall_ms, 2),
            "profiled_ms": round(profiled_us / 1e3, 2), "ops": ops}


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.step_profile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    name_kernels()
    results = []
    for dtype in args.dtypes.split(","):
        runner = build(dtype)
        for batch in (int(b) for b in args.batches.split(",")):
            row = {"dtype": dtype, **profile_batch(runner, batch)}
            results.append(row)
            print(f"\n### {dtype}, decode step of {batch}: {row['wall_ms']} ms "
                  f"({row['profiled_ms']} ms under the profiler)\n")
            print(markdown_table(["op", "ms/step", "share", "calls/step"],
                                 [list(op.values()) for op in row["ops"]]))  # type: ignore[attr-defined]
        del runner
    path = write_results("step_profile", {"model": str(DEFAULT_MODEL.relative_to(REPO_ROOT)),
                                          "threads": args.threads, "steps": STEPS,
                                          "context": CONTEXT, "rows": results})
    print(f"\nwrote {path.relative_to(REPO_ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
