"""Which allocator shard owns a pool: rendezvous (highest random weight) hashing of the pool
id over the shard indices 0..num_shards-1.

Every gateway and every allocator computes it alike from two things they are configured with
(the pool id and the number of shards), so a pool belongs to exactly one shard with no
directory to consult; an allocator refuses to register a pool of another shard. Growing from
N to N+1 shards moves about 1/(N+1) of the pools, the ones the new shard wins.
"""

from __future__ import annotations

import hashlib

MAX_SHARDS = 256


def shard_of(pool_id: str, num_shards: int) -> int:
    """The index of the shard that owns `pool_id` (sha256: stable across processes)."""
    if not 1 <= num_shards <= MAX_SHARDS:
        raise ValueError(f"num_shards must be in [1, {MAX_SHARDS}], got {num_shards}")
    if num_shards == 1:
        return 0
    raw = pool_id.encode("utf-8")
    return max(
        range(num_shards),
        key=lambda index: hashlib.sha256(index.to_bytes(2, "little") + raw).digest(),
    )
