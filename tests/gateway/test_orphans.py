"""Orphans (engine/orphans.py): ids a call may create at the allocator stay noted exactly
while no sequence tracks them and the call's outcome is unknown."""

from __future__ import annotations

import pytest

from gateway.clients.call_failures import CallFailed, Lost, Rejected
from gateway.engine.orphans import Orphans


def test_a_call_that_succeeds_leaves_no_orphan() -> None:
    orphans = Orphans({"old"})
    with orphans.until_tracked(["a", "b"]):
        assert orphans.ids == {"old", "a", "b"}  # noted while the call is out
    assert orphans.ids == {"old"}


@pytest.mark.parametrize(("failure", "kept"), [
    (Rejected("INVALID_ARGUMENT", "refused"), set()),  # refused: not applied
    (Lost("UNAVAILABLE", "cut off"), {"a", "b"}),  # unknown: the children may exist
])
def test_a_failed_call_keeps_its_ids_only_when_its_outcome_is_unknown(
        failure: CallFailed, kept: set[str]) -> None:
    orphans = Orphans()
    with pytest.raises(CallFailed), orphans.until_tracked(["a", "b"]):
        raise failure
    assert orphans.ids == kept


def test_a_bug_between_the_call_and_tracking_keeps_the_ids() -> None:
    orphans = Orphans()
    with pytest.raises(AssertionError), orphans.until_tracked(["a"]):
        raise AssertionError("a bug in the scheduler")
    assert orphans.ids == {"a"}
