"""Per-step timings of one engine: the control plane's share of a step, measured.

The engine's one timing system: its log summary (`engine_step_stats`, every `window` steps)
and, with `--step-log PATH`, one JSON line per executed step, which the benchmarks read.
"""

from __future__ import annotations

import json
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import IO

DEFAULT_WINDOW = 500


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One landed batch (milliseconds)."""

    period_ms: float  # since the previous batch landed (after idle: since its step began)
    schedule_ms: float  # the scheduler's share of the step that built it
    allocator_ms: float  # that step's Step round trip
    execute_ms: float  # its Execute round trip, from launch to landing
    forward_ms: float  # the executor's own report: forward pass, sampling, whole step
    sample_ms: float
    executor_ms: float
    num_seqs: int
    num_tokens: int
    ahead: bool  # sent while another batch was in flight (its round trip waits for that one)


@dataclass(slots=True)
class StepStats:
    """The last `window` steps, summarised every `window` steps; every step to `log_path`."""

    window: int = DEFAULT_WINDOW  # 0: never summarised
    log_path: str | None = None
    control_ms: deque[float] = field(default_factory=deque)
    total_ms: deque[float] = field(default_factory=deque)
    allocator_ms: deque[float] = field(default_factory=deque)
    num_seqs: deque[int] = field(default_factory=deque)
    num_steps: int = 0
    observe: Callable[[StepRecord], None] | None = None  # metrics (gateway/metrics.py)
    _log: IO[str] | None = None

    def __post_init__(self) -> None:
        size = max(self.window, 1)
        self.control_ms = deque(maxlen=size)
        self.total_ms = deque(maxlen=size)
        self.allocator_ms = deque(maxlen=size)
        self.num_seqs = deque(maxlen=size)
        if self.log_path:
            self._log = open(self.log_path, "a", buffering=1)  # noqa: SIM115 - one per engine

    def record(self, step: StepRecord, pool_id: str = "") -> None:
        # Control plane: everything but the executor's own forward pass and sampling.
        compute_ms = step.forward_ms + step.sample_ms
        self.control_ms.append(step.period_ms - min(compute_ms, step.execute_ms))
        self.total_ms.append(step.period_ms)
        self.allocator_ms.append(step.allocator_ms)
        self.num_seqs.append(step.num_seqs)
        self.num_steps += 1
        if self.observe is not None:
            self.observe(step)
        if self._log is not None:
            self._log.write(json.dumps({"pool_id": pool_id, **asdict(step)}) + "\n")

    def should_report(self) -> bool:
        return self.window > 0 and self.num_steps % self.window == 0

    def summary(self) -> dict[str, float]:
        if not self.total_ms:
            return {"num_steps": 0}
        control = statistics.median(self.control_ms)
        total = statistics.median(self.total_ms)
        return {
            "num_steps": self.num_steps,
            "p50_step_ms": round(total, 3),
            "p50_control_ms": round(control, 3),
            "p50_allocator_ms": round(statistics.median(self.allocator_ms), 3),
            "control_share": round(control / total, 3) if total else 0.0,
            "mean_seqs": round(statistics.fmean(self.num_seqs), 1),
        }
