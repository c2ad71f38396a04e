"""Per-step timings of one engine: the control plane's share of a step, measured."""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

WINDOW = 512
REPORT_EVERY = 500


@dataclass(slots=True)
class StepStats:
    """A sliding window of recent steps (milliseconds)."""

    control_ms: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))
    total_ms: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))
    allocator_ms: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))
    num_seqs: deque[int] = field(default_factory=lambda: deque(maxlen=WINDOW))
    num_steps: int = 0

    def record(
        self, total_ms: float, allocator_ms: float, execute_ms: float, forward_ms: float,
        num_seqs: int,
    ) -> None:
        # Control plane: everything but the executor's own forward pass + sampling.
        self.control_ms.append(total_ms - min(forward_ms, execute_ms))
        self.total_ms.append(total_ms)
        self.allocator_ms.append(allocator_ms)
        self.num_seqs.append(num_seqs)
        self.num_steps += 1

    def should_report(self) -> bool:
        return self.num_steps % REPORT_EVERY == 0

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
