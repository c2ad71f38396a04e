"""Steps sent while the previous batch executes (depth 2): decodes granted by count before
their token's value is known, values sent once (appends), and the commit rule through
explicit step ids (StepRequest step_id, commit_through_step_id). The random sequences are in
test_overlap_properties.py; here, each rule and every bad input on its own."""

from __future__ import annotations

import grpc
import pytest

from allocator_svc.core.allocator import Allocator, Limits
from allocator_svc.core.pool import Pool, PoolConfig
from allocator_svc.core.step import Appends, StepResult
from common.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied
from common.step_records import Commit, PreemptionMode, StepCall, StepItem
from pagedkv.allocator.v1 import allocator_pb2 as pb
from tests.allocator.conftest import append_columns
from tests.allocator.test_service import expect_error, new, register

BS = 2


class Driver:
    """One pool and one lease; steps numbered 1, 2, ... as the gateway sends them at depth 2:
    by default each commits through the step before the previous one (`in_flight`: the
    previous batch still executes) or through the previous one (not in flight)."""

    def __init__(self, num_blocks: int = 10, num_cpu_blocks: int = 0) -> None:
        self.allocator = Allocator(Limits(max_batch_items=8, event_capacity=1 << 10))
        self.pool: Pool = self.allocator.register_pool(
            PoolConfig("p", num_blocks, BS, num_cpu_blocks, "fp", "i", True)
        )[0]
        self.lease = self.allocator.create_lease(600.0).lease_id
        self.step_id = 0

    def step(
        self,
        items: list[StepItem] | None = None,
        *,
        decode: list[str] | None = None,
        values: dict[str, list[int]] | None = None,
        in_flight: bool = True,
        commit_through: int | None = None,
        free: list[str] | None = None,
        abort: list[str] | None = None,
        commits: list[Commit] | None = None,
        lease: str | None = "own",
        swap: bool = False,
        appends: Appends | None = None,
    ) -> StepResult:
        """`decode`: one more token each; `values`: token values appended, per request."""
        step_id = self.step_id + 1
        if commit_through is None:
            commit_through = max(0, step_id - (2 if in_flight else 1))
        if appends is None and values:
            appends = Appends([r for r, v in values.items() for _ in v],
                              [t for v in values.values() for t in v])
        result = self.allocator.step(
            "p", self.pool.epoch, self.lease if lease == "own" else lease, StepCall(
                items or [],
                PreemptionMode.SWAP if swap else PreemptionMode.RECOMPUTE,
                commits or [],
                free or [],
                abort or [],
                decode or [],
                step_id=step_id,
                commit_through_step_id=commit_through,
                **append_columns(appends),
            ))
        self.step_id = step_id  # (a refused call took no number)
        self.allocator.check_invariants()
        return result

    def tokens(self, request_id: str) -> list[int]:
        return self.pool.requests[request_id].token_ids

    def computed(self, request_id: str) -> int:
        return self.pool.requests[request_id].num_computed

    def cached(self) -> int:
        return len(self.pool.blocks.by_key)

    def state(self) -> tuple:
        return (
            {r: (list(q.token_ids), q.num_computed, q.num_committed, [b.block_id for b in q.blocks])
             for r, q in self.pool.requests.items()},
            self.pool.blocks.num_free,
            self.cached(),
        )


def test_a_decode_is_granted_by_count_and_its_value_follows():
    d = Driver()
    d.step([new("a", [1, 2, 3])], in_flight=False)  # prefill in flight, samples token 4
    d.step(decode=["a"])  # step 2: position 3 granted, its value still being sampled
    assert d.tokens("a") == [1, 2, 3] and d.computed("a") == 4
    d.step(decode=["a"], values={"a": [4]})  # step 3: learns 4, grants position 4
    assert d.tokens("a") == [1, 2, 3, 4] and d.computed("a") == 5


def test_a_decode_with_its_value_known_is_the_same_grant():
    # Depth 1: the value goes with the decode that computes it.
    d = Driver()
    d.step([new("a", [1, 2, 3])], in_flight=False)
    d.step(decode=["a"], values={"a": [4]}, in_flight=False)
    assert d.tokens("a") == [1, 2, 3, 4] and d.computed("a") == 4


def test_a_block_is_cached_only_once_the_step_that_filled_it_has_executed():
    d = Driver()
    d.step([new("a", [1, 2, 3])], in_flight=False)  # step 1 fills block 0, writes position 2
    d.step(decode=["a"])  # sent while step 1 executes: nothing may be cached yet
    assert d.cached() == 0
    d.step(decode=["a"], values={"a": [4]})  # step 1 has executed: block 0 ([1, 2]) is cached
    assert d.cached() == 1
    # Step 2 filled block 1 ([3, 4]); it executes while step 3's call is made, so not yet.
    assert d.pool.requests["a"].num_committed == 3
    d.step(decode=["a"], values={"a": [5]})
    assert d.cached() == 2
    # A new prompt sharing the prefix hits exactly the executed blocks.
    result = d.step([new("b", [1, 2, 3, 4, 9])], decode=["a"], values={"a": [6]})
    assert [g.num_cached_tokens for g in result.grants if g.request_id == "b"] == [4]


def test_steps_are_committed_only_up_to_the_id_named_and_each_once():
    d = Driver()
    d.step([new("a", [1, 2, 3])], in_flight=False)
    d.step(decode=["a"])
    d.step(decode=["a"], values={"a": [4]}, commit_through=0)  # nothing confirmed yet
    assert d.cached() == 0 and d.pool.requests["a"].num_committed == 0
    d.step(decode=["a"], values={"a": [5]})  # through step 2: steps 1 and 2, oldest first
    assert d.cached() == 2 and d.pool.requests["a"].num_committed == 4
    d.step(decode=["a"], values={"a": [6]}, commit_through=2)  # the same id again: nothing
    assert d.cached() == 2 and d.pool.requests["a"].num_committed == 4
    d.step(decode=["a"], values={"a": [7]}, commit_through=4)  # steps 3 and 4 (counts 5, 6)
    assert d.pool.requests["a"].num_committed == 6 and d.cached() == 3


def test_a_step_out_of_the_pipeline_commits_everything_granted_so_far():
    d = Driver()
    d.step([new("a", [1, 2, 3])], in_flight=False)
    d.step(decode=["a"])
    # Both batches have executed (the engine went idle): one plain Step commits them all.
    d.step(values={"a": [4, 5]}, decode=["a"], in_flight=False)
    assert d.pool.requests["a"].num_committed == 4 and d.cached() == 2


def test_a_decode_not_granted_for_a_swap_leaves_the_count_alone():
    d = Driver(num_blocks=4, num_cpu_blocks=4)
    d.step([new("a", [1, 2]), new("b", [1, 3, 5, 7, 9])], in_flight=False)
    # a enters a new block (3 needed, 4 - 3 - 1 free): b, behind it, is swapped out.
    result = d.step(decode=["a", "b"], swap=True)
    assert [p.request_id for p in result.preempted] == ["b"]
    assert d.tokens("b") == [1, 3, 5, 7, 9] and d.computed("b") == 5
    assert d.pool.requests["b"].swapped and d.computed("a") == 3


def test_a_commit_never_reaches_a_token_whose_value_is_unknown():
    d = Driver()
    d.step([new("a", [1, 2, 3])], in_flight=False)
    d.step(decode=["a"])  # position 3 granted, value unknown: block 1 would be [3, ?]
    d.step(commits=[Commit("a", 4)], commit_through=0)  # its KV is written, its value unknown
    assert d.pool.requests["a"].num_committed == 4 and d.cached() == 1
    d.step(values={"a": [4]}, commits=[Commit("a", 4)], commit_through=0)
    assert d.cached() == 2


def test_a_request_with_an_unknown_value_is_freed_cleanly_and_cannot_be_forked():
    d = Driver()
    d.step([new("a", [1, 2, 3]), new("b", [5, 6])], in_flight=False)
    d.step(decode=["a", "b"])
    with pytest.raises(FailedPrecondition, match="whose value is unknown"):
        d.allocator.fork("p", d.pool.epoch, "a", ["c"], d.lease)
    d.step(free=["a"], values={"a": [4], "b": [7]})  # a finished: its value may come along
    assert "a" not in d.pool.requests and d.tokens("b") == [5, 6, 7]
    d.allocator.fork("p", d.pool.epoch, "b", ["c"], d.lease)  # b's values are all known now
    assert d.tokens("c") == [5, 6, 7] and d.computed("c") == 3


@pytest.mark.parametrize("in_flight", [True, False], ids=["overlapped", "not-overlapped"])
def test_a_request_aborted_and_admitted_again_in_one_step_starts_anew(in_flight: bool):
    # The gateway lost the step a decode was in and starts it over: the abort and the new
    # admission go in one call; the old count goes with the old request.
    d = Driver()
    d.step([new("a", [1, 2, 3])], in_flight=False)
    d.step(decode=["a"])
    d.step([new("a", [1, 2, 3])], abort=["a"], in_flight=in_flight)
    assert d.tokens("a") == [1, 2, 3] and d.computed("a") == 3


def test_a_swapped_request_learns_its_values_and_comes_back_with_them():
    d = Driver(num_blocks=4, num_cpu_blocks=4)
    d.step([new("a", [1, 2]), new("b", [1, 3, 5, 7])], in_flight=False)
    d.step(decode=["a", "b"], swap=True)  # b's position 4 would need a third block: swapped
    assert d.pool.requests["b"].swapped and d.computed("b") == 4
    d.step([StepItem("b", 4)], free=["a"], values={"a": [9], "b": [2]}, in_flight=False)
    assert not d.pool.requests["b"].swapped
    assert d.tokens("b") == [1, 3, 5, 7, 2] and d.computed("b") == 5  # capped at known tokens


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"decode": ["a"]}, InvalidArgument, "'a' has a computed token whose value is unknown"),
        ({"values": {"zz": [4]}}, NotFound, "append for unknown request 'zz'"),
        ({"values": {"a": [-2]}}, InvalidArgument, "a: append token ids must be >= 0, got -2"),
        ({"values": {"": [1]}}, InvalidArgument, "every append needs a request_id"),
        ({"values": {"b": [1] * 20}}, InvalidArgument, "'b' would hold 22 tokens, more than"),
        ({"appends": Appends(["a", "b"], [4])}, InvalidArgument,
         "append_request_ids has 2 entries but append_token_ids has 1"),
        ({"decode": ["b", "b"]}, InvalidArgument, "'b' appears twice"),
        ({"decode": [""]}, InvalidArgument, "needs a request_id"),
        ({"decode": ["zz"]}, NotFound, "unknown request 'zz'"),
        ({"decode": ["b"], "free": ["b"]}, InvalidArgument, "both freed and scheduled"),
        ({"decode": ["b"], "items": [StepItem("b", 1)]}, InvalidArgument, "appears twice"),
        ({"decode": ["s"]}, InvalidArgument, "'s' is swapped out: swap it in with an item"),
        ({"decode": ["b"], "lease": "other"}, PermissionDenied, "belongs to another lease"),
        ({"values": {"a": [4]}, "lease": "other"}, PermissionDenied, "belongs to another lease"),
        ({"decode": ["b"], "commit_through": 4}, InvalidArgument,
         "commit_through_step_id 4 names a step not sent yet"),
    ],
)
def test_bad_overlap_fields_are_refused_and_change_nothing(kwargs, error, match):
    d = Driver(num_cpu_blocks=4)
    d.step([new("a", [1, 2, 3]), new("b", [5, 6]), new("s", [7, 8])], in_flight=False)
    d.allocator.swap_out("p", d.pool.epoch, "s", d.lease)
    d.step(decode=["a"])  # a's computed token 3 has no value yet; b is plain; s swapped
    if kwargs.get("lease") == "other":
        kwargs["lease"] = d.allocator.create_lease(60.0).lease_id
    before = d.state()
    with pytest.raises(error, match=match):
        d.step(**kwargs)
    assert d.state() == before


def test_a_step_with_values_alone_is_not_empty():
    d = Driver()
    d.step([new("a", [1, 2, 3])], in_flight=False)
    d.step(decode=["a"])
    d.step(values={"a": [4]}, in_flight=False)
    assert d.tokens("a") == [1, 2, 3, 4] and d.computed("a") == 4


def test_an_item_on_a_request_whose_value_is_unknown_schedules_nothing():
    # Items compute known tokens only: there is none to compute until the value arrives.
    d = Driver()
    d.step([new("a", [1, 2, 3])], in_flight=False)
    d.step(decode=["a"])
    result = d.step([StepItem("a", 2)])
    assert d.computed("a") == 4 and not result.grants


@pytest.mark.e2e  # (a Python subprocess)
def test_service_overlapped_step_round_trip_and_bad_input(stub):
    pool = register(stub, block_size=2)

    def call(**fields):
        return stub.Step(pb.StepRequest(pool_id=pool.pool_id, epoch=pool.epoch,
                                        lease_id=stub.lease_id, **fields))

    call(items=[new("a", [1, 2, 3])], step_id=1)
    response = call(decode_request_ids=["a"], step_id=2)
    assert not response.grants and not response.appended_request_ids  # position 3: block 1
    response = call(decode_request_ids=["a"], append_request_ids=["a"], append_token_ids=[4],
                    step_id=3, commit_through_step_id=1)
    assert list(response.appended_request_ids) == ["a"]  # position 4 starts block 2
    (grant,) = call(items=[new("b", [1, 2, 3, 4, 9])], step_id=4).grants
    assert grant.num_cached_tokens == 2  # block 0 only: block 1's step was still in flight
    for code, match, fields in [
        (grpc.StatusCode.INVALID_ARGUMENT, "append_request_ids has 1 entries",
         {"append_request_ids": ["a"]}),
        (grpc.StatusCode.INVALID_ARGUMENT, "'a' has a computed token whose value is unknown",
         {"decode_request_ids": ["a"]}),
        (grpc.StatusCode.NOT_FOUND, "append for unknown request 'zz'",
         {"append_request_ids": ["zz"], "append_token_ids": [1]}),
        (grpc.StatusCode.INVALID_ARGUMENT, "step_id 4 is not newer than this lease's last step 4",
         {"items": [new("c", [5])], "step_id": 4}),
        (grpc.StatusCode.INVALID_ARGUMENT, "commit_through_step_id 9 names a step not sent yet",
         {"items": [new("c", [5])], "step_id": 5, "commit_through_step_id": 9}),
    ]:
        expect_error(code, lambda f=fields: call(**f), match=match)
    assert stub.GetStats(pb.GetStatsRequest(pool_id=pool.pool_id)).pools[0].num_requests == 2


def test_a_request_that_preempts_itself_is_not_in_its_steps_commit():
    # R cannot grow and has nobody behind it: it swaps itself out in step 2, comes back on
    # fresh blocks in step 3, which are written only when step 3's batch runs. Committing
    # step 2 (in step 4's call) must not cache them; step 3's commit (in step 5's) does.
    d = Driver(num_blocks=5, num_cpu_blocks=4)
    d.step([new("a", [1, 2, 3, 4, 5]), new("r", [4, 5, 6, 7])], in_flight=False)
    result = d.step(decode=["a", "r"], swap=True)
    assert [p.request_id for p in result.preempted] == ["r"]
    d.step([StepItem("r", 1)], free=["a"], values={"a": [6], "r": [9]})

    def cached() -> int:
        (match,) = d.allocator.match_prefix([4, 5, 6, 7, 8], "", ["p"])
        return match.num_cached_tokens

    d.step(decode=["r"])  # step 4: commits step 2
    assert cached() == 0
    d.step(decode=["r"], values={"r": [3]})  # step 5: commits step 3, which swapped r in
    assert cached() == 4


def test_a_block_filled_by_an_unknown_value_is_hashed_once_the_value_comes():
    # A step that fills a block with a token whose value is not known yet is committed
    # (its KV is written): the block waits, uncached, for the value; a later step's commit
    # hashes it, with the value.
    d = Driver(num_blocks=10)
    d.step([new("a", [1, 2, 3])], in_flight=False)
    d.step(decode=["a"])  # step 2: position 3 fills block 1, its value unknown
    d.step([new("b", [5])], in_flight=False)  # commits step 2: a's KV to 4, block 1 waits
    assert d.pool.requests["a"].num_committed == 4 and d.cached() == 1
    d.step(decode=["a"], values={"a": [4]}, in_flight=False)  # step 4 commits step 3: no a
    assert d.cached() == 1
    d.step(decode=["a"], values={"a": [5]}, in_flight=False)  # commits step 4: a at 5
    (match,) = d.allocator.match_prefix([1, 2, 3, 4, 9], "", ["p"])
    assert d.cached() == 2 and match.num_cached_tokens == 4


@pytest.mark.parametrize("in_flight", [True, False])
def test_a_step_never_commits_a_request_it_aborts(in_flight: bool):
    # commit_through_step_id and an abort of the same request in one call: the abort wins
    # (an abort commits nothing), whichever of the kept steps the id covers.
    d = Driver()
    d.step([new("a", [1, 2, 3, 4, 5]), new("b", [7, 8])], in_flight=False)
    if in_flight:
        d.step(decode=["a", "b"])  # step 1 is now the one kept with its counts
    d.step([new("c", [9])], abort=["a"], values={"b": [1]} if in_flight else None,
           in_flight=False)
    stored = [e.token_ids for e in d.pool.events.after(0, 1 << 10).events if e.token_ids]
    assert [1, 2] not in stored and [3, 4] not in stored
    assert [7, 8] in stored  # b's block: confirmed by the same id


def test_blocks_a_steps_copies_read_reach_another_lease_only_once_it_is_confirmed():
    # Two leases on one pool are not ordered at the executor: a block a step's swap-out copies
    # from (device) or its swap-in copies from (CPU) is held until that step is confirmed, so
    # another lease's step, which may run first, cannot write it before the copy has read it.
    # The step itself may reuse them (its copies run before its forward).
    d = Driver(num_blocks=3, num_cpu_blocks=4)
    other = d.allocator.create_lease(600.0).lease_id
    d.step([new("a", [1, 2]), new("b", [1, 3, 5, 7])], in_flight=False)  # the pool is full
    swapped = d.step(decode=["a", "b"], swap=True)  # step 2: b out; a takes one of its blocks
    sources = {c.src_block_id for c in swapped.swap_out}
    a_new = d.pool.requests["a"].blocks[-1].block_id
    assert len(sources) == 2 and a_new in sources
    assert d.pool.blocks.num_free == 0, "the source block a did not take is held"
    refused = d.step([new("c", [8, 9])], lease=other, commit_through=0)
    assert refused.deferred == ["c"]  # no room while step 2 may not have run
    d.allocator.free("p", d.pool.epoch, [], [], d.lease, commit_through=2)
    assert d.pool.blocks.num_free == 1
    admitted = d.step([new("c", [8, 9])], lease=other, commit_through=0)
    assert [g.block_ids for g in admitted.grants] == [list(sources - {a_new})]
    # b comes back once a and c are gone: its CPU blocks are held until that step is
    # confirmed.
    d.allocator.free("p", d.pool.epoch, [], ["c"], other)
    d.step([StepItem("b", 4)], free=["a"], values={"a": [9], "b": [2]}, in_flight=False)
    assert not d.pool.requests["b"].swapped and d.pool.cpu.num_free == 2
    d.allocator.free("p", d.pool.epoch, [], [], d.lease, commit_through=d.step_id)
    assert d.pool.cpu.num_free == 4
    d.allocator.check_invariants()


def test_a_lease_that_goes_away_gives_back_what_its_steps_held():
    d = Driver(num_blocks=3, num_cpu_blocks=4)
    d.step([new("a", [1, 2]), new("b", [1, 3, 5, 7])], in_flight=False)
    d.step(decode=["a", "b"], swap=True)
    d.allocator.free("p", d.pool.epoch, [], ["a", "b"], d.lease)  # no step confirmed
    assert d.pool.blocks.num_free == 2  # a's two; b's other source block still held
    d.pool.scheduled.forget(d.lease)  # the lease expired
    assert d.pool.blocks.num_free == 3 and d.pool.cpu.num_free == 4
    d.allocator.check_invariants()
