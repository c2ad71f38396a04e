"""Which dtype the executor's steps are fastest in on this CPU: what `--dtype auto` picks.

    .venv/bin/python -m bench.auto_dtype [--repeats 3]

The embedded SmolLM2-135M's steps in process (bench.vs_vllm_steps' shapes: one 2,048-token
prefill step, decode steps of 1, 16 and 64 sequences at 160 tokens), float32 and bfloat16
runners interleaved, medians and each repeat's ratio (float32 time / bfloat16 time: above 1,
bfloat16 is faster). Records the CPU and what `auto` resolves to here. Writes
bench/results/auto_dtype.json.
"""

from __future__ import annotations

from executor_svc.malloc_tuning import tune_malloc

tune_malloc()  # before torch allocates, as executor_svc/__main__.py does

import argparse  # noqa: E402
import statistics  # noqa: E402

import torch  # noqa: E402

from bench import fused_layers  # noqa: E402
from bench.common import markdown_table, write_results  # noqa: E402
from bench.vs_vllm_steps import pagedkv_steps  # noqa: E402
from common.model_dirs import DEFAULT_MODEL  # noqa: E402
from executor_svc.model_loader import dtype_name, resolve_dtype  # noqa: E402

DTYPES = ("float32", "bfloat16")


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.auto_dtype", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(2)
    runners = {dtype: fused_layers.build(str(DEFAULT_MODEL), dtype=dtype) for dtype in DTYPES}
    for runner in runners.values():
        pagedkv_steps(runner, 99)  # warm-up
    times: dict[str, dict[str, list[float]]] = {dtype: {} for dtype in DTYPES}
    for repeat in range(args.repeats):
        order = DTYPES if repeat % 2 == 0 else DTYPES[::-1]
        for dtype in order:
            for step, seconds in pagedkv_steps(runners[dtype], repeat).items():
                times[dtype].setdefault(step, []).append(seconds)
    rows, payload_steps = [], {}
    for step in times["float32"]:
        fp32, bf16 = times["float32"][step], times["bfloat16"][step]
        ratios = [a / b for a, b in zip(fp32, bf16, strict=True)]
        payload_steps[step] = {"float32_s": fp32, "bfloat16_s": bf16, "ratios": ratios}
        rows.append([step, f"{statistics.median(fp32) * 1e3:.1f}",
                     f"{statistics.median(bf16) * 1e3:.1f}", f"{statistics.median(ratios):.2f}",
                     " ".join(f"{r:.2f}" for r in ratios)])
    auto = dtype_name(resolve_dtype("auto", torch.device("cpu")))
    print(markdown_table(["step", "float32 ms", "bfloat16 ms", "fp32/bf16 (median)",
                          "per repeat"], rows))
    print(f"\n--dtype auto on this CPU: {auto}")
    path = write_results("auto_dtype", {"benchmark": "auto_dtype", "repeats": args.repeats,
                                        "auto": auto, "steps": payload_steps})
    print(f"written to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
