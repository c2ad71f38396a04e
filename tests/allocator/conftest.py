"""Helpers for driving the allocator core directly."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from allocator_svc.core.allocator import Allocator, Limits
from allocator_svc.core.pool import Pool, PoolConfig
from allocator_svc.core.request import Commit
from allocator_svc.core.step import PreemptionMode, StepItem, StepResult


@dataclass
class Harness:
    """One pool in one allocator, with a terse step() for tests."""

    allocator: Allocator
    pool: Pool
    mode: PreemptionMode = PreemptionMode.RECOMPUTE
    lease_id: str | None = None
    now: list[float] = field(default_factory=lambda: [0.0])

    def step(
        self,
        items: list[StepItem],
        commits: dict[str, int] | None = None,
        free: list[str] | None = None,
        abort: list[str] | None = None,
    ) -> StepResult:
        result = self.allocator.step(
            self.pool.config.pool_id,
            self.pool.epoch,
            self.lease_id,
            [Commit(k, v) for k, v in (commits or {}).items()],
            free or [],
            abort or [],
            items,
            self.mode,
        )
        self.allocator.check_invariants()
        return result

    def table(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.pool.requests[request_id].blocks]


def new(
    request_id: str, prompt: list[int], num_tokens: int | None = None, salt: str = ""
) -> StepItem:
    return StepItem(request_id, len(prompt) if num_tokens is None else num_tokens, prompt, salt)


def decode(request_id: str, token: int) -> StepItem:
    return StepItem(request_id, 1, None, "", [token])


def make_harness(
    num_blocks: int = 8, block_size: int = 4, num_cpu_blocks: int = 0, caching: bool = True
) -> Harness:
    now = [0.0]
    allocator = Allocator(Limits(max_batch_items=64), clock=lambda: now[0])
    pool, _ = allocator.register_pool(
        PoolConfig("pool-a", num_blocks, block_size, num_cpu_blocks, "fp", "inst-1", caching)
    )
    return Harness(allocator, pool, now=now)


@pytest.fixture
def harness() -> Harness:
    return make_harness()
