"""What one allocator accepts: its bounds on pools, batches, leases and the event log."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Limits:
    max_blocks_per_pool: int = 1 << 22
    max_block_size: int = 1024
    max_cpu_blocks_per_pool: int = 1 << 22
    max_pools: int = 1024
    max_batch_items: int = 4096
    default_lease_ttl_s: float = 10.0
    event_capacity: int = 65536
