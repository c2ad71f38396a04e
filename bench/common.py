"""Shared benchmark plumbing: timing statistics, machine description, result files."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common.cpu_info import cpu_flags, cpu_model, cpu_vendor

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def machine() -> dict[str, Any]:
    import torch

    from executor_svc.cpu_kernels import MARCH

    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        # The instruction set torch's own CPU kernels dispatch to here, and the level the
        # executor's C++ kernels are built for (-march).
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "kernel_march": MARCH,
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def cpu() -> dict[str, Any]:
    """The CPU a figure came from: its model and the vector extensions that change which
    kernels run (figures from two CPUs are not comparable)."""
    model, flags = cpu_model() or platform.processor(), cpu_flags()
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")
    return {"model": model, "vendor": cpu_vendor(), "extensions": [f for f in wanted if f in flags]}


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def time_calls(fn: Callable[[], object], repeat: int) -> list[float]:
    """Seconds per call, one sample per call."""
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return samples


def median(samples: list[float]) -> float:
    return statistics.median(samples)


def write_results(name: str, payload: dict[str, Any], directory: Path | None = None) -> Path:
    """<directory>/<name>.json with the machine's description; RESULTS_DIR by default (read
    at call time: tests point it elsewhere)."""
    directory = directory or RESULTS_DIR
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **payload}, indent=2))
    return path


def markdown_table(headers: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
