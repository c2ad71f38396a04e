"""Pinned prefixes in the allocator core: held blocks survive eviction, the budget is exact,
pending blocks attach when a commit caches them, unpinned blocks go back to the LRU, resets
keep the pins, bad input changes nothing, and nothing leaks."""

from __future__ import annotations

from typing import Any

import pytest

from allocator_svc.core.allocator import Allocator, Limits
from allocator_svc.core.events import EventKind
from allocator_svc.core.pool import Pool, PoolConfig
from common.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from tests.allocator.conftest import Harness, decode, new

SYSTEM = [1, 2, 3, 4, 5, 6, 7, 8]  # two full blocks of 4


def pinned_harness(num_blocks: int = 8, fraction: float = 0.5, num_cpu_blocks: int = 0,
                   caching: bool = True) -> Harness:
    allocator = Allocator(Limits(max_batch_items=64, max_pinned_fraction=fraction))
    pool, _ = allocator.register_pool(
        PoolConfig("pool-a", num_blocks, 4, num_cpu_blocks, "fp", "inst-1", caching)
    )
    return Harness(allocator, pool)


def pin(h: Harness, tokens: list[int], name: str = "sys", salt: str = "") -> Any:
    status, _ = h.allocator.pin_prefix("pool-a", tokens, salt, name)
    h.allocator.check_invariants()
    return status


def free_ids(pool: Pool) -> list[int]:
    return [b.block_id for b in pool.blocks.free_queue]


def cached_ids(pool: Pool) -> set[int]:
    return {b.block_id for b in pool.blocks.cached.values()}


def state(pool: Pool) -> tuple[Any, ...]:
    """Everything a refused call must leave as it was."""
    return (dict(pool.pins.pins), set(pool.blocks.pinned), pool.blocks.num_pinned,
            [b.ref_count for b in pool.blocks.blocks], free_ids(pool), dict(pool.blocks.cached),
            pool.events.last_seq)


def fill_and_free(h: Harness, rounds: int, first_token: int = 1000) -> None:
    """Eviction pressure: requests as large as the free queue, committed and freed."""
    for r in range(rounds):
        size = h.pool.blocks.num_free * 4
        tokens = list(range(first_token + r * 100, first_token + r * 100 + size))
        h.step([new(f"p{r}", tokens)])
        h.step([], commits={f"p{r}": size}, free=[f"p{r}"])


def test_pin_before_traffic_holds_blocks_once_a_commit_caches_them():
    # Pinned while nothing is cached: 2 pending. a caches blocks 0,1 (the pin holds them
    # from then on) and block 2; freed, only block 2 goes back to the free queue.
    h = pinned_harness()
    status = pin(h, SYSTEM)
    assert (status.num_blocks, status.num_pinned_blocks, status.num_pending_blocks) == (2, 0, 2)
    h.step([new("a", [*SYSTEM, 9, 10, 11])])
    h.step([], commits={"a": 11})
    assert [b.ref_count for b in h.pool.blocks.blocks[:3]] == [2, 2, 1]
    h.step([], free=["a"])
    assert free_ids(h.pool) == [2, 3, 4, 5, 6, 7]
    (listed,) = h.allocator.list_pins("pool-a")
    assert (listed.pin_id, listed.num_pinned_blocks, listed.num_pending_blocks) == (
        status.pin_id, 2, 0)
    # The pin events follow the stores, for observers that ask for them.
    events = h.pool.events.after(0, 100, include_pins=True).events
    assert [(e.kind, e.block_id) for e in events] == [
        (EventKind.STORED, 0), (EventKind.STORED, 1),
        (EventKind.PINNED, 0), (EventKind.PINNED, 1),
    ]


def test_pin_of_cached_free_blocks_revives_them_from_the_free_queue():
    # a caches blocks 0,1,2 and is freed: all three in the queue; pinning the first two
    # takes them out of it at once.
    h = pinned_harness()
    h.step([new("a", [*SYSTEM, 9, 10, 11, 12, 13])])
    h.step([], commits={"a": 13}, free=["a"])
    assert free_ids(h.pool) == [3, 4, 5, 6, 7, 2, 1, 0]
    status = pin(h, SYSTEM)
    assert (status.num_pinned_blocks, status.num_pending_blocks) == (2, 0)
    assert free_ids(h.pool) == [3, 4, 5, 6, 7, 2]


@pytest.mark.parametrize("pinned", [True, False])
def test_pinned_blocks_survive_any_eviction_pressure(pinned):
    # Blocks 0,1 cache SYSTEM; then rounds of requests as large as the free queue evict
    # every free block. With the pin, z still hits SYSTEM in blocks 0,1; without, it misses
    # (the control: the pressure does evict).
    h = pinned_harness()
    if pinned:
        pin(h, SYSTEM)
    h.step([new("a", [*SYSTEM, 9])])
    h.step([], commits={"a": 9}, free=["a"])
    fill_and_free(h, rounds=4)
    h.step([new("z", [*SYSTEM, 77])])
    if pinned:
        assert h.pool.requests["z"].num_cached_tokens == 8 and h.table("z")[:2] == [0, 1]
        assert h.pool.blocks.num_evictions > 0
    else:
        assert h.pool.requests["z"].num_cached_tokens == 0


def test_unpinned_blocks_are_revivable_then_evicted_in_lru_order():
    # Unpinned, the chain goes to the LRU tail last block first (block 0 is evicted last);
    # b revives both; aborted, they go back; a 7-block request then evicts block 1 only.
    h = pinned_harness()
    status = pin(h, SYSTEM)
    h.step([new("a", [*SYSTEM, 9])])
    h.step([], commits={"a": 9}, free=["a"])
    _, released = h.allocator.unpin_prefix("pool-a", status.pin_id)
    h.allocator.check_invariants()
    assert released == 2 and free_ids(h.pool) == [2, 3, 4, 5, 6, 7, 1, 0]
    assert h.pool.blocks.pinned == set() and h.pool.blocks.num_pinned == 0
    unpinned = h.pool.events.after(4, 100, include_pins=True).events
    assert [(e.kind, e.block_id) for e in unpinned] == [
        (EventKind.UNPINNED, 1), (EventKind.UNPINNED, 0)]
    h.step([new("b", [*SYSTEM, 9])])
    assert h.pool.requests["b"].num_cached_tokens == 8 and h.table("b") == [0, 1, 2]
    h.step([], abort=["b"])
    assert free_ids(h.pool) == [2, 3, 4, 5, 6, 7, 1, 0]
    h.step([new("c", list(range(100, 128)))])
    assert h.table("c") == [2, 3, 4, 5, 6, 7, 1]
    assert cached_ids(h.pool) == {0}


def test_pin_budget_is_enforced_exactly_and_a_refused_pin_changes_nothing():
    # Budget 4 of 8 blocks. SYSTEM (2) + its extension (1 more) + another block (1): 4, at the
    # budget. One more block is refused, naming the budget, the pins and the blocks asked.
    # A prefix of a pinned chain adds nothing and is accepted even at the budget.
    h = pinned_harness()
    assert h.pool.pins.budget == 4
    pin(h, SYSTEM, "a")
    pin(h, [*SYSTEM, 9, 10, 11, 12], "b")
    pin(h, [100, 101, 102, 103], "c")
    assert h.pool.pins.num_blocks == 4
    before = state(h.pool)
    with pytest.raises(ResourceExhausted) as info:
        h.allocator.pin_prefix("pool-a", [200, 201, 202, 203], "", "d")
    message = str(info.value)
    assert "pool 'pool-a'" in message and "3 pins hold 4 of its 4 blocks" in message
    assert "1 full blocks, 1 of them not pinned yet" in message
    assert "--max-pinned-fraction" in message
    assert state(h.pool) == before
    h.allocator.check_invariants()
    shorter, created = h.allocator.pin_prefix("pool-a", SYSTEM[:4], "", "e")
    assert created and shorter.num_blocks == 1 and h.pool.pins.num_blocks == 4


def test_pin_longer_than_the_whole_budget_is_refused_before_hashing():
    # 5 full blocks against a budget of 4.
    h = pinned_harness()
    before = state(h.pool)
    with pytest.raises(ResourceExhausted, match="5 full blocks, more than the whole budget"):
        h.allocator.pin_prefix("pool-a", list(range(20)), "", "long")
    assert state(h.pool) == before


def test_pins_sharing_a_prefix_count_it_once_and_unpinning_one_keeps_the_other():
    # a pins SYSTEM, b SYSTEM + 1 block: 3 blocks counted. All cached; unpinning b lets go of
    # its third block only, unpinning a of the first two.
    h = pinned_harness()
    a = pin(h, SYSTEM, "a")
    b = pin(h, [*SYSTEM, 9, 10, 11, 12], "b")
    assert h.pool.pins.num_blocks == 3
    h.step([new("r", [*SYSTEM, 9, 10, 11, 12, 13])])
    h.step([], commits={"r": 13}, free=["r"])
    assert h.pool.blocks.num_pinned == 3 and h.pool.blocks.num_free == 5
    _, released = h.allocator.unpin_prefix("pool-a", b.pin_id)
    assert released == 1 and free_ids(h.pool)[-1] == 2 and h.pool.blocks.num_free == 6
    _, released = h.allocator.unpin_prefix("pool-a", a.pin_id)
    assert released == 2 and free_ids(h.pool)[-3:] == [2, 1, 0]
    h.allocator.check_invariants()


def test_pin_the_same_prefix_again_is_the_same_pin_under_its_name_else_already_exists():
    # Trailing tokens past the last full block do not change the chain.
    h = pinned_harness()
    first = pin(h, SYSTEM, "sys")
    again, created = h.allocator.pin_prefix("pool-a", [*SYSTEM, 9, 10], "", "sys")
    assert not created and again == first
    before = state(h.pool)
    with pytest.raises(AlreadyExists, match=f"as pin '{first.pin_id}' named 'sys'"):
        h.allocator.pin_prefix("pool-a", SYSTEM, "", "other")
    assert state(h.pool) == before


def test_pin_is_per_cache_salt():
    # Pinned under salt t1: a request with no salt caches other blocks, not held; one with
    # t1 caches the pinned chain.
    h = pinned_harness()
    pin(h, SYSTEM, salt="t1")
    h.step([new("a", [*SYSTEM, 9])])
    h.step([], commits={"a": 9}, free=["a"])
    assert h.pool.blocks.num_pinned == 0 and h.pool.blocks.num_free == 8
    h.step([new("b", [*SYSTEM, 9], salt="t1")])
    h.step([], commits={"b": 9}, free=["b"])
    assert h.pool.blocks.num_pinned == 2 and h.pool.blocks.num_free == 6


BAD_PINS = [
    # (pool_id, tokens, salt, name, error, message)
    ("nope", SYSTEM, "", "", NotFound, "unknown pool 'nope'"),
    ("pool-a", [], "", "", InvalidArgument, "at least one full block: 0 token ids"),
    ("pool-a", [1, 2, 3], "", "", InvalidArgument, "at least one full block: 3 token ids"),
    ("pool-a", [1, 2, -3, 4], "", "", InvalidArgument, "token ids must be >= 0, got -3"),
    ("pool-a", SYSTEM, "s" * 257, "", InvalidArgument, "cache_salt has 257 characters"),
    ("pool-a", SYSTEM, "", "n" * 257, InvalidArgument, "name has 257 characters"),
    ("pool-a", list(range(40)), "", "", ResourceExhausted, "more than the whole budget"),
]


@pytest.mark.parametrize(("pool_id", "tokens", "salt", "name", "error", "message"), BAD_PINS)
def test_pin_bad_input_is_refused_and_changes_nothing(pool_id, tokens, salt, name, error,
                                                      message):
    h = pinned_harness()
    pin(h, [50, 51, 52, 53], "kept")
    before = state(h.pool)
    with pytest.raises(error, match=message.replace("(", r"\(")):
        h.allocator.pin_prefix(pool_id, tokens, salt, name)
    assert state(h.pool) == before
    h.allocator.check_invariants()


def test_pin_refused_without_prefix_caching_or_budget():
    # A pool that caches nothing has nothing to pin; a budget of 0 (fraction 0) takes none.
    no_cache = pinned_harness(caching=False)
    with pytest.raises(FailedPrecondition, match="without prefix caching"):
        no_cache.allocator.pin_prefix("pool-a", SYSTEM, "", "")
    no_budget = pinned_harness(fraction=0)
    with pytest.raises(ResourceExhausted, match="0 pins hold 0 of its 0 blocks"):
        no_budget.allocator.pin_prefix("pool-a", SYSTEM[:4], "", "")


def test_unpin_bad_input():
    h = pinned_harness()
    pin(h, SYSTEM)
    before = state(h.pool)
    for pool_id, pin_id, error, message in [
        ("pool-a", "pin-000000000000", NotFound, "unknown pin 'pin-000000000000'"),
        ("pool-a", "", InvalidArgument, "pin_id is required"),
        ("nope", "pin-000000000000", NotFound, "unknown pool 'nope'"),
    ]:
        with pytest.raises(error, match=message):
            h.allocator.unpin_prefix(pool_id, pin_id)
        assert state(h.pool) == before
    with pytest.raises(NotFound):
        h.allocator.list_pins("nope")


def test_pins_survive_a_pool_reset_and_attach_again():
    # The executor restarts: the new pool caches nothing, the pin is kept under its id with
    # every block pending; the first request of the new epoch that commits SYSTEM attaches it.
    h = pinned_harness()
    status = pin(h, SYSTEM)
    h.step([new("a", [*SYSTEM, 9])])
    h.step([], commits={"a": 9})
    pool, reset = h.allocator.register_pool(
        PoolConfig("pool-a", 8, 4, 0, "fp", "inst-2", True))
    assert reset and pool is not h.pool
    (kept,) = h.allocator.list_pins("pool-a")
    assert (kept.pin_id, kept.name, kept.num_pinned_blocks, kept.num_pending_blocks) == (
        status.pin_id, "sys", 0, 2)
    assert pool.blocks.num_free == 8 and pool.events.last_seq == 0
    h2 = Harness(h.allocator, pool)
    h2.step([new("b", [*SYSTEM, 9])])
    h2.step([], commits={"b": 9}, free=["b"])
    assert pool.blocks.num_pinned == 2 and pool.blocks.num_free == 6


def test_pool_reset_drops_the_pins_the_new_pool_cannot_hold():
    # Budget 4 -> 2 (a smaller pool): the 2-block pin made first is kept, the next dropped.
    # A new block size derives the chains again (8 tokens: one block of 8).
    h = pinned_harness()
    first = pin(h, SYSTEM, "a")
    pin(h, [100, 101, 102, 103, 104, 105, 106, 107], "b")
    smaller, _ = h.allocator.register_pool(PoolConfig("pool-a", 4, 4, 0, "fp", "inst-2", True))
    assert [p.pin_id for p in h.allocator.list_pins("pool-a")] == [first.pin_id]
    smaller.check_invariants()
    bigger, _ = h.allocator.register_pool(PoolConfig("pool-a", 8, 8, 0, "fp", "inst-3", True))
    (kept,) = h.allocator.list_pins("pool-a")
    assert (kept.pin_id, kept.num_blocks, kept.num_tokens) == (first.pin_id, 1, 8)
    uncached, _ = h.allocator.register_pool(
        PoolConfig("pool-a", 8, 8, 0, "fp", "inst-4", False))
    assert h.allocator.list_pins("pool-a") == [] and uncached.blocks.pinned == set()


def test_pins_with_forks_and_swaps_keep_their_reference():
    # a holds the pinned SYSTEM blocks, forks c, swaps out: the pin and c still hold them
    # (never in the free queue); everything freed, only the pin holds them; unpinned, all free.
    h = pinned_harness(num_cpu_blocks=4)
    status = pin(h, SYSTEM)
    h.step([new("a", [*SYSTEM, 9])])
    h.step([], commits={"a": 9})
    h.allocator.fork("pool-a", h.pool.epoch, "a", ["c"])
    h.allocator.check_invariants()
    assert [b.ref_count for b in h.pool.blocks.blocks[:2]] == [3, 3]
    h.allocator.swap_out("pool-a", h.pool.epoch, "a")
    h.allocator.check_invariants()
    assert [b.ref_count for b in h.pool.blocks.blocks[:2]] == [2, 2]
    h.step([], free=["a", "c"])
    assert h.pool.blocks.num_free == 6 and [b.ref_count for b in h.pool.blocks.blocks[:2]] == [
        1, 1]
    h.allocator.unpin_prefix("pool-a", status.pin_id)
    h.allocator.check_invariants()
    assert h.pool.blocks.num_free == 8 and len(h.pool.free_cpu_block_ids) == 4


def test_a_decode_that_fills_a_pinned_block_attaches_it():
    # Numbered steps: a's 7-token prompt fills block 0, its decode of token 8 fills block 1;
    # both are cached by commit_through (one block per request per step) and held.
    h = pinned_harness()
    pin(h, SYSTEM)
    h.step([new("a", SYSTEM[:7])], step_id=1)
    h.step([decode("a", 8)], step_id=2, commit_through=1)
    assert h.pool.blocks.num_pinned == 1
    h.step([decode("a", 9)], step_id=3, commit_through=2)
    assert h.pool.blocks.num_pinned == 2
    (listed,) = h.allocator.list_pins("pool-a")
    assert listed.num_pending_blocks == 0


def test_pin_events_are_skipped_unless_asked_for():
    # Stored 1,2, pinned 3,4, stored 5: a reader without include_pins sees 1, 2, 5 (pages
    # filled with block events), one with it sees all five.
    h = pinned_harness()
    pin(h, SYSTEM)
    h.step([new("a", [*SYSTEM, 9, 10, 11, 12, 13])], step_id=1)
    h.step([], commits={"a": 8})
    h.step([], commits={"a": 12})
    log = h.pool.events
    assert [e.seq for e in log.after(0, 100).events] == [1, 2, 5]
    assert [e.seq for e in log.after(2, 1).events] == [5]
    assert [e.seq for e in log.after(0, 100, include_pins=True).events] == [1, 2, 3, 4, 5]
    assert log.after(0, 100).last_seq == 5


def test_nothing_leaks_after_unpin_and_every_request_freed():
    # Pins made, attached, shared by requests, some unpinned mid-way, the pool under
    # pressure: once every pin is gone and every request freed, the pool's accounting is a
    # pool's that never pinned (every block free, no reference, nothing pinned).
    h = pinned_harness(num_blocks=12)
    a = pin(h, SYSTEM, "a")
    b = pin(h, [*SYSTEM, 9, 10, 11, 12], "b")
    h.step([new("r1", [*SYSTEM, 9, 10, 11, 12, 13]), new("r2", [*SYSTEM, 20])])
    h.step([], commits={"r1": 13, "r2": 9})
    h.allocator.unpin_prefix("pool-a", b.pin_id)
    fill_and_free(h, rounds=2)
    h.step([], free=["r1"])
    h.allocator.unpin_prefix("pool-a", a.pin_id)
    h.step([], free=["r2"])
    never = pinned_harness(num_blocks=12).pool
    for pool in (h.pool, never):
        pool.check_invariants()
    assert h.pool.blocks.num_free == never.blocks.num_free == 12
    assert all(b.ref_count == 0 for b in h.pool.blocks.blocks)
    assert (h.pool.blocks.pinned, h.pool.blocks.num_pinned, h.pool.pins.pins,
            h.pool.pins.num_blocks) == (set(), 0, {}, 0)

