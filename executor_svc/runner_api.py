"""What the servicer needs of a runner, free of torch: what Describe reports, and the calls.

ModelRunner (runner.py) implements it with a model; SimulatedRunner (simulated/) with a cost
model and a token hash, so that a fleet of simulated executors reuses service.py, convert.py
and plan.py without importing torch (~300 MB a process).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from common.errors import ServiceError
from common.executor_description import ExecutorDescription, LoraAdapterInfo
from executor_svc.kv_transfer import KVBlockStore
from executor_svc.plan import RequestState
from executor_svc.step import StepRequest, StepResult


class StepRunner(Protocol):
    """One step at a time, in the servicer's compute thread (not thread-safe)."""

    info: ExecutorDescription  # what Describe reports
    requests: dict[str, RequestState]  # held requests, by id
    idle_release_s: float  # 0: never drop idle requests
    next_idle_check: float  # on `clock`: when a step next looks for idle requests
    clock: Callable[[], float]
    kv_blocks: KVBlockStore  # read and written by KV hand-off (ImportKV, ExportKV)

    def execute(self, step: StepRequest) -> StepResult: ...

    def execute_merged(self, steps: Sequence[StepRequest]) -> list[StepResult | ServiceError]:
        """Several callers' calls in one forward: each one's result, or its refusal."""
        ...

    def release(self, request_ids: tuple[str, ...]) -> int: ...

    def read_lora_adapter(self, name: str, path: str) -> Any:
        """Read and check a PEFT directory (lora.py says what is refused); any thread."""
        ...

    def install_lora_adapter(self, adapter: Any) -> LoraAdapterInfo:
        """Put a read adapter in a free slot; the compute thread."""
        ...

    def unload_lora_adapter(self, name: str) -> None: ...
