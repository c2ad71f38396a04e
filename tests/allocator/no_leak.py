"""The leak check the allocator's state machines end with."""

from __future__ import annotations

from collections.abc import Iterable

from allocator_svc.core.allocator import Allocator
from allocator_svc.core.pool import Pool


def free_all_and_check_no_leak(allocator: Allocator, pool: Pool, request_ids: Iterable[str],
                               num_blocks: int, num_cpu_blocks: int,
                               lease_id: str | None = None) -> None:
    """Once every request is freed and every step confirmed (as an idle gateway's Free
    confirms its last ones: the blocks a step's copies read are held until then), every
    block is free again, GPU and CPU (a CPU block either free or a CPU-tier entry, which no
    request holds)."""
    newest = pool.scheduled.newest.get(lease_id, 0)
    allocator.free("p", pool.epoch, [], sorted(request_ids), lease_id, commit_through=newest)
    allocator.check_invariants()
    assert pool.blocks.num_free == num_blocks
    assert pool.cpu.num_free + len(pool.cpu.entries) == num_cpu_blocks, (
        pool.cpu.free_ids, [(e.cpu_block_id, e.written) for e in pool.cpu.entries.values()],
        [(r.request_id, r.cpu_block_ids) for r in pool.requests.values()])
