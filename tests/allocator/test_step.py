"""The batched step: preemption from the tail, admission from free space only, atomicity."""

from common.step_records import PreemptionMode, StepItem
from tests.allocator.conftest import decode, make_harness, new


def chunk(request_id: str, num_tokens: int) -> StepItem:
    return StepItem(request_id, num_tokens)


def test_step_preempts_from_tail_of_priority_order():
    # 4 blocks of 4: a, b, c hold one full block each. a and b need a new block each
    # (1 free): a takes the free one, b preempts c (the tail) and takes its block.
    h = make_harness(num_blocks=4, block_size=4)
    h.step([new("a", [1] * 4), new("b", [2] * 4), new("c", [3] * 4)])
    result = h.step(
        [decode("a", 1), decode("b", 2), decode("c", 3)], commits={"a": 4, "b": 4, "c": 4}
    )
    assert [p.request_id for p in result.preempted] == ["c"]
    assert result.preempted[0].mode is PreemptionMode.RECOMPUTE
    assert "c" not in h.pool.requests
    assert h.table("a") == [0, 3] and h.table("b") == [1, 2]


def test_step_preempts_itself_when_nobody_is_behind():
    # The last running request that cannot grow is preempted, not the ones ahead of it.
    h = make_harness(num_blocks=2, block_size=4)
    h.step([new("a", [1] * 4), new("b", [2] * 4)])
    result = h.step([decode("a", 1), decode("b", 2)], commits={"a": 4, "b": 4})
    assert [p.request_id for p in result.preempted] == ["b"]
    assert h.table("a") == [0, 1]


def test_step_new_requests_admitted_in_order_stop_at_first_misfit():
    # 3 free blocks: x needs 2 (admitted), y needs 2 (deferred), z needs 1 (deferred too).
    h = make_harness(num_blocks=3, block_size=4)
    result = h.step([new("x", [1] * 8), new("y", [2] * 8), new("z", [3] * 4)])
    assert [g.request_id for g in result.grants] == ["x"]
    assert result.deferred == ["y", "z"]
    assert set(h.pool.requests) == {"x"}


def test_step_admits_nothing_new_in_a_step_that_preempted():
    # b preempts c; the new request d would fit afterwards but waits for the next step.
    h = make_harness(num_blocks=4, block_size=4)
    h.step([new("a", [1] * 4), new("b", [2] * 4), new("c", [3] * 4)])
    result = h.step(
        [decode("a", 1), decode("b", 2), decode("c", 3), new("d", [4])],
        commits={"a": 4, "b": 4, "c": 4},
    )
    assert result.deferred == ["d"]


def test_step_chunked_prefill_continues_known_request():
    # 10-token prompt in chunks of 4: grants 4 at 0, then 4 at 4, then the last 2 at 8.
    h = make_harness(num_blocks=8, block_size=4)
    first = h.step([new("a", list(range(10)), num_tokens=4)]).grants[0]
    assert (first.start_position, first.num_scheduled, first.block_ids) == (0, 4, [0])
    second = h.step([chunk("a", 4)], commits={"a": 4}).grants[0]
    assert (second.start_position, second.num_scheduled, second.block_ids) == (4, 4, [1])
    third = h.step([chunk("a", 4)], commits={"a": 8}).grants[0]
    assert (third.start_position, third.num_scheduled, third.block_ids) == (8, 2, [2])


def test_step_prefix_hit_revives_cached_free_blocks_counting_them():
    # Pool of 3: a's 2 committed blocks are free but cached; b (same 9 tokens) revives
    # both and needs 1 more, exactly the pool.
    h = make_harness(num_blocks=3, block_size=4)
    h.step([new("a", list(range(9)))])
    h.step([], commits={"a": 9}, free=["a"])
    result = h.step([new("b", list(range(9)))])
    assert result.grants[0].num_cached_tokens == 8
    assert h.table("b")[:2] == [0, 1]
    assert h.pool.num_prefix_hits == 8


def test_step_new_lease_after_expiry_frees_old_requests_for_readmission():
    # A gateway whose lease ran out (before the sweep) takes a new lease and readmits the
    # same request id: the expired lease's requests are freed first, not ALREADY_EXISTS.
    h = make_harness(num_blocks=4, block_size=4)
    old = h.allocator.create_lease(1.0)
    h.lease_id = old.lease_id
    h.step([new("a", [1] * 8)])
    h.now[0] = 5.0  # the lease expired; no sweep ran
    h.lease_id = h.allocator.create_lease(1.0).lease_id
    (grant,) = h.step([new("a", [1] * 8)]).grants
    assert grant.new_request and h.table("a") == [0, 1]
    assert h.pool.blocks.num_free == 2
