"""The prefix cache's CPU tier: evicted cached blocks copied to CPU blocks, hits copied back."""

import pytest

from allocator_svc.core.allocator import Allocator, Limits
from allocator_svc.core.pool import PoolConfig
from common.errors import InvalidArgument
from common.step_records import BlockCopy, PreemptionMode
from tests.allocator.conftest import decode, make_harness, new

A = list(range(9))  # two full blocks of 4, and one token
B = list(range(100, 116))  # four full blocks


def tiered(num_blocks: int = 4, num_cpu_blocks: int = 4, tier: int = 4):
    return make_harness(num_blocks=num_blocks, num_cpu_blocks=num_cpu_blocks,
                        num_cpu_cache_blocks=tier)


def cached_a_then_b(h) -> None:
    """a caches blocks 0, 1 and is freed; b's four blocks evict both into the tier."""
    h.step([new("a", A)], step_id=1)
    h.step([], free=["a"], commit_through=1)
    result = h.step([new("b", B)], step_id=2)
    # Popped 2, 3, 1, 0: the cached 1 and 0 go to CPU blocks 0 and 1, in eviction order.
    assert result.swap_out == [BlockCopy(1, 0), BlockCopy(0, 1)]
    assert h.pool.blocks.cached == {}


def test_cpu_tier_eviction_copies_cached_blocks_out_and_a_hit_copies_them_back():
    h = tiered()
    cached_a_then_b(h)
    # Pending until step 2 is confirmed: no lookup finds the entries yet.
    (match,) = h.allocator.match_prefix(A, "", ["pool-a"])
    assert (match.num_cached_tokens, match.num_cpu_cached_tokens) == (0, 0)
    h.step([], free=["b"], commit_through=2)
    (match,) = h.allocator.match_prefix(A, "", ["pool-a"])
    assert (match.num_cached_tokens, match.num_cpu_cached_tokens) == (8, 8)
    # c = a's prompt: both blocks come back from CPU blocks 1 (block 0's KV) and 0, into
    # fresh blocks 0 and 1 (b's last two, whose hashes go to CPU blocks 2 and 3); its last
    # block is 3, whose eviction finds every entry busy this step: dropped.
    result = h.step([new("c", A)], step_id=3)
    (grant,) = result.grants
    assert (grant.num_cached_tokens, grant.num_cpu_cached_tokens) == (8, 8)
    assert grant.block_ids == [0, 1, 3]
    assert result.swap_in == [BlockCopy(1, 0), BlockCopy(0, 1)]
    assert result.swap_out == [BlockCopy(0, 2), BlockCopy(1, 3)]
    assert h.pool.num_prefix_cpu_hits == 8 and h.pool.cpu.num_loaded == 2
    # Once step 3 is confirmed, the loaded blocks are device cache entries again.
    h.step([], free=["c"], commit_through=3)
    (match,) = h.allocator.match_prefix(A, "", ["pool-a"])
    assert (match.num_cached_tokens, match.num_cpu_cached_tokens) == (8, 0)


def test_cpu_tier_entries_of_a_step_whose_request_is_aborted_are_dropped():
    # The executor may have refused step 2 (its swap-outs never ran): its entries go.
    h = tiered()
    cached_a_then_b(h)
    h.step([], abort=["b"], commit_through=2)
    assert h.pool.cpu.entries == {} and h.pool.cpu.num_free == 4
    assert h.allocator.match_prefix(A, "", ["pool-a"])[0].num_cached_tokens == 0


def test_cpu_tier_entries_of_an_aborted_request_dropped_before_the_step_is_confirmed():
    # The abort comes in an earlier call than the commit through its step.
    h = tiered()
    cached_a_then_b(h)
    h.allocator.abort("pool-a", h.pool.epoch, ["b"])
    h.allocator.check_invariants()
    h.step([new("c", A)], commit_through=2, step_id=3)
    assert h.pool.requests["c"].num_cached_tokens == 0


def test_cpu_tier_unnumbered_step_entries_count_as_written():
    h = tiered()
    h.step([new("a", A)])
    h.step([], commits={"a": 9}, free=["a"])
    h.step([new("b", B)])
    assert h.allocator.match_prefix(A, "", ["pool-a"])[0].num_cpu_cached_tokens == 8


def test_cpu_tier_swap_out_of_a_preempted_request_evicts_tier_entries():
    # 4 CPU blocks, all tier entries; a swap preemption of a 2-block request takes the two
    # least recently used.
    h = make_harness(num_blocks=4, num_cpu_blocks=4, num_cpu_cache_blocks=4)
    h.mode = PreemptionMode.SWAP
    h.step([new("a", list(range(16)))], step_id=1)
    h.step([], free=["a"], commit_through=1)
    h.step([new("b", list(range(50, 58)))], step_id=2)  # evicts two: CPU blocks 0, 1
    h.step([new("c", list(range(60, 68)))], step_id=3, commit_through=2)  # two more: 2, 3
    h.step([], commit_through=3)
    assert [e.cpu_block_id for e in h.pool.cpu.entries.values()] == [0, 1, 2, 3]
    # b and c each fill their second block at the next decode: c (behind) is swapped out.
    result = h.step([decode("b", 1), decode("c", 2)], step_id=4)
    assert [p.request_id for p in result.preempted] == ["c"]
    # c's two blocks take CPU blocks 0 and 1 from the tier; b's new block evicts one of c's
    # (cached, now free) into the tier, which reuses its LRU entry's CPU block 2.
    assert [c.dst_block_id for c in result.swap_out] == [0, 1, 2]
    assert h.pool.requests["c"].cpu_block_ids == [0, 1]
    assert [e.cpu_block_id for e in h.pool.cpu.entries.values()] == [3, 2]


def test_cpu_tier_pinned_blocks_are_never_copied_out():
    # A pinned prefix is never evicted, so it never reaches the tier.
    h = make_harness(num_blocks=4, num_cpu_blocks=4, num_cpu_cache_blocks=4)
    h.allocator.limits = Limits(max_batch_items=64, max_pinned_fraction=0.5)
    pool, _ = h.allocator.register_pool(
        PoolConfig("pinned", 4, 4, 4, "fp", "inst-2", True, 4))
    h.allocator.pin_prefix("pinned", A[:4], "", "system")
    h.pool = pool
    h.step([new("a", A)], step_id=1)
    h.step([], free=["a"], commit_through=1)
    result = h.step([new("b", list(range(100, 111)))], step_id=2)  # three blocks: 2, 3, 1
    assert result.swap_out == [BlockCopy(1, 0)]  # a's second block only; block 0 is pinned
    assert h.pool.blocks.blocks[0].block_hash is not None


def test_cpu_tier_off_without_prefix_caching_or_capacity():
    for h in (make_harness(4, 4, 4, caching=False, num_cpu_cache_blocks=4), tiered(tier=0)):
        h.step([new("a", A)], step_id=1)
        h.step([], free=["a"], commit_through=1)
        assert h.step([new("b", B)], step_id=2).swap_out == []
        assert h.pool.cpu.capacity == 0


def test_cpu_tier_larger_than_the_cpu_blocks_is_refused():
    allocator = Allocator(Limits())
    with pytest.raises(InvalidArgument, match="num_cpu_cache_blocks=5 is more than"):
        allocator.register_pool(PoolConfig("p", 4, 4, 4, "fp", "i", True, 5))
    assert allocator.pools == {}


def test_cpu_tier_entry_copied_back_is_not_reused_until_its_step_is_confirmed():
    # Two leases step one pool; their Executes are not ordered against each other. Lease a's
    # step 3 copies CPU blocks 1 and 0 back; until a confirms it, lease b's eviction must not
    # write over them (the tier is full: its block is dropped instead); after, it may.
    h = make_harness(num_blocks=4, num_cpu_blocks=2, num_cpu_cache_blocks=2)
    lease_a = h.allocator.create_lease(60).lease_id
    lease_b = h.allocator.create_lease(60).lease_id
    h.lease_id = lease_a
    cached_a_then_b(h)
    h.step([], free=["b"], commit_through=2)
    hit = h.step([new("c", A)], step_id=3)
    assert hit.swap_in == [BlockCopy(1, 0), BlockCopy(0, 1)]
    assert hit.swap_out == []  # b's evicted blocks: the tier is full of busy entries
    h.lease_id = lease_b
    evicting = h.step([new("d", list(range(200, 204)))], step_id=1)
    assert evicting.swap_out == []
    assert [e.num_loads for e in h.pool.cpu.entries.values()] == [1, 1]
    h.lease_id = lease_a
    h.step([], free=["c"], commit_through=3)
    assert [e.num_loads for e in h.pool.cpu.entries.values()] == [0, 0]
    h.lease_id = lease_b
    h.step([], free=["d"], commit_through=1)
    evicting = h.step([new("e", list(range(300, 316)))], step_id=2)
    # c's two cached blocks are in the tier already (nothing copied); d's takes the least
    # recently used entry's CPU block, 0.
    assert [c.dst_block_id for c in evicting.swap_out] == [0]
