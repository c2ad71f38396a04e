"""Requests belong to the lease they were admitted under: a call made under another lease
may not decode, schedule, commit, free, abort, fork or swap them (PERMISSION_DENIED), and a
refused call changes nothing. Request ids are each client's own, so two gateways can pick
the same one; this keeps one gateway's mistake (or orphan abort) off the other's requests."""

from __future__ import annotations

import pytest

from allocator_svc.core.step import Appends
from common.errors import NotFound, PermissionDenied
from common.step_records import Commit, PreemptionMode, StepCall, StepItem
from tests.allocator.conftest import (
    Harness,
    append_columns,
    as_call_parts,
    decode,
    make_harness,
    new,
)


def _two_leases() -> tuple[Harness, str, str]:
    h = make_harness(num_blocks=8, block_size=4, num_cpu_blocks=4)
    mine = h.allocator.create_lease(10.0).lease_id
    theirs = h.allocator.create_lease(10.0).lease_id
    h.lease_id = theirs
    h.step([new("theirs", [1, 2, 3])])
    h.lease_id = mine
    h.step([new("mine", [4, 5, 6])])
    return h, mine, theirs


def _state(h: Harness) -> tuple:
    return (
        h.pool.blocks.num_free,
        {r.request_id: (list(r.token_ids), r.num_computed, r.num_committed, h.table(r.request_id))
         for r in h.pool.requests.values()},
    )


def _step(h: Harness, lease: str, **kwargs) -> None:
    """`decodes`: request id -> the value it appends and computes."""
    items, appends = as_call_parts(kwargs.get("items", []))
    decodes = kwargs.get("decodes")
    if decodes:
        appends = Appends(list(decodes), list(decodes.values()))
    h.allocator.step("pool-a", h.pool.epoch, lease, StepCall(
        items, PreemptionMode.RECOMPUTE, kwargs.get("commits", []), kwargs.get("free", []),
        kwargs.get("abort", []), decode_request_ids=list(decodes or ()),
        step_id=kwargs.get("step_id", 0),
        commit_through_step_id=kwargs.get("commit_through", 0), **append_columns(appends)))


@pytest.mark.parametrize(
    "call",
    [
        {"decodes": {"mine": 7, "theirs": 8}},
        {"items": [decode("mine", 7), StepItem("theirs", 1)]},
        {"commits": [Commit("theirs", 3)]},
        {"free": ["theirs"]},
        {"abort": ["mine", "theirs"]},
    ],
    ids=["decode-columns", "running-item", "commit", "free", "abort"],
)
def test_a_step_naming_another_leases_request_is_denied_and_changes_nothing(call):
    h, mine, _ = _two_leases()
    before = _state(h)
    with pytest.raises(PermissionDenied, match="'theirs' in pool 'pool-a' belongs to another"):
        _step(h, mine, **call)
    assert _state(h) == before
    h.allocator.check_invariants()


def test_calls_outside_a_step_check_the_lease_too():
    h, mine, theirs = _two_leases()
    epoch, before = h.pool.epoch, _state(h)
    with pytest.raises(PermissionDenied):
        h.allocator.free("pool-a", epoch, [], ["theirs"], mine)
    with pytest.raises(PermissionDenied):
        h.allocator.free("pool-a", epoch, [Commit("theirs", 3)], [], mine)
    with pytest.raises(PermissionDenied):
        h.allocator.abort("pool-a", epoch, ["theirs"], mine)
    with pytest.raises(PermissionDenied):
        h.allocator.fork("pool-a", epoch, "theirs", ["child"], mine)
    with pytest.raises(PermissionDenied):
        h.allocator.swap_out("pool-a", epoch, "theirs", mine)
    assert _state(h) == before
    # The owner may; children join the parent's lease.
    (child,) = h.allocator.fork("pool-a", epoch, "theirs", ["child"], theirs)
    assert child.lease_id == theirs
    h.allocator.swap_out("pool-a", epoch, "child", theirs)
    h.allocator.abort("pool-a", epoch, ["child", "theirs"], theirs)
    assert set(h.pool.requests) == {"mine"}
    h.allocator.check_invariants()


def test_own_requests_pass_and_unknown_ids_are_still_not_found():
    h, mine, _ = _two_leases()
    _step(h, mine, decodes={"mine": 7}, commits=[Commit("mine", 3)])
    assert h.pool.requests["mine"].num_computed == 4
    with pytest.raises(NotFound, match="unknown request 'ghost'"):
        _step(h, mine, free=["ghost"])


def test_without_a_lease_nothing_is_checked():
    # Operator tools (and clients that take no lease) are not scoped.
    h, _, _ = _two_leases()
    h.allocator.abort("pool-a", h.pool.epoch, ["theirs", "mine"])
    assert not h.pool.requests
    h.allocator.check_invariants()


def test_calls_under_an_unknown_lease_are_not_found():
    h, _, _ = _two_leases()
    epoch, before = h.pool.epoch, _state(h)
    for call in (
        lambda: h.allocator.free("pool-a", epoch, [], ["mine"], "stale"),
        lambda: h.allocator.abort("pool-a", epoch, ["mine"], "stale"),
        lambda: h.allocator.fork("pool-a", epoch, "mine", ["c"], "stale"),
        lambda: h.allocator.swap_out("pool-a", epoch, "mine", "stale"),
    ):
        with pytest.raises(NotFound, match="lease-[0-9a-f]{12} is unknown or expired"):
            call()
    assert _state(h) == before


def test_commit_through_a_step_id_commits_the_callers_own_steps_only():
    # Two leases step one pool in turn, with the same step ids: each one's
    # commit_through_step_id confirms the KV of its own steps, never the other's (whose KV
    # may not be written yet).
    h = make_harness(num_blocks=8, block_size=4)
    a = h.allocator.create_lease(10.0).lease_id
    b = h.allocator.create_lease(10.0).lease_id
    _step(h, a, items=[new("a", [1, 2, 3, 4])], step_id=1)
    _step(h, b, items=[new("b", [5, 6, 7, 8])], step_id=1)
    requests = h.pool.requests
    _step(h, a, decodes={"a": 9}, step_id=2, commit_through=1)
    assert (requests["a"].num_committed, requests["b"].num_committed) == (4, 0)
    assert len(h.pool.blocks.cached) == 1  # a's full block only
    _step(h, b, decodes={"b": 10}, step_id=2, commit_through=1)
    assert (requests["a"].num_committed, requests["b"].num_committed) == (4, 4)
    assert len(h.pool.blocks.cached) == 2
    h.allocator.check_invariants()
