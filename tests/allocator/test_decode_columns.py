"""Decodes in their column (the wire's decode_request_ids: one more token each) against the
same decodes as `StepItem`s of one token, with the same values appended.

The column has its own fast path in the core. Its reference is the general path:
two allocators take the same random operations, one sending decodes in the column and
one as items. Every step must give the same grants, preemptions, deferrals and copies. The
tables, free queue order, prefix cache and event stream must also stay identical, whether
the fast path served the step or fell back (a shortage, a shared block).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from allocator_svc.core.allocator import Allocator, Limits
from allocator_svc.core.pool import Pool, PoolConfig
from allocator_svc.core.step import StepResult
from common.errors import InvalidArgument, NotFound
from common.step_records import PreemptionMode, StepCall, StepItem
from tests.allocator.conftest import make_harness, new

BLOCK_SIZE = 2


def _allocator() -> tuple[Allocator, Pool, str]:
    """A small pool, and a lease every call is made under (as the gateway calls)."""
    allocator = Allocator(Limits(max_batch_items=64, event_capacity=1 << 16))
    pool, _ = allocator.register_pool(PoolConfig("p", 10, BLOCK_SIZE, 4, "fp", "i", True))
    return allocator, pool, allocator.create_lease(600.0).lease_id


def _outcome(result: StepResult) -> tuple:
    return (
        [
            (
                g.request_id,
                g.delta_start,
                g.block_ids,
                g.num_scheduled,
                g.start_position,
                g.num_cached_tokens,
                g.new_request,
            )
            for g in result.all_grants(BLOCK_SIZE)
        ],
        [(p.request_id, p.mode) for p in result.preempted],
        result.deferred,
        result.copies,
        result.swap_out,
        result.swap_in,
    )


def _state(pool: Pool) -> tuple:
    queue, block = [], pool.blocks.free_queue.head
    while block is not None:
        queue.append(block.block_id)
        block = block.next
    requests = {
        r.request_id: (
            r.token_ids,
            r.num_computed,
            r.num_committed,
            [b.block_id for b in r.blocks],
            r.block_hashes,
            r.cpu_block_ids,
        )
        for r in pool.requests.values()
    }
    cached = sorted((h, b.block_id) for h, b in pool.blocks.cached.items())
    events = pool.events.after(0, 1 << 16).events
    return queue, requests, cached, events


decode_op = st.tuples(
    st.just("decode"),
    st.lists(st.integers(0, 3), min_size=1, max_size=6),
    st.booleans(),
    st.booleans(),
    st.booleans(),
    st.integers(-1, 5),  # >= 0: also free (or abort) a request in the same call
    st.booleans(),
)
admit_op = st.tuples(
    st.just("admit"), st.lists(st.integers(0, 3), min_size=1, max_size=7), st.integers(1, 7)
)
operation = st.one_of(
    decode_op,  # listed three times: the path under test
    admit_op,
    decode_op,
    st.tuples(st.just("free"), st.integers(0, 5)),
    decode_op,
    st.tuples(st.just("fork"), st.integers(0, 5)),
    admit_op,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(operations=st.lists(operation, min_size=10, max_size=40))
def test_columns_and_items_agree(operations):
    columns, items = _allocator(), _allocator()
    next_id = 0
    step_id = 0  # both get the same numbered steps
    for op in operations:
        running = sorted(columns[1].requests)
        if op[0] == "admit":
            _, prompt, chunk = op
            rid, next_id = f"r{next_id}", next_id + 1
            calls = [(a, dict(items=[new(rid, prompt, chunk)])) for a in (columns, items)]
        elif op[0] == "decode":
            _, tokens, swap, commit_previous, any_request, release, abort = op
            # Plain decodes: requests whose every known token is computed. Or any request
            # not swapped out (a decode must not be), prompts still in prefill too.
            held = columns[1].requests
            plain = [
                r
                for r in running
                if not held[r].swapped
                and (any_request or held[r].num_computed == len(held[r].token_ids))
            ]
            pairs = list(zip(plain, tokens, strict=False))
            ids, toks = [r for r, _ in pairs], [t for _, t in pairs]
            others = [r for r in running if r not in ids]
            released = [others.pop(release % len(others))] if release >= 0 and others else []
            # The rest continue their prefill, as general items behind the decodes.
            chunks = [StepItem(r, 2) for r in others if r not in plain]
            if not pairs:
                continue
            mode = PreemptionMode.SWAP if swap else PreemptionMode.RECOMPUTE
            step_id += 1
            common = dict(mode=mode, step_id=step_id, append_request_ids=ids,
                          append_token_ids=toks,
                          commit_through_step_id=step_id - 1 if commit_previous else 0,
                          **{"abort_request_ids" if abort else "free_request_ids": released})
            as_items = [StepItem(r, 1) for r in ids]
            calls = [
                (columns, dict(decode_request_ids=ids, items=chunks, **common)),
                (items, dict(items=as_items + chunks, **common)),
            ]
        elif op[0] == "free":
            if not running:
                continue
            victim = running[op[1] % len(running)]
            for allocator, pool, lease in (columns, items):
                allocator.free("p", pool.epoch, [], [victim], lease)
            assert _state(columns[1]) == _state(items[1])
            continue
        else:
            ready = [r for r in running if not columns[1].requests[r].swapped]
            if not ready:
                continue
            parent = ready[op[1] % len(ready)]
            child, next_id = f"r{next_id}", next_id + 1
            for allocator, pool, lease in (columns, items):
                allocator.fork("p", pool.epoch, parent, [child], lease)
            assert _state(columns[1]) == _state(items[1])
            continue
        outcomes = []
        for (allocator, pool, lease), kwargs in calls:
            step_items = kwargs.pop("items", [])
            outcomes.append(
                _outcome(allocator.step("p", pool.epoch, lease, StepCall(step_items, **kwargs)))
            )
            allocator.check_invariants()
        assert outcomes[0] == outcomes[1]
        assert _state(columns[1]) == _state(items[1])


def _decode_columns_harness():
    h = make_harness(num_blocks=4, block_size=2)
    h.step([new("a", [1, 2]), new("b", [3, 4])])  # two full blocks, two free
    return h


def _columns(h, ids, tokens, items=(), free=()):
    return h.allocator.step(
        "pool-a", h.pool.epoch, None,
        StepCall(list(items), free_request_ids=list(free), decode_request_ids=list(ids),
            append_request_ids=list(ids), append_token_ids=list(tokens)))


def test_boundary_decodes_in_columns_get_their_block_in_columns():
    h = _decode_columns_harness()
    result = _columns(h, ["a", "b"], [5, 6])
    assert result.grants == [] and result.appended_request_ids == ["a", "b"]
    assert result.appended_indexes == [1, 1]
    assert result.appended_block_ids == [h.table("a")[1], h.table("b")[1]]
    h.allocator.check_invariants()


def test_a_shortage_in_columns_preempts_from_the_tail():
    h = _decode_columns_harness()
    h.step([new("c", [7, 8])])  # the last free blocks: 3 of 4 used, 1 free
    result = _columns(h, ["a", "b", "c"], [5, 6, 9])
    assert [p.request_id for p in result.preempted] == ["c"]
    assert sorted(result.appended_request_ids + [g.request_id for g in result.grants]) == ["a", "b"]
    h.allocator.check_invariants()


def test_a_forked_child_decoding_in_columns_copies_its_shared_block():
    h = make_harness(num_blocks=6, block_size=4)
    h.step([new("p", [1, 2, 3, 4, 5, 6])])
    h.allocator.fork("pool-a", h.pool.epoch, "p", ["c"])
    result = _columns(h, ["c"], [7])
    (copy,) = result.copies
    (grant,) = result.grants
    assert (grant.delta_start, grant.block_ids) == (1, [copy.dst_block_id])
    assert h.table("c")[1] != h.table("p")[1]
    h.allocator.check_invariants()


@pytest.mark.parametrize(
    ("ids", "tokens", "items", "free", "error", "match"),
    [
        (["a", "b"], [1], [], [], InvalidArgument, "append_token_ids has 1"),
        ([], [1], [new("n", [1])], [], InvalidArgument, "append_request_ids has 0 entries"),
        (["a", "a"], [1, 2], [], [], InvalidArgument, "'a' appears twice"),
        (["a", ""], [1, 2], [], [], InvalidArgument, "needs a request_id"),
        (["zz", ""], [1, 2], [], [], InvalidArgument, "needs a request_id"),  # before unknown
        (["a", ""], [1, 2], [], ["a"], InvalidArgument, "needs a request_id"),  # before freed
        (["a"], [1], [StepItem("a", 1)], [], InvalidArgument, "'a' appears twice"),
        (["a", "zz"], [1, 2], [], [], NotFound, "unknown request 'zz'"),
        (["a", "b"], [1, -3], [], [], InvalidArgument, "b: append token ids must be >= 0, got -3"),
        (["a"], [1], [], ["a"], InvalidArgument, "both freed and scheduled"),
    ],
)
def test_bad_columns_are_refused_and_change_nothing(ids, tokens, items, free, error, match):
    h = _decode_columns_harness()
    before = _state(h.pool)
    with pytest.raises(error, match=match):
        _columns(h, ids, tokens, items, free)
    assert _state(h.pool) == before
    h.allocator.check_invariants()


def test_columns_count_against_the_batch_limit():
    h = make_harness(num_blocks=64, block_size=2)  # max_batch_items=64
    h.step([new(f"r{i}", [i, i]) for i in range(40)])
    h.step([], commits={f"r{i}": 2 for i in range(40)})
    with pytest.raises(InvalidArgument, match="65 items exceed the maximum batch of 64"):
        _columns(h, [f"r{i}" for i in range(40)], [0] * 40, [new(f"n{i}", [1]) for i in range(25)])


def test_a_decode_only_step_checks_its_lease_and_the_batch_limit():
    # The decode-only fast path refuses what the general path refuses, changing nothing:
    # an expired lease (NOT_FOUND), and more decodes than the batch limit.
    now = [0.0]
    allocator = Allocator(Limits(max_batch_items=2), clock=lambda: now[0])
    pool, _ = allocator.register_pool(PoolConfig("p", 8, 2, 0, "m", "i", True))
    lease = allocator.create_lease(5.0).lease_id
    items = [StepItem(r, 2, [1, 2]) for r in ("a", "b")]
    allocator.step("p", pool.epoch, lease, StepCall(items))
    before = _state(pool)

    def decode(ids: list[str]) -> StepResult:
        return allocator.step(
            "p", pool.epoch, lease,
            StepCall(decode_request_ids=ids, append_request_ids=ids,
                append_token_ids=[3] * len(ids)))

    with pytest.raises(InvalidArgument, match="3 items exceed the maximum batch of 2"):
        decode(["a", "b", "c"])
    assert _state(pool) == before
    now[0] = 10.0  # the lease ran out
    with pytest.raises(NotFound, match="unknown or expired"):
        decode(["a", "b"])
    assert not pool.requests  # the expired lease's requests were freed, nothing else
    allocator.check_invariants()
