"""Whom a short step preempts, and how (allocator_svc/core/victims.py): the tail of the
priority order, or by cost among the least urgent behind the request that is short."""

from __future__ import annotations

import pytest

from allocator_svc.core.victims import PreemptionPolicy
from common.step_records import PreemptionMode, StepItem
from tests.allocator.conftest import Harness, decode, make_harness, new

TAIL, COST = PreemptionPolicy.TAIL, PreemptionPolicy.COST
RECOMPUTE, SWAP = PreemptionMode.RECOMPUTE, PreemptionMode.SWAP


def preempted(result) -> list[tuple[str, PreemptionMode]]:
    return [(p.request_id, p.mode) for p in result.preempted]


def short_and_long(policy: PreemptionPolicy, **pool) -> tuple[Harness, object]:
    # Six blocks of 4, all held: a and c one full block each, b 15 tokens in four. a and c
    # each need a fresh block to decode; b's token fits its last block.
    h = make_harness(num_blocks=6, block_size=4, policy=policy, **pool)
    h.step([new("a", [1] * 4), new("c", [2] * 4), new("b", [3] * 15)])
    result = h.step([decode("a", 1), decode("c", 2), decode("b", 3)],
                    commits={"a": 4, "c": 4, "b": 15})
    return h, result


def test_tail_preempts_the_last_however_long():
    h, result = short_and_long(TAIL)
    assert preempted(result) == [("b", RECOMPUTE)]  # 15 tokens to compute again
    assert set(h.pool.requests) == {"a", "c"}


def test_cost_preempts_the_one_that_wastes_least_for_the_block_it_needs():
    # a lacks one block: c gives it for 4 tokens computed again, b for 15. c goes, and b
    # decodes on.
    h, result = short_and_long(COST)
    assert preempted(result) == [("c", RECOMPUTE)]
    assert set(h.pool.requests) == {"a", "b"}
    assert h.pool.requests["b"].num_computed == 16


def shared_prefix(policy: PreemptionPolicy) -> tuple[Harness, object]:
    # z and y share z's committed first block (y found it cached); x holds two blocks of its
    # own; `held` holds the rest of the pool and is not in the step. a, ahead of them all,
    # needs one more block and none is free; the others' tokens fit their last blocks.
    h = make_harness(num_blocks=8, block_size=4, policy=policy)
    prefix = [7, 7, 7, 7]
    h.step([new("a", [1] * 4), new("z", [*prefix, 5, 5])])
    h.step([new("y", [*prefix, 6, 6, 6])], commits={"a": 4, "z": 6})
    h.step([new("x", [9] * 7), new("held", [8] * 8)], commits={"y": 7})
    assert h.pool.requests["y"].num_cached_tokens == 4 and h.pool.blocks.num_free == 0
    return h, h.step([decode("a", 1), decode("z", 2), decode("y", 3), decode("x", 4)])


def test_cost_counts_a_shared_prefix_as_not_lost():
    # Each gives a its one block: z for 2 tokens computed again (its first block stays, y
    # holds it), y for 3, x for 7. The tail policy takes x.
    _, tail = shared_prefix(TAIL)
    assert preempted(tail) == [("x", RECOMPUTE)]
    h, result = shared_prefix(COST)
    assert preempted(result) == [("z", RECOMPUTE)]
    assert h.pool.requests["y"].blocks[0].ref_count == 1  # z's reference to it is gone
    assert set(h.pool.requests) == {"a", "y", "x", "held"}


def test_cost_never_takes_one_more_urgent_than_another_candidate():
    # As short_and_long, but b is less urgent (priority 1): b goes, costly as it is.
    h = make_harness(num_blocks=6, block_size=4, policy=COST)
    h.step([new("a", [1] * 4), new("c", [2] * 4), StepItem("b", 15, [3] * 15, priority=1)])
    result = h.step([decode("a", 1), decode("c", 2), decode("b", 3)])
    assert preempted(result) == [("b", RECOMPUTE)]
    assert set(h.pool.requests) == {"a", "c"}


def test_cost_swaps_where_it_may_and_recomputes_where_cpu_blocks_are_short():
    # Swap mode: copying c's block out and back costs less than its 4 tokens; with no CPU
    # block free it is recomputed instead (the tail policy would swap, or fall back).
    for num_cpu_blocks, mode in ((4, SWAP), (0, RECOMPUTE)):
        h = make_harness(num_blocks=6, block_size=4, policy=COST, num_cpu_blocks=num_cpu_blocks)
        h.mode = SWAP
        h.step([new("a", [1] * 4), new("c", [2] * 4), new("b", [3] * 15)])
        result = h.step([decode("a", 1), decode("c", 2), decode("b", 3)])
        assert preempted(result) == [("c", mode)]
        assert ("c" in h.pool.requests) is (mode is SWAP)


@pytest.mark.parametrize(("policy", "victims"), [(TAIL, ["c2", "q"]), (COST, ["q"])])
def test_cost_skips_a_request_whose_blocks_are_all_shared(policy, victims):
    # c1 and c2 are forks of p that computed nothing since: preempting either frees nothing.
    # a, short of a block, gets q's; the tail policy preempts c2 first, for nothing.
    h = make_harness(num_blocks=5, block_size=4, policy=policy)
    h.step([new("a", [1] * 4), new("p", [2] * 6), new("q", [3] * 4)])
    h.allocator.fork("pool-a", h.pool.epoch, "p", ["c1", "c2"])
    h.step([new("r", [4] * 4)])
    assert h.pool.blocks.num_free == 0
    result = h.step([decode("a", 1), decode("q", 3), StepItem("c2", 0)])
    assert [rid for rid, _ in preempted(result)] == victims


@pytest.mark.parametrize("policy", [TAIL, COST])
def test_the_last_request_short_of_a_block_preempts_itself(policy):
    # a's token fits its block; b, last in the order, needs a block: nobody is behind it.
    h = make_harness(num_blocks=2, block_size=4, policy=policy)
    h.step([new("a", [1] * 3), new("b", [2] * 4)])
    result = h.step([decode("a", 1), decode("b", 2)])
    assert preempted(result) == [("b", RECOMPUTE)]
    assert set(h.pool.requests) == {"a"}


@pytest.mark.parametrize(("policy", "victim"), [(TAIL, "u"), (COST, "a")])
def test_cost_never_takes_a_request_more_urgent_than_the_one_short(policy, victim):
    # The decode column comes first, whatever the levels: a (priority 1) decodes ahead of u
    # (priority 0, a prefill chunk behind it). a needs a block: by cost it preempts itself
    # rather than the more urgent u; the tail policy takes u.
    h = make_harness(num_blocks=3, block_size=4, policy=policy)
    h.step([StepItem("a", 4, [1] * 4, priority=1), StepItem("u", 4, [2] * 8, priority=0)])
    assert h.pool.blocks.num_free == 1
    h.step([new("x", [3] * 4)])  # the last block
    result = h.step([decode("a", 1), StepItem("u", 4)])
    assert [rid for rid, _ in preempted(result)][0] == victim


def test_cost_falls_through_to_a_more_urgent_level_when_the_least_urgent_frees_nothing():
    # Behind a: q (priority 1) and the forks c1, c2 (priority 2) sharing all their blocks.
    # The forks would free nothing: q goes.
    h = make_harness(num_blocks=5, block_size=4, policy=COST)
    h.step([new("a", [1] * 4), StepItem("q", 4, [3] * 4, priority=1),
            StepItem("p", 6, [2] * 6, priority=2)])
    h.allocator.fork("pool-a", h.pool.epoch, "p", ["c1", "c2"])
    h.step([new("r", [4] * 4)])
    assert h.pool.blocks.num_free == 0
    result = h.step([decode("a", 1), decode("q", 3), StepItem("c2", 0), StepItem("c1", 0)])
    assert [rid for rid, _ in preempted(result)] == ["q"]


def test_a_swap_may_evict_cpu_tier_entries_as_a_swap_out_does():
    # No CPU block is free, but the prefix cache's CPU tier holds entries that may go: the
    # cost policy swaps c out over them, as the tail policy's swap would.
    h = make_harness(num_blocks=6, block_size=4, policy=COST, num_cpu_blocks=2,
                     num_cpu_cache_blocks=2)
    h.mode = SWAP
    h.step([new("old", [9] * 8)])
    h.step([], commits={"old": 8}, free=["old"])
    h.step([new("e1", [8] * 24)])  # evicts old's cached blocks into the CPU tier
    h.step([], commits={"e1": 24}, free=["e1"])
    assert h.pool.cpu.num_free == 0 and len(h.pool.cpu.entries) == 2
    h.step([new("a", [1] * 4), new("c", [2] * 4), new("b", [3] * 15)])
    result = h.step([decode("a", 1), decode("c", 2), decode("b", 3)])
    assert preempted(result) == [("c", SWAP)]
