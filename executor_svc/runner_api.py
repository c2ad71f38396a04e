"""What the servicer needs of a runner, free of torch: what Describe reports, and the calls.

ModelRunner (runner.py) implements it with a model; SimulatedRunner (simulated/) with a cost
model and a token hash, so that a fleet of simulated executors reuses service.py, convert.py
and plan.py without importing torch (~300 MB a process).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from executor_svc.kv_transfer import KVBlockStore, KVLayout
from executor_svc.plan import RequestState
from executor_svc.step import StepRequest, StepResult


@dataclass(frozen=True, slots=True)
class ExecutorInfo:
    """What Describe reports."""

    instance_id: str
    model_name: str
    model_fingerprint: str
    num_blocks: int
    block_size: int
    num_cpu_blocks: int
    dtype: str
    backend: str
    device: str
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    vocab_size: int
    max_num_batched_tokens: int
    max_num_seqs: int
    num_cpu_cache_blocks: int = 0  # of num_cpu_blocks, the prefix cache's CPU tier
    role: str = "both"  # --role: which work a gateway gives it (prefill, decode, both)
    kv_layout: KVLayout | None = None  # what ImportKV / ExportKV move (None: neither works)


class StepRunner(Protocol):
    """One step at a time, in the servicer's compute thread (not thread-safe)."""

    info: ExecutorInfo
    requests: dict[str, RequestState]  # held requests, by id
    idle_release_s: float  # 0: never drop idle requests
    next_idle_check: float  # on `clock`: when a step next looks for idle requests
    clock: Callable[[], float]
    kv_blocks: KVBlockStore  # read and written by KV hand-off (ImportKV, ExportKV)

    def execute(self, step: StepRequest) -> StepResult: ...

    def release(self, request_ids: tuple[str, ...]) -> int: ...
