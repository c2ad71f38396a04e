"""The block pool: allocation order, lazy eviction, LRU of cached blocks, invariants."""

import pytest

from allocator_svc.core.block_pool import BlockPool
from allocator_svc.core.events import EventKind, EventLog


def make_pool(num_blocks: int = 4) -> BlockPool:
    return BlockPool(num_blocks, enable_caching=True, events=EventLog(64))


def test_block_pool_allocates_from_head_and_refuses_when_short():
    # 4 blocks: take 3 (ids 0,1,2), then 2 more do not fit and nothing changes.
    pool = make_pool()
    taken = pool.allocate(3)
    assert [b.block_id for b in taken] == [0, 1, 2]
    assert pool.allocate(2) is None
    assert pool.num_free == 1
    pool.check_invariants([taken])


def test_block_pool_unhashed_to_head_hashed_to_tail():
    # Free 0 (cached) and 1 (plain): 1 is reused first, cached 0 is evicted last.
    pool = make_pool()
    b0, b1 = pool.allocate(2)
    pool.cache(b0, b"h0", b"k0", None, [1, 2])
    pool.free([b1, b0])
    assert [b.block_id for b in pool.free_queue] == [1, 2, 3, 0]
    assert pool.num_cached_free == 1
    pool.check_invariants([])


def test_block_pool_evicts_lazily_and_emits_events():
    # The cached block keeps its hash (and its hash-input index entry) until it is popped
    # for reuse.
    pool = make_pool(2)
    b0, b1 = pool.allocate(2)
    pool.cache(b0, b"h0", b"k0", None, [7])
    pool.free([b0, b1])
    assert pool.cached.get(b"h0") is b0 and pool.by_key.get(b"k0") is b0
    first, second = pool.allocate(2)
    assert (first.block_id, second.block_id) == (1, 0)
    assert pool.cached.get(b"h0") is None and b0.block_hash is None
    assert pool.by_key.get(b"k0") is None and b0.chain_key is None
    assert pool.num_evictions == 1
    page = pool.events.after(0, 10)
    assert [(e.seq, e.kind, e.block_id) for e in page.events] == [
        (1, EventKind.STORED, 0),
        (2, EventKind.REMOVED, 0),
    ]


def test_block_pool_touch_revives_cached_free_block():
    # A prefix hit on a free cached block takes it out of the free queue.
    pool = make_pool(3)
    (b0,) = pool.allocate(1)
    pool.cache(b0, b"h", b"k", None, [1])
    pool.free([b0])
    pool.touch([b0])
    assert b0.ref_count == 1 and pool.num_free == 2
    pool.touch([b0])
    assert b0.ref_count == 2
    pool.check_invariants([[b0], [b0]])


def test_block_pool_duplicate_hash_keeps_first_block():
    # Two requests computed the same block: the second copy stays private.
    pool = make_pool()
    b0, b1 = pool.allocate(2)
    assert pool.cache(b0, b"h", b"k", None, [1])
    assert not pool.cache(b1, b"h", b"k", None, [1])
    assert b1.block_hash is None and pool.cached.get(b"h") is b0


def test_block_pool_double_free_is_a_bug():
    pool = make_pool()
    (b0,) = pool.allocate(1)
    pool.free([b0])
    with pytest.raises(AssertionError):
        pool.free([b0])


def test_block_pool_invariants_catch_wrong_ref_count():
    # check_invariants compares ref counts with the tables that hold the blocks.
    pool = make_pool()
    (b0,) = pool.allocate(1)
    with pytest.raises(AssertionError, match="ref_count"):
        pool.check_invariants([[b0], [b0]])
