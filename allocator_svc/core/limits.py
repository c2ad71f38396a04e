"""What one allocator accepts: its bounds on pools, batches, leases and the event log."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Limits:
    # A registered block costs ~170 bytes of allocator memory: these bound what one caller
    # can make it hold (a million blocks is ~170 MiB).
    max_blocks_per_pool: int = 1 << 20
    max_block_size: int = 1024
    max_cpu_blocks_per_pool: int = 1 << 20
    max_pools: int = 64
    max_batch_items: int = 4096
    default_lease_ttl_s: float = 10.0
    max_lease_ttl_s: float = 600.0
    event_capacity: int = 65536
    # Ids and salts are kept per request and hashed into blocks: bounded.
    max_id_chars: int = 256
    max_salt_chars: int = 256
    # Per-tenant block quota at admission, per pool (core/step.py TenantQuota); 0: none.
    max_blocks_per_tenant: int = 0
    # Each pool's pins may name at most this fraction of its blocks (core/pins.py pin_budget).
    max_pinned_fraction: float = 0.1
