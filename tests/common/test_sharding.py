"""Pools to allocator shards: a stable function of the pool id and the shard count that
spreads pools evenly and moves only what a new shard wins."""

from __future__ import annotations

import hashlib
from collections import Counter

import pytest

from common.sharding import MAX_SHARDS, shard_of

POOLS = [f"executor-{i}.executor.pagedkv.svc:50053" for i in range(2000)]


def reference_shard(pool_id: str, num_shards: int) -> int:
    """Rendezvous hashing written out plainly: the shard with the highest weight wins."""
    weights = [(hashlib.sha256(i.to_bytes(2, "little") + pool_id.encode()).digest(), i)
               for i in range(num_shards)]
    return max(weights)[1]


def test_one_shard_owns_everything():
    assert {shard_of(p, 1) for p in POOLS} == {0}


@pytest.mark.parametrize("num_shards", [2, 3, 8])
def test_matches_the_plain_rendezvous_reference_and_spreads_evenly(num_shards: int):
    owners = [shard_of(p, num_shards) for p in POOLS]
    assert owners == [reference_shard(p, num_shards) for p in POOLS]
    counts = Counter(owners)
    assert set(counts) == set(range(num_shards))
    expected = len(POOLS) / num_shards
    assert all(abs(n - expected) < 0.25 * expected for n in counts.values()), counts


@pytest.mark.parametrize("num_shards", [1, 2, 5])
def test_a_new_shard_takes_pools_only_for_itself(num_shards: int):
    moved = [p for p in POOLS if shard_of(p, num_shards) != shard_of(p, num_shards + 1)]
    assert all(shard_of(p, num_shards + 1) == num_shards for p in moved)
    assert len(moved) < 1.5 * len(POOLS) / (num_shards + 1)


def test_known_values_do_not_change_between_releases():
    # A change here would move pools between shards of a running fleet on upgrade.
    assert [shard_of(f"pool-{i}", 2) for i in range(6)] == [1, 1, 0, 1, 0, 0]
    assert [shard_of(f"pool-{i}", 4) for i in range(6)] == [
        reference_shard(f"pool-{i}", 4) for i in range(6)]


@pytest.mark.parametrize("num_shards", [0, -1, MAX_SHARDS + 1])
def test_a_shard_count_out_of_range_is_refused(num_shards: int):
    with pytest.raises(ValueError, match="num_shards must be in"):
        shard_of("p", num_shards)
