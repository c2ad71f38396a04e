"""Each workload's floor on this machine as a share of its time.

    .venv/bin/python -m bench.floor_share [--dtype bfloat16] [--repeats 3]

The floor of one step is what this machine needs at least for it, by the larger of two:
  compute  its matmul FLOPs at the machine's measured matmul peak: 2 x rows x the decoder's
           linear weights, 2 x sampled rows x the lm_head, and attention's 4 x head_dim x
           query heads per (query, key) pair it scores (a prompt or chunk of n tokens after
           p cached ones: n*p + n(n+1)/2 pairs; a decode row: its context)
  memory   the bytes it must move at the machine's measured read bandwidth: every linear
           weight and the lm_head once, each sequence's K/V once per layer, and the K/V it
           writes
Peak: the best of a few repeats of `torch.matmul` on the model's own linear shapes at 2,048
rows, in the dtype, on two threads. Bandwidth: the best of a few sums over a 1 GiB tensor.
Both are what torch itself reaches here, not the datasheet's figures.

The workloads are bench.vs_vllm_steps' (bench.vs_vllm's mixed and equal, 64 requests, fresh
prompts each repeat) through the executor's runner in this process, driven by its plain loop
(no services); every step is timed and its floor computed from the step the loop sent.
Reported per workload: the floor's share of the time, overall (against the run's wall time,
the loop's own Python included) and for the steps with prompt tokens (prefill) and those
without (decode), against those steps' own time. Medians of the repeats. Writes
bench/results/floor_share_<dtype>.json.
"""

from __future__ import annotations

from executor_svc.malloc_tuning import tune_malloc

tune_malloc()  # before torch allocates, as executor_svc/__main__.py does

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from bench import fused_layers  # noqa: E402
from bench.common import markdown_table, write_results  # noqa: E402
from bench.vs_vllm import REQUESTS_PER_RUN  # noqa: E402
from bench.vs_vllm_steps import WORKLOADS, run_workload  # noqa: E402
from common.model_dirs import DEFAULT_MODEL  # noqa: E402
from executor_svc.runner import ModelRunner  # noqa: E402
from executor_svc.step import StepRequest  # noqa: E402

PEAK_ROWS = 2048
BANDWIDTH_BYTES = 1 << 30
MEASURE_REPEATS = 5


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    element_bytes: int
    linear_shapes: tuple[tuple[int, int], ...]  # one layer's (in, out) per projection

    @classmethod
    def of(cls, runner: ModelRunner) -> ModelShape:
        config = runner.loaded.model.config
        hidden, heads = config.hidden_size, config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        inter = config.intermediate_size
        shapes = ((hidden, heads * head_dim), (hidden, kv_heads * head_dim),
                  (hidden, kv_heads * head_dim), (heads * head_dim, hidden),
                  (hidden, inter), (hidden, inter), (inter, hidden))
        return cls(config.num_hidden_layers, hidden, heads, kv_heads, head_dim,
                   config.vocab_size, runner.loaded.dtype.itemsize, shapes)

    @property
    def layer_weights(self) -> int:
        return sum(i * o for i, o in self.linear_shapes)

    @property
    def kv_bytes_per_token(self) -> int:  # K and V, every layer
        return 2 * self.kv_heads * self.head_dim * self.element_bytes * self.layers


def step_floor(step: StepRequest, shape: ModelShape, peak_flops: float,
               bandwidth: float) -> tuple[float, bool]:
    """(seconds, whether the step has prompt tokens)."""
    rows = sampled = pairs = context = 0
    has_prompt = False
    for seq in step.seqs:
        n, p = len(seq.token_ids), seq.start_position
        rows += n
        sampled += int(seq.sample)
        pairs += n * p + n * (n + 1) // 2
        context += p + n
        has_prompt |= n > 1
    flops = (2 * rows * shape.layer_weights * shape.layers
             + 2 * sampled * shape.vocab * shape.hidden
             + 4 * shape.head_dim * shape.q_heads * pairs * shape.layers)
    weights = (shape.layer_weights * shape.layers + shape.vocab * shape.hidden)
    moved = (weights * shape.element_bytes + context * shape.kv_bytes_per_token
             + rows * shape.kv_bytes_per_token)
    return max(flops / peak_flops, moved / bandwidth), has_prompt


def matmul_peak(shape: ModelShape, dtype: torch.dtype) -> float:
    """FLOP/s: the best torch.matmul reaches on the model's linear shapes at PEAK_ROWS rows."""
    best = 0.0
    for inputs, outputs in set(shape.linear_shapes):
        x = torch.randn(PEAK_ROWS, inputs, dtype=dtype)
        w = torch.randn(inputs, outputs, dtype=dtype)
        torch.matmul(x, w)  # warm-up: the library's kernel for the shape
        for _ in range(MEASURE_REPEATS):
            start = time.perf_counter()
            torch.matmul(x, w)
            best = max(best, 2 * PEAK_ROWS * inputs * outputs / (time.perf_counter() - start))
    return best


def read_bandwidth() -> float:
    """Bytes/s: the best of a few sums over a tensor far larger than the caches."""
    data = torch.ones(BANDWIDTH_BYTES // 4, dtype=torch.float32)
    data.sum()
    best = 0.0
    for _ in range(MEASURE_REPEATS):
        start = time.perf_counter()
        data.sum()
        best = max(best, BANDWIDTH_BYTES / (time.perf_counter() - start))
    return best


def timed_workload(runner: ModelRunner, requests: list[Any], shape: ModelShape, peak: float,
                   bandwidth: float) -> dict[str, float]:
    """The workload through the runner; time and floor, prefill and decode steps apart."""
    sums = {"time_prefill": 0.0, "time_decode": 0.0, "floor_prefill": 0.0, "floor_decode": 0.0}
    execute = runner.execute

    def timed(step: StepRequest) -> Any:
        start = time.perf_counter()
        result = execute(step)
        seconds = time.perf_counter() - start
        if step.seqs:
            floor, prefill = step_floor(step, shape, peak, bandwidth)
            kind = "prefill" if prefill else "decode"
            sums[f"time_{kind}"] += seconds
            sums[f"floor_{kind}"] += floor
        return result

    runner.execute = timed  # type: ignore[method-assign]
    try:
        _, wall = run_workload(runner, requests)
    finally:
        del runner.execute
    return {**sums, "wall": wall}


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.floor_share", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args()
    torch.set_num_threads(2)
    runner = fused_layers.build(str(DEFAULT_MODEL), dtype=args.dtype)
    shape = ModelShape.of(runner)
    peak, bandwidth = matmul_peak(shape, runner.loaded.dtype), read_bandwidth()
    run_workload(runner, WORKLOADS["mixed"](16, 99))  # warm-up
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in WORKLOADS}
    for rep in range(args.repeats):
        for name, make_requests in WORKLOADS.items():
            samples[name].append(timed_workload(
                runner, make_requests(REQUESTS_PER_RUN, 100 + rep), shape, peak, bandwidth))
    rows = []
    for name, runs in samples.items():
        def share(part: str, runs: list[dict[str, float]] = runs) -> float:
            return statistics.median(r[f"floor_{part}"] / r[f"time_{part}"] for r in runs)

        overall = statistics.median(
            (r["floor_prefill"] + r["floor_decode"]) / r["wall"] for r in runs)
        wall = statistics.median(r["wall"] for r in runs)
        rows.append({"workload": name, "wall_s": round(wall, 2), "floor_share": round(overall, 3),
                     "prefill_share": round(share("prefill"), 3),
                     "decode_share": round(share("decode"), 3)})
    print(f"matmul peak {peak / 1e9:.0f} GFLOP/s ({args.dtype}), read bandwidth "
          f"{bandwidth / 1e9:.1f} GB/s, two threads")
    print(markdown_table(["workload", "wall s", "floor / time", "prefill steps", "decode steps"],
                         [list(r.values()) for r in rows]))
    write_results(f"floor_share_{'bf16' if args.dtype == 'bfloat16' else 'fp32'}", {
        "benchmark": "floor_share", "model": str(DEFAULT_MODEL.name), "dtype": args.dtype,
        "repeats": args.repeats, "matmul_peak_flops": peak, "read_bandwidth_bytes": bandwidth,
        "rows": rows, "samples": samples,
    })
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
