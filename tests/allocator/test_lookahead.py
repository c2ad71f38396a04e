"""Speculative decoding at the allocator: lookahead slots granted with a running request's
item, the accepted drafts counted computed by the next call, the rest given back, and no
rejected draft ever hashed (the commit rule)."""

from __future__ import annotations

import pytest

from allocator_svc.core.allocator import Allocator, Limits
from allocator_svc.core.pool import PoolConfig
from common.errors import InvalidArgument, NotFound, PermissionDenied
from common.step_records import MAX_LOOKAHEAD_TOKENS, StepCall, StepItem

BS = 4


def allocator(num_blocks: int = 16) -> Allocator:
    core = Allocator(Limits(max_batch_items=8))
    core.register_pool(PoolConfig("p", num_blocks, BS, 0, "fp", "i", True))
    return core


def step(core: Allocator, *items: StepItem, appends: tuple[tuple[str, int], ...] = (),
         accepts: tuple[tuple[str, int], ...] = (), step_id: int = 0, commit_through: int = 0,
         lease: str | None = None):
    pool = core.pools["p"]
    result = core.step("p", pool.epoch, lease, StepCall(
        items=items, append_request_ids=[r for r, _ in appends],
        append_token_ids=[t for _, t in appends], accept_request_ids=[r for r, _ in accepts],
        accept_counts=[n for _, n in accepts], step_id=step_id,
        commit_through_step_id=commit_through))
    pool.check_invariants()
    return result


def admitted(core: Allocator, prompt: list[int], rid: str = "a") -> None:
    """A request with its prompt computed and committed, and its first sampled token known."""
    step(core, StepItem(rid, len(prompt), prompt))
    pool = core.pools["p"]
    pool.commit(pool.requests[rid], len(prompt))
    step(core, appends=((rid, 100),))


def test_lookahead_is_granted_as_slots_not_computed_and_the_accept_counts_the_accepted():
    core = allocator()
    pool = core.pools["p"]
    admitted(core, [1, 2, 3, 4, 5, 6])  # 6 computed, 7 known: the table holds 2 blocks
    request = pool.requests["a"]
    result = step(core, StepItem("a", 1, num_lookahead=4))  # position 6, drafts at 7..10
    (grant,) = result.grants
    assert (grant.start_position, grant.num_scheduled) == (6, 1)
    assert grant.delta_start == 2 and len(grant.block_ids) == 1  # slots up to position 10
    assert (request.num_computed, request.num_lookahead) == (7, 4)
    # Two drafts accepted: their values and the token after them are appended.
    step(core, appends=(("a", 7), ("a", 8), ("a", 9)), accepts=(("a", 2),))
    assert (request.num_computed, request.num_lookahead) == (9, 0)
    assert len(request.blocks) == pool.blocks_for(9)  # the slots past it went back


def test_all_drafts_rejected_gives_every_lookahead_block_back():
    core = allocator()
    pool = core.pools["p"]
    admitted(core, [1, 2, 3, 4])  # a full block: the lookahead starts a new one
    free = pool.blocks.num_free
    step(core, StepItem("a", 1, num_lookahead=8))  # positions 4..12: three more blocks
    assert pool.blocks.num_free == free - 3
    step(core, appends=(("a", 9),), accepts=(("a", 0),))
    assert pool.blocks.num_free == free - 1  # the block of position 4 stays: it is computed
    assert pool.requests["a"].num_computed == 5


def test_a_call_without_the_accept_counts_every_draft_rejected():
    core = allocator()
    pool = core.pools["p"]
    admitted(core, [1, 2, 3, 4, 5, 6])
    step(core, StepItem("a", 1, num_lookahead=5))
    step(core, StepItem("a", 1), appends=(("a", 50),))  # no accept: a plain decode next
    assert (pool.requests["a"].num_computed, pool.requests["a"].num_lookahead) == (8, 0)


def test_a_rejected_draft_is_never_hashed():
    """The rejected drafts' slots are written again before any commit reaches them: the
    block they were in is hashed with the tokens that replaced them."""
    core = allocator()
    pool = core.pools["p"]
    admitted(core, [1, 2, 3, 4])  # 100 known at position 4
    step(core, StepItem("a", 1, num_lookahead=3), step_id=2)  # drafts 7, 8, 9 at 5..7
    # One accepted (7); the executor's token after it is 70, not the draft 8.
    step(core, StepItem("a", 1), appends=(("a", 7), ("a", 70)), accepts=(("a", 1),),
         step_id=3, commit_through=2)
    step(core, StepItem("a", 1), appends=(("a", 71),), step_id=4, commit_through=3)
    step(core, appends=(("a", 72),), commit_through=4)
    request = pool.requests["a"]
    assert request.num_committed == 8
    assert request.block_hashes == pool.chain("", [1, 2, 3, 4, 100, 7, 70, 71])
    # A prompt with the drafted tokens finds only the first block cached; one with the
    # tokens that replaced them, both.
    step(core, StepItem("b", 9, [1, 2, 3, 4, 100, 7, 8, 9, 5]),
         StepItem("c", 9, [1, 2, 3, 4, 100, 7, 70, 71, 5]))
    assert pool.requests["b"].num_cached_tokens == 4
    assert pool.requests["c"].num_cached_tokens == 8


def test_lookahead_takes_free_blocks_only_and_says_how_many_slots_it_got():
    """Drafts may be rejected: their slots never push anyone out, nor take a block a later
    row of the step needs (b's here), and the grant says how many it got (3 of the 8 asked:
    the rest of the block its own row opened)."""
    core = allocator(num_blocks=4)
    pool = core.pools["p"]
    admitted(core, [1, 2, 3, 4], rid="a")
    admitted(core, [5, 6, 7, 8], rid="b")  # 2 blocks free
    result = step(core, StepItem("a", 1, num_lookahead=8), StepItem("b", 1))
    assert not result.preempted
    grant = next(g for g in result.grants if g.request_id == "a")
    assert (grant.num_scheduled, grant.num_lookahead) == (1, 3)
    assert pool.requests["a"].num_lookahead == 3
    # No block free: only the room left in its own last block, and a grant says so.
    result = step(core, StepItem("b", 1, num_lookahead=4), appends=(("a", 9), ("b", 10)),
                  accepts=(("a", 0),))
    grant = next(g for g in result.grants if g.request_id == "b")
    assert (grant.num_lookahead, grant.block_ids) == (2, []) and not result.preempted


def test_another_leases_lookahead_is_left_alone():
    """Lookahead no accept names counts as rejected only for the calling lease: another
    gateway's drafts may still be executing."""
    core = allocator()
    pool = core.pools["p"]
    mine, theirs = core.create_lease(10.0).lease_id, core.create_lease(10.0).lease_id
    step(core, StepItem("a", 3, [1, 2, 3]), lease=theirs)
    step(core, StepItem("b", 3, [4, 5, 6]), lease=mine)
    step(core, StepItem("a", 1, num_lookahead=4), appends=(("a", 7),), lease=theirs)
    step(core, StepItem("b", 1), appends=(("b", 8),), lease=mine)
    assert pool.requests["a"].num_lookahead == 4
    step(core, StepItem("a", 1), appends=(("a", 9),), lease=theirs)  # no accept: all rejected
    assert pool.requests["a"].num_lookahead == 0


@pytest.mark.parametrize(("item", "error", "message"), [
    (StepItem("a", 1, num_lookahead=MAX_LOOKAHEAD_TOKENS + 1), InvalidArgument,
     "num_lookahead=17 is out of range"),
    (StepItem("n", 2, [1, 2], num_lookahead=2), InvalidArgument, "not a new or swapped-out"),
    (StepItem("a", 1, num_lookahead=16), InvalidArgument, "past the 16 slots"),
])
def test_bad_lookahead_is_refused_and_changes_nothing(item, error, message):
    core = allocator(num_blocks=4)
    admitted(core, [1, 2, 3, 4, 5, 6])
    with pytest.raises(error, match=message):
        step(core, item)
    assert core.pools["p"].requests.keys() == {"a"}


@pytest.mark.parametrize(("accepts", "appends", "error", "message"), [
    ((("a", 3),), (("a", 7), ("a", 8), ("a", 9), ("a", 10)), InvalidArgument,
     "3 drafts accepted, but its lookahead held 2"),
    ((("a", 2),), (("a", 7),), InvalidArgument, "only 1 of their values are known"),
    ((("x", 0),), (), NotFound, "accept for unknown request 'x'"),
    ((("a", 1), ("a", 1)), (("a", 7), ("a", 8)), InvalidArgument, "accepted twice"),
])
def test_bad_accepts_are_refused_and_change_nothing(accepts, appends, error, message):
    core = allocator()
    pool = core.pools["p"]
    admitted(core, [1, 2, 3, 4, 5, 6])
    step(core, StepItem("a", 1, num_lookahead=2))
    with pytest.raises(error, match=message):
        step(core, appends=appends, accepts=accepts)
    assert (pool.requests["a"].num_computed, pool.requests["a"].num_lookahead) == (7, 2)
    assert len(pool.requests["a"].token_ids) == 7


def test_an_accept_must_name_the_callers_own_request():
    core = allocator()
    lease, other = core.create_lease(10.0).lease_id, core.create_lease(10.0).lease_id
    step(core, StepItem("a", 2, [1, 2]), lease=lease)
    with pytest.raises(PermissionDenied):
        step(core, accepts=(("a", 0),), appends=(("a", 5),), lease=other)
