"""A KV hand-off's reservation in the core (core/hand_off.py): the table shares exactly the
device-cached prefix, fresh blocks hold the rest, the commit caches the moved blocks under the
hashes a normal admission would, the request then runs as any (decodes, fork, swap,
preemption, abort, lease expiry), and every refusal changes nothing."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from allocator_svc.core.allocator import Allocator, Limits
from allocator_svc.core.events import EventKind
from allocator_svc.core.hand_off import HandOff
from allocator_svc.core.pool import Pool, PoolConfig
from allocator_svc.core.request import Request
from allocator_svc.metrics import AllocatorCollector
from common.block_hash import hash_chain, root_hash
from common.credentials import lease_tag
from common.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
)
from common.step_records import BlockCopy, Commit, PreemptionMode, StepCall, StepItem
from tests.allocator.conftest import Harness, decode, make_harness, new

BS = 4
A = list(range(9))  # two full blocks of 4, and one token
HANDED = list(range(8)) + [90, 91, 92, 93, 94]  # A's two full blocks, then 5 tokens of its own


def call(h: Harness, request_id: str, tokens: list[int], **fields: Any) -> HandOff:
    base = HandOff("pool-a", h.pool.epoch, h.lease_id, request_id, tokens, len(tokens), "", "",
                   "fp", BS)
    return replace(base, **fields)


def hand_off(h: Harness, request_id: str, tokens: list[int], **fields: Any) -> Request:
    request = h.allocator.reserve_hand_off(call(h, request_id, tokens, **fields))
    h.allocator.check_invariants()
    return request


def cache_a(h: Harness) -> None:
    """a caches blocks 0 and 1 (A's full blocks) and is freed: free queue 2..7, 1, 0."""
    h.step([new("a", A)])
    h.step([], commits={"a": 9}, free=["a"])


def snapshot(pool: Pool) -> tuple[Any, ...]:
    """Everything a refused call must leave as it was."""
    return (
        [b.block_id for b in pool.blocks.free_queue], dict(pool.blocks.cached),
        [b.ref_count for b in pool.blocks.blocks], sorted(pool.requests), pool.events.last_seq,
        pool.num_hand_offs, pool.cpu.num_free, len(pool.cpu.entries),
    )


def test_hand_off_shares_the_device_cached_prefix_and_fresh_blocks_hold_the_rest():
    # 13 tokens: A's two cached blocks (revived) are shared, fresh 2 and 3 hold the rest.
    h = make_harness()
    cache_a(h)
    request = hand_off(h, "h", HANDED, num_prompt_tokens=10)
    assert h.table("h") == [0, 1, 2, 3]
    assert (request.num_computed, request.num_committed, request.num_cached_tokens) == (13, 8, 8)
    assert request.block_hashes == hash_chain(root_hash("fp", ""), A, BS)
    assert request.num_prompt_tokens == 10 and request.lease_id is None
    assert [h.pool.blocks.blocks[i].ref_count for i in range(4)] == [1, 1, 1, 1]
    assert h.pool.blocks.num_free == 4
    # Counted apart from the prompts' lookups.
    assert (h.pool.num_hand_offs, h.pool.num_hand_off_tokens,
            h.pool.num_hand_off_cached_tokens) == (1, 13, 8)
    assert (h.pool.num_prefix_queries, h.pool.num_prefix_hits) == (9, 0)


def test_hand_off_every_full_block_may_hit_unlike_an_admission():
    # All 8 tokens are computed: both full blocks hit (an admission keeps its last token).
    h = make_harness()
    h.step([new("a", list(range(12)))])
    h.step([], commits={"a": 12})
    request = hand_off(h, "h", list(range(8)))
    assert h.table("h") == [0, 1] and request.num_cached_tokens == 8
    assert h.pool.blocks.blocks[0].ref_count == h.pool.blocks.blocks[1].ref_count == 2
    h.step([new("b", list(range(8)))])
    assert h.pool.requests["b"].num_cached_tokens == 4


def test_hand_off_a_different_salt_or_prefix_shares_nothing():
    # The last two fresh blocks evict A's cached ones, as an admission's would: BlockRemoved.
    h = make_harness()
    cache_a(h)
    seq = h.pool.events.last_seq
    assert hand_off(h, "salted", HANDED, cache_salt="t1").num_cached_tokens == 0
    assert hand_off(h, "other", [1] + HANDED[1:]).num_cached_tokens == 0
    assert h.table("salted") == [2, 3, 4, 5] and h.table("other") == [6, 7, 1, 0]
    removed = [(e.kind, e.block_id) for e in h.pool.events.after(seq, 100).events]
    assert removed == [(EventKind.REMOVED, 1), (EventKind.REMOVED, 0)]


def test_hand_off_without_prefix_caching_shares_nothing_and_caches_nothing():
    h = make_harness(caching=False)
    h.step([new("a", A)])
    h.step([], commits={"a": 9})
    assert hand_off(h, "h", HANDED).num_cached_tokens == 0 and h.table("h") == [3, 4, 5, 6]
    h.step([], commits={"h": 13})
    assert h.pool.blocks.cached == {}


def test_hand_off_commit_caches_the_hashes_an_admission_and_compute_would():
    # Pool b admits and computes the tokens normally; pool a reserves them by hand-off with
    # a cached prefix. Committed, both hold the same chain, the reference's.
    allocator = Allocator(Limits(max_batch_items=64))
    a, _ = allocator.register_pool(PoolConfig("pool-a", 8, BS, 0, "fp", "i", True))
    b, _ = allocator.register_pool(PoolConfig("pool-b", 8, BS, 0, "fp", "i", True))
    tokens = HANDED + [95, 96, 97]  # 16 tokens: four full blocks
    allocator.step("pool-b", b.epoch, None, StepCall([StepItem("n", 16, tokens, "s")]))
    allocator.free("pool-b", b.epoch, [Commit("n", 16)], [])
    allocator.step("pool-a", a.epoch, None, StepCall([StepItem("a", 9, A, "s")]))
    allocator.free("pool-a", a.epoch, [Commit("a", 9)], ["a"])
    seq = a.events.last_seq
    reserved = allocator.reserve_hand_off(
        HandOff("pool-a", a.epoch, None, "h", tokens, 10, "s", "", "fp", BS))
    assert reserved.num_cached_tokens == 8 and a.events.last_seq == seq  # nothing cached yet
    allocator.free("pool-a", a.epoch, [Commit("h", 16)], [])
    allocator.check_invariants()
    expected = hash_chain(root_hash("fp", "s"), tokens, BS)
    assert reserved.block_hashes == b.requests["n"].block_hashes == expected
    assert [a.blocks.cached[x].block_id for x in expected] == [0, 1, 2, 3]
    stored = [e for e in a.events.after(seq, 100).events if e.kind is EventKind.STORED]
    assert [(e.block_hash, e.parent_hash, e.token_ids) for e in stored] == [
        (expected[2], expected[1], tokens[8:12]), (expected[3], expected[2], tokens[12:16])]


def test_hand_off_then_decodes_and_commits_through_a_later_step():
    # 12 tokens, nothing cached: a decode (its value unknown) opens block 3 at the boundary;
    # committing through that step caches the three moved blocks with that block open.
    h = make_harness()
    tokens = list(range(50, 62))
    hand_off(h, "h", tokens)
    assert h.table("h") == [0, 1, 2]
    result = h.allocator.step(
        "pool-a", h.pool.epoch, None,
        StepCall(decode_request_ids=["h"], step_id=1))
    assert (result.appended_request_ids, result.appended_block_ids) == (["h"], [3])
    h.allocator.step(
        "pool-a", h.pool.epoch, None,
        StepCall(decode_request_ids=["h"], append_request_ids=["h", "h"], append_token_ids=[6, 7],
            step_id=2, commit_through_step_id=1))
    h.allocator.check_invariants()
    request = h.pool.requests["h"]
    assert request.token_ids == tokens + [6, 7] and request.num_computed == 14
    assert request.block_hashes == hash_chain(root_hash("fp", ""), tokens, BS)
    assert {b.block_id for b in h.pool.blocks.cached.values()} == {0, 1, 2}


def test_hand_off_decodes_into_its_private_partial_block():
    h = make_harness()
    cache_a(h)
    hand_off(h, "h", HANDED)
    result = h.step([decode("h", 5)], commits={"h": 13})
    assert result.all_grants(BS) == [] and h.table("h") == [0, 1, 2, 3]
    assert len(h.pool.requests["h"].block_hashes) == 3  # the moved block 2 is cached


def test_hand_off_abort_undoes_the_reservation_and_caches_nothing():
    h = make_harness()
    cache_a(h)
    before = snapshot(h.pool)
    hand_off(h, "h", HANDED)
    h.allocator.abort("pool-a", h.pool.epoch, ["h"])
    h.allocator.check_invariants()
    after = snapshot(h.pool)
    assert after[:6] == (*before[:5], 1)  # the same free queue, cache and counts


def test_hand_off_forks_swaps_out_and_back_in():
    # The child writes into the shared partial block 3: copy-on-write. The parent swaps out
    # and comes back with its decode; its commit then caches the moved block.
    h = make_harness(num_cpu_blocks=4)
    cache_a(h)
    hand_off(h, "h", HANDED)
    (child,) = h.allocator.fork("pool-a", h.pool.epoch, "h", ["c"])
    assert [b.block_id for b in child.blocks] == [0, 1, 2, 3]
    result = h.step([decode("c", 5)])
    assert result.copies == [BlockCopy(3, 4)] and h.table("c") == [0, 1, 2, 4]
    copies = h.allocator.swap_out("pool-a", h.pool.epoch, "h")
    assert copies == [BlockCopy(0, 0), BlockCopy(1, 1), BlockCopy(2, 2), BlockCopy(3, 3)]
    h.allocator.check_invariants()
    result = h.step([decode("h", 6)])
    assert result.swapped_in == ["h"] and len(result.swap_in) == 4
    h.step([], commits={"h": 14})
    assert h.pool.requests["h"].block_hashes == hash_chain(root_hash("fp", ""), HANDED, BS)[:3]


def test_hand_off_request_is_preempted_from_the_tail_like_any():
    # x (3 blocks) runs ahead of h (5 blocks): the pool is full, x's decode opens a block,
    # so h, behind it, is preempted.
    h = make_harness()
    h.step([new("x", list(range(12)))])
    hand_off(h, "h", list(range(100, 120)))
    assert h.pool.blocks.num_free == 0
    result = h.step([decode("x", 1), decode("h", 2)])
    assert [(p.request_id, p.mode) for p in result.preempted] == [
        ("h", PreemptionMode.RECOMPUTE)]
    assert "h" not in h.pool.requests and h.table("x") == [0, 1, 2, 3]


def test_hand_off_counts_revived_cached_blocks_against_the_free_ones():
    # Free: 7, then the cached 1 and 0. 13 tokens need 2 fresh and the 2 revived: 4 > 3,
    # refused; 12 tokens need 1 fresh and 2 revived: they fit.
    h = make_harness()
    cache_a(h)
    h.step([new("y", [7] * 20)])
    before = snapshot(h.pool)
    with pytest.raises(ResourceExhausted, match="3 free blocks"):
        hand_off(h, "h", HANDED)
    assert snapshot(h.pool) == before
    hand_off(h, "h", HANDED[:12])
    assert h.table("h") == [0, 1, 7] and h.pool.blocks.num_free == 0


def test_hand_off_looks_on_the_device_only_and_evicts_nothing_into_the_cpu_tier():
    # A's blocks live in the CPU tier only: MatchPrefix finds them there, a hand-off does
    # not (a CPU hit needs a swap-in). Its fresh blocks evict B's cached blocks, which are
    # dropped, not copied to the tier: no step carries the copy.
    h = make_harness(num_blocks=4, num_cpu_blocks=4, num_cpu_cache_blocks=4)
    h.step([new("a", A)], step_id=1)
    h.step([], free=["a"], commit_through=1)
    h.step([new("b", list(range(100, 116)))], step_id=2)
    h.step([], free=["b"], commit_through=2)
    (match,) = h.allocator.match_prefix(A, "", ["pool-a"])
    assert (match.num_cached_tokens, match.num_cpu_cached_tokens) == (8, 8)
    stores, entries = h.pool.cpu.num_kept, set(h.pool.cpu.entries)
    request = hand_off(h, "h", A)
    assert request.num_cached_tokens == 0 and h.table("h") == [0, 1, 3]
    assert (h.pool.cpu.num_kept, set(h.pool.cpu.entries)) == (stores, entries)
    assert len(h.pool.blocks.cached) == 1 and h.pool.num_prefix_cpu_hits == 0


def test_hand_off_joins_its_lease_and_an_expired_lease_frees_it():
    h = make_harness()
    h.lease_id = h.allocator.create_lease(1.0).lease_id
    cache_a(h)
    hand_off(h, "h", HANDED)
    assert h.pool.requests["h"].lease_id == h.lease_id
    h.now[0] = 2.0
    assert h.allocator.expire_leases() == ["h"]
    h.allocator.check_invariants()
    assert h.pool.blocks.num_free == 8 and len(h.pool.blocks.cached) == 2


def test_hand_off_over_the_tenants_block_quota_is_refused():
    # Quota 4: tenant t holds 3 blocks; a hand-off of 2 more is refused, of another tenant
    # or none it goes in; a tenant holding nothing gets in even past the quota.
    allocator = Allocator(Limits(max_batch_items=64, max_blocks_per_tenant=4))
    pool, _ = allocator.register_pool(PoolConfig("pool-a", 16, BS, 0, "fp", "i", True))
    allocator.step(
        "pool-a", pool.epoch, None,
        StepCall([StepItem("t1", 12, [1] * 12, "", tenant="t")]))
    h = Harness(allocator, pool)
    before = snapshot(pool)
    with pytest.raises(ResourceExhausted, match="tenant 't' holds 3 blocks.*quota of 4"):
        hand_off(h, "h", [2] * 8, tenant="t")
    assert snapshot(pool) == before
    hand_off(h, "h", [2] * 8, tenant="u")
    hand_off(h, "big", [3] * 24, tenant="v")
    hand_off(h, "none", [4] * 8)


def test_hand_off_refusals_change_nothing():
    allocator = Allocator(Limits(max_batch_items=64))
    pool, _ = allocator.register_pool(PoolConfig("pool-a", 8, BS, 0, "fp", "i", True))
    allocator.register_pool(PoolConfig("other-model", 8, BS, 0, "fp2", "i", True))
    allocator.register_pool(PoolConfig("other-size", 8, 8, 0, "fp", "i", True))
    allocator.register_pool(PoolConfig("same", 8, BS, 0, "fp", "i", True))
    mine = allocator.create_lease(60.0).lease_id
    theirs = allocator.create_lease(60.0).lease_id
    h = Harness(allocator, pool, lease_id=mine)
    cache_a(h)
    hand_off(h, "held", [5] * 5)
    h.lease_id = theirs
    hand_off(h, "theirs", [6] * 5)
    h.lease_id = mine
    before = snapshot(pool)
    cases: list[tuple[type[Exception], str, dict[str, Any]]] = [
        (NotFound, "unknown pool", {"pool_id": "nope"}),
        (FailedPrecondition, "epoch", {"epoch": pool.epoch + 1}),
        (NotFound, f"{lease_tag('gone')} is unknown", {"lease_id": "gone"}),
        (InvalidArgument, "request_id is required", {"request_id": ""}),
        (InvalidArgument, "request_id has 257", {"request_id": "r" * 257}),
        (InvalidArgument, "cache_salt has 257", {"cache_salt": "s" * 257}),
        (InvalidArgument, "token_ids is empty", {"token_ids": []}),
        (InvalidArgument, ">= 0", {"token_ids": [1, -2, 3]}),
        (InvalidArgument, "num_prompt_tokens=14 is more than its 13",
         {"num_prompt_tokens": 14}),
        (InvalidArgument, "source_block_size is required", {"source_block_size": 0}),
        (InvalidArgument, "both the source and the target", {"source_pool_id": "pool-a"}),
        (FailedPrecondition, "the source has model fingerprint 'fp2', target pool 'pool-a' "
         "has 'fp'", {"source_model_fingerprint": "fp2"}),
        (FailedPrecondition, "the source has block size 8, target pool 'pool-a' has 4",
         {"source_block_size": 8}),
        (FailedPrecondition, "source pool 'other-model' has model fingerprint 'fp2'",
         {"source_pool_id": "other-model"}),
        (FailedPrecondition, "source pool 'other-size' has block size 8",
         {"source_pool_id": "other-size"}),
        (AlreadyExists, "'held' is already in pool", {"request_id": "held"}),
        (PermissionDenied, "belongs to another lease", {"request_id": "theirs"}),
        (ResourceExhausted, "needs 9 blocks; pool 'pool-a' has 8 in all",
         {"token_ids": [1] * 33}),
        (ResourceExhausted, "4 free blocks", {"token_ids": [1] * 24}),
    ]
    for error, message, fields in cases:
        with pytest.raises(error, match=message):
            h.allocator.reserve_hand_off(replace(call(h, "h", HANDED), **fields))
        assert snapshot(pool) == before, fields
    # A source pool of this allocator with the same layout, or one it does not hold: fine.
    h.allocator.abort("pool-a", pool.epoch, ["held"], mine)
    hand_off(h, "h", HANDED, source_pool_id="same")
    hand_off(h, "h2", [7], source_pool_id="on-another-shard")


def test_hand_off_metrics_count_hand_offs_apart_from_prompts():
    h = make_harness()
    cache_a(h)
    hand_off(h, "h", HANDED)
    samples = {s.name: s.value for family in AllocatorCollector(h.allocator).collect()
               for s in family.samples if s.labels.get("pool_id") == "pool-a"}
    assert (samples["pagedkv_allocator_handoffs_total"],
            samples["pagedkv_allocator_handoff_tokens_total"],
            samples["pagedkv_allocator_handoff_cached_tokens_total"]) == (1, 13, 8)
    assert (samples["pagedkv_allocator_prefix_cache_queries_total"],
            samples["pagedkv_allocator_prefix_cache_hits_total"]) == (9, 0)
