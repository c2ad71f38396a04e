"""Which library computes the executor's linear layers fastest on this CPU: MKL or oneDNN,
and below how many rows the executor's own few-row kernel beats them.

    .venv/bin/python -m bench.matmul_libraries [--repeats 3] [--rows 1,2,4,16,64,256,2048]

SmolLM2-135M's linear layers at its shapes (q, k, v, o, gate, up, down in each of 30 layers,
random weights, so that they come from DRAM as in the model; then the 49,152-row head), two
threads, at each row count, float32 and bfloat16:
  f_linear   torch's F.linear (MKL's sgemm for float32, re-laying the weight out each call)
  mkl        MKL's packed GEMM (float32; the executor's CPU kernels, packed_linear.py)
  onednn     oneDNN's `_linear_pointwise` on a weight reordered once (packed_linear.py)
  small      the plain weight through the CPU kernels' small_rows_linear (small_gemm.cpp),
             at 1 to its SMALL_ROWS_MAX rows
The libraries take turns within each repeat, their order rotating; medians of the repeats,
ms for all 210 layers (and for the head). `packed_linear.matmul_library()` picks MKL on Intel
CPUs and oneDNN elsewhere, and OneDnnWeight takes small_rows_linear up to SMALL_ROWS_MAX
rows: these are the measurements those rules stand on, to rerun on a new kind of CPU.
Writes bench/results/matmul_libraries.json (the CPU and its vendor recorded).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from bench.common import markdown_table, write_results
from executor_svc.cpu_kernels import load as load_kernels
from executor_svc.packed_linear import matmul_library

HIDDEN, INTERMEDIATE, KV_WIDTH, VOCAB, LAYERS = 576, 1536, 192, 49152, 30
LAYER_SHAPES = ((HIDDEN, HIDDEN), (KV_WIDTH, HIDDEN), (KV_WIDTH, HIDDEN), (HIDDEN, HIDDEN),
                (INTERMEDIATE, HIDDEN), (INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE))
ONEDNN_PACK_FOR_ROWS = 64  # as packed_linear.py packs

Linear = Callable[[torch.Tensor], torch.Tensor]


def linears(library: str, weights: list[torch.Tensor]) -> list[Linear] | None:
    """One callable per weight computing x @ w^T through `library`, or None where it has no
    kernel for this dtype here."""
    if library == "f_linear":
        return [partial(F.linear, weight=w) for w in weights]
    if library == "onednn":
        if weights[0].dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return None
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, ONEDNN_PACK_FOR_ROWS)
                  for w in weights]
        return [partial(_onednn_linear, packed=p) for p in packed]
    kernels = load_kernels()
    if library == "small":
        return None if kernels is None else [partial(_small_linear, kernels.small_rows_linear,
                                                      weights=[w]) for w in weights]
    if weights[0].dtype != torch.float32 or kernels is None:
        return None
    if not kernels.mkl_packed_gemm_available():
        return None
    packed = [kernels.mkl_pack_weight(w) for w in weights]
    return [partial(_mkl_linear, kernels.mkl_packed_linear, packed=p, out_features=w.shape[0])
            for p, w in zip(packed, weights, strict=True)]


def _onednn_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def _small_linear(compute: Callable[..., torch.Tensor], x: torch.Tensor,
                  weights: list[torch.Tensor]) -> torch.Tensor:
    return compute(x, weights)


def _mkl_linear(compute: Callable[..., torch.Tensor], x: torch.Tensor, packed: torch.Tensor,
                out_features: int) -> torch.Tensor:
    return compute(x, packed, out_features)


def seconds(calls: list[Linear], widths: list[int], inputs: dict[int, torch.Tensor]) -> float:
    """One pass over every layer, each given the input of its own width."""
    start = time.perf_counter()
    for call, width in zip(calls, widths, strict=True):
        call(inputs[width])
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.matmul_libraries",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rows", default="1,2,4,16,64,256,2048")
    args = parser.parse_args()
    torch.set_num_threads(2)
    row_counts = [int(r) for r in args.rows.split(",")]
    gen = torch.Generator().manual_seed(0)
    layer_shapes = [shape for _ in range(LAYERS) for shape in LAYER_SHAPES]
    libraries = ("f_linear", "mkl", "onednn", "small")
    kernels = load_kernels()
    small_rows_max = 0 if kernels is None else kernels.SMALL_ROWS_MAX
    results: dict[str, dict[str, list[float]]] = {}
    table = []
    for dtype in (torch.float32, torch.bfloat16):
        parts = {
            "layers": [torch.randn(n, k, generator=gen).to(dtype) for n, k in layer_shapes],
            "head": [torch.randn(VOCAB, HIDDEN, generator=gen).to(dtype)],
        }
        for part, weights in parts.items():
            calls = {lib: linears(lib, weights) for lib in libraries}
            widths = [w.shape[1] for w in weights]
            for rows in row_counts:
                present = [lib for lib in libraries if calls[lib] is not None
                           and (lib != "small" or rows <= small_rows_max)]
                inputs = {k: torch.randn(rows, k, generator=gen).to(dtype)
                          for k in (HIDDEN, INTERMEDIATE)}
                times: dict[str, list[float]] = {lib: [] for lib in present}
                for lib in present:  # warm-up: first calls allocate and pick kernels
                    seconds(calls[lib], widths, inputs)  # type: ignore[arg-type]
                for repeat in range(args.repeats):
                    for i in range(len(present)):
                        lib = present[(i + repeat) % len(present)]
                        times[lib].append(seconds(calls[lib], widths, inputs))  # type: ignore[arg-type]
                key = f"{str(dtype).removeprefix('torch.')} {part} x{rows}"
                results[key] = times
                medians = {lib: statistics.median(t) * 1e3 for lib, t in times.items()}
                best = min(medians, key=medians.__getitem__)
                table.append([key, *(f"{medians[lib]:.2f}" if lib in medians else "-"
                                     for lib in libraries), best])
                print(table[-1], flush=True)
    print(markdown_table(["dtype, layers, rows", *(f"{lib} ms" for lib in libraries),
                          "fastest"], table))
    chosen = matmul_library()
    print(f"\nmatmul_library() on this CPU: {chosen}")
    path = write_results("matmul_libraries", {
        "benchmark": "matmul_libraries", "repeats": args.repeats, "rows": row_counts,
        "matmul_library": chosen, "seconds": results})
    print(f"written to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
