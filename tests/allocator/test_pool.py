"""Per-request operations: admission with prefix hits, commit, copy-on-write, swap, free order."""

from common.step_records import PreemptionMode, StepItem
from tests.allocator.conftest import decode, make_harness, new


def test_pool_admit_allocates_on_demand_and_grows_by_block(harness):
    # 6-token prompt, block size 4: blocks 0,1; decoding 2 more fills block 1, a 3rd opens 2.
    result = harness.step([new("a", [1, 2, 3, 4, 5, 6])])
    (grant,) = result.grants
    assert (grant.delta_start, grant.block_ids, grant.num_scheduled) == (0, [0, 1], 6)
    assert harness.step([decode("a", 7)], commits={"a": 6}).grants == []
    assert harness.step([decode("a", 8)], commits={"a": 7}).grants == []
    (grant,) = harness.step([decode("a", 9)], commits={"a": 8}).grants
    assert (grant.delta_start, grant.block_ids, grant.start_position) == (2, [2], 8)
    assert harness.table("a") == [0, 1, 2]


def test_pool_prefix_hit_reuses_committed_blocks_and_caps_last_token(harness):
    # a commits 8 tokens (2 full blocks); b with the same 8-token prompt reuses block 0 only,
    # because at least its last prompt token must be computed.
    harness.step([new("a", list(range(8)))])
    harness.step([], commits={"a": 8}, free=["a"])
    result = harness.step([new("b", list(range(8)))])
    (grant,) = result.grants
    assert (grant.num_cached_tokens, grant.start_position, grant.num_scheduled) == (4, 4, 4)
    assert grant.block_ids[0] == 0
    # c shares 8 tokens then diverges: both full blocks hit.
    harness.step([new("c", list(range(8)) + [99, 98])])
    assert harness.pool.requests["c"].num_cached_tokens == 8
    assert harness.table("c")[:2] == [0, 1]
    assert harness.pool.blocks.blocks[0].ref_count == 2


def test_pool_uncommitted_blocks_are_not_cached(harness):
    # Commit rule: a step that never confirmed its KV leaves nothing in the cache.
    harness.step([new("a", list(range(8)))])
    harness.step([], abort=["a"])
    assert harness.pool.blocks.cached == {}
    result = harness.step([new("b", list(range(8)))])
    assert result.grants[0].num_cached_tokens == 0


def test_pool_cache_salt_isolates_tenants(harness):
    # Same prompt, different salt: no hit.
    harness.step([new("a", list(range(9)), salt="t1")])
    harness.step([], commits={"a": 9})
    harness.step([new("b", list(range(9)), salt="t2")])
    harness.step([new("c", list(range(9)), salt="t1")])
    assert harness.pool.requests["b"].num_cached_tokens == 0
    assert harness.pool.requests["c"].num_cached_tokens == 8


def test_pool_free_order_keeps_prefix_longest(harness):
    # Freed last block first: the prefix block 0 sits at the LRU tail, evicted last.
    harness.step([new("a", list(range(12)))])
    harness.step([], commits={"a": 12}, free=["a"])
    tail = [b.block_id for b in harness.pool.blocks.free_queue][-3:]
    assert tail == [2, 1, 0]


def test_pool_fork_copy_on_write_of_shared_partial_block(harness):
    # Parent holds 6 tokens (blocks 0, 1 partial); two children share both. The first child
    # to write gets a private copy of block 1; the last holder writes in place.
    harness.step([new("p", list(range(6)))])
    harness.allocator.fork("pool-a", harness.pool.epoch, "p", ["c1", "c2"])
    harness.step([], commits={"p": 6}, free=["p"])
    assert harness.pool.blocks.blocks[1].ref_count == 2
    result = harness.step([decode("c1", 50)])
    assert [(c.src_block_id, c.dst_block_id) for c in result.copies] == [(1, 2)]
    assert (result.grants[0].delta_start, result.grants[0].block_ids) == (1, [2])
    assert harness.table("c1") == [0, 2]
    result = harness.step([decode("c2", 60)])
    assert result.copies == [] and harness.table("c2") == [0, 1]


def test_pool_swap_out_and_in_restores_table_with_copies():
    # Swap mode: preempted request's 2 blocks go to CPU blocks and come back later.
    h = make_harness(num_blocks=4, block_size=4, num_cpu_blocks=4)
    h.mode = PreemptionMode.SWAP
    h.step([new("a", list(range(8))), new("b", list(range(100, 108)))])
    h.step([], commits={"a": 8, "b": 8})
    result = h.step([decode("a", 1), decode("b", 2)])
    assert [(p.request_id, p.mode) for p in result.preempted] == [("b", PreemptionMode.SWAP)]
    assert [(c.src_block_id, c.dst_block_id) for c in result.swap_out] == [(2, 0), (3, 1)]
    assert h.pool.requests["b"].swapped
    h.step([], commits={"a": 9}, free=["a"])
    result = h.step([decode("b", 3)])
    (grant,) = result.grants
    assert grant.delta_start == 0 and len(grant.block_ids) == 3
    assert [c.src_block_id for c in result.swap_in] == [0, 1]
    assert grant.start_position == 8


def test_pool_swapped_in_blocks_are_cached_only_after_commit():
    # Commit rule across swap: a swapped-in request whose step then fails (abort) leaves no
    # cache entry behind; once its step is committed, its blocks are cached again.
    h = make_harness(num_blocks=4, block_size=4, num_cpu_blocks=4)
    h.mode = PreemptionMode.SWAP
    h.step([new("a", list(range(8))), new("b", list(range(100, 108)))])
    h.step([], commits={"a": 8, "b": 8})
    h.step([decode("a", 1), decode("b", 2)])  # b is swapped out
    h.step([new("x", [7] * 5)], commits={"a": 9}, free=["a"])  # evicts b's cached blocks
    h.step([], abort=["x"])
    assert h.pool.requests["b"].swapped
    h.step([decode("b", 3)])  # swap-in grant: copies not executed yet
    assert all(block.block_hash is None for block in h.pool.requests["b"].blocks)
    h.step([], abort=["b"])  # that step failed
    assert h.step([new("c", list(range(100, 109)))]).grants[0].num_cached_tokens == 0
    h.step([], abort=["c"])
    # The same path with a successful step: the next commit caches b's blocks.
    h2 = make_harness(num_blocks=4, block_size=4, num_cpu_blocks=4)
    h2.mode = PreemptionMode.SWAP
    h2.step([new("a", list(range(8))), new("b", list(range(100, 108)))])
    h2.step([], commits={"a": 8, "b": 8})
    h2.step([decode("a", 1), decode("b", 2)])
    h2.step([], commits={"a": 9}, free=["a"])
    h2.step([decode("b", 3)])
    h2.step([], commits={"b": 9}, free=["b"])
    assert h2.step([new("c", list(range(100, 108)) + [2])]).grants[0].num_cached_tokens == 8


def test_pool_prefix_counters_count_each_prompt_once():
    # vLLM's counting: a request readmitted after a recompute preemption (resumed) looks its
    # prefix up again, and that lookup is counted apart, not as a second query and hit.
    harness = make_harness(num_blocks=16)
    harness.step([new("a", list(range(8)))])
    harness.step([], commits={"a": 8}, free=["a"])
    harness.step([new("b", list(range(8)) + [50, 51])])
    pool = harness.pool
    assert (pool.num_prefix_queries, pool.num_prefix_hits) == (18, 8)
    harness.step([], commits={"b": 10}, free=["b"])
    resumed = StepItem("b", 11, list(range(8)) + [50, 51, 52], "", resumed=True)
    harness.step([resumed])
    assert (pool.num_prefix_queries, pool.num_prefix_hits) == (18, 8)
    assert (pool.num_resumed_prefix_queries, pool.num_resumed_prefix_hits) == (11, 8)


def test_pool_prefix_counters_stay_zero_with_caching_off():
    harness = make_harness(num_blocks=16, caching=False)
    harness.step([new("a", list(range(8)))])
    harness.step([], commits={"a": 8}, free=["a"])
    harness.step([new("b", list(range(8)))])
    harness.step([StepItem("c", 4, [1, 2, 3, 4], "", resumed=True)])
    pool = harness.pool
    assert (pool.num_prefix_queries, pool.num_prefix_hits,
            pool.num_resumed_prefix_queries, pool.num_resumed_prefix_hits) == (0, 0, 0, 0)


def test_pool_numbered_steps_never_commit_older_counts_into_swapped_in_blocks():
    # Pipelined commits (commit_through): b's first 8 tokens were granted by step 1, then b
    # was swapped out (step 2) and back in (step 3) to fresh blocks, which its swap-in copies
    # fill only when step 3's batch runs. Committing through step 2 must not cache them
    # (a prefix hit would read KV not there yet); committing through step 3 does.
    h = make_harness(num_blocks=4, block_size=4, num_cpu_blocks=4)
    h.mode = PreemptionMode.SWAP
    h.step([new("a", list(range(8))), new("b", list(range(100, 108)))], step_id=1)
    h.step([decode("a", 1), decode("b", 2)], step_id=2)
    assert h.pool.requests["b"].swapped
    h.step([decode("b", 3)], free=["a"], step_id=3)
    assert not h.pool.requests["b"].swapped
    h.step([], commit_through=2)
    assert all(block.block_hash is None for block in h.pool.requests["b"].blocks)
    assert not h.pool.blocks.by_key  # nothing a prefix lookup could hit
    h.step([], commit_through=3)
    assert all(block.block_hash is not None for block in h.pool.requests["b"].blocks[:2])


def test_pool_a_request_that_skips_the_lookup_computes_its_whole_prompt_and_still_caches():
    # A request asking for its prompt's logprobs reads no cached prefix (and counts no
    # query); its full blocks are committed as usual, so the next request hits them.
    harness = make_harness(num_blocks=16)
    harness.step([new("a", list(range(8)))])
    harness.step([], commits={"a": 8}, free=["a"])
    skipping = StepItem("b", 9, list(range(8)) + [50], "", skip_prefix_lookup=True)
    grant = harness.step([skipping]).grants[0]
    assert (grant.num_cached_tokens, grant.num_scheduled) == (0, 9)
    pool = harness.pool
    assert (pool.num_prefix_queries, pool.num_prefix_hits) == (8, 0)
    harness.step([], commits={"b": 9}, free=["b"])
    assert harness.step([new("c", list(range(8)) + [51])]).grants[0].num_cached_tokens == 8
