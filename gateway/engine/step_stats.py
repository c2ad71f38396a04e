"""Per-step timings of one engine: the control plane's share of a step, measured."""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

DEFAULT_WINDOW = 500


@dataclass(slots=True)
class StepStats:
    """The last `window` steps (milliseconds), summarised every `window` steps."""

    window: int = DEFAULT_WINDOW  # 0: never summarised
    control_ms: deque[float] = field(default_factory=deque)
    total_ms: deque[float] = field(default_factory=deque)
    allocator_ms: deque[float] = field(default_factory=deque)
    num_seqs: deque[int] = field(default_factory=deque)
    num_steps: int = 0

    def __post_init__(self) -> None:
        size = max(self.window, 1)
        self.control_ms = deque(maxlen=size)
        self.total_ms = deque(maxlen=size)
        self.allocator_ms = deque(maxlen=size)
        self.num_seqs = deque(maxlen=size)

    def record(
        self, total_ms: float, allocator_ms: float, execute_ms: float, compute_ms: float,
        num_seqs: int,
    ) -> None:
        # Control plane: everything but the executor's own forward pass and sampling.
        self.control_ms.append(total_ms - min(compute_ms, execute_ms))
        self.total_ms.append(total_ms)
        self.allocator_ms.append(allocator_ms)
        self.num_seqs.append(num_seqs)
        self.num_steps += 1

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
