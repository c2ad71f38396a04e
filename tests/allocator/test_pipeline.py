"""Steps sent while the previous batch executes: pending decodes, late tokens, and the commit
rule through explicit step ids (StepRequest step_id, commit_through_step_id). The random
sequences are in test_pipeline_properties.py; here, each rule and every bad input on its
own."""

from __future__ import annotations

import grpc
import pytest

from allocator_svc.core.allocator import Allocator, Limits
from allocator_svc.core.pool import Pool, PoolConfig
from allocator_svc.core.request import PENDING, Commit
from allocator_svc.core.step import Decodes, PreemptionMode, StepCall, StepItem, StepResult
from common.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied
from pagedkv.allocator.v1 import allocator_pb2 as pb
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
        pending: list[str] | None = None,
        late: dict[str, int] | None = None,
        in_flight: bool = True,
        commit_through: int | None = None,
        decodes: Decodes | None = None,
        free: list[str] | None = None,
        abort: list[str] | None = None,
        commits: list[Commit] | None = None,
        lease: str | None = "own",
        swap: bool = False,
    ) -> StepResult:
        late = late or {}
        step_id = self.step_id + 1
        if commit_through is None:
            commit_through = max(0, step_id - (2 if in_flight else 1))
        result = self.allocator.step(StepCall(
            "p",
            self.pool.epoch,
            self.lease if lease == "own" else lease,
            items or [],
            PreemptionMode.SWAP if swap else PreemptionMode.RECOMPUTE,
            commits or [],
            free or [],
            abort or [],
            decodes,
            pending or [],
            Decodes(list(late), list(late.values())),
            step_id,
            commit_through,
        ))
        self.step_id = step_id  # (a refused call took no number)
        self.allocator.check_invariants()
        return result

    def tokens(self, request_id: str) -> list[int]:
        return self.pool.requests[request_id].token_ids

    def cached(self) -> int:
        return len(self.pool.blocks.by_key)

    def state(self) -> tuple:
        return (
            {r: (list(q.token_ids), q.num_computed, q.num_committed, [b.block_id for b in q.blocks])
             for r, q in self.pool.requests.items()},
            set(self.pool.pending),
            self.pool.blocks.num_free,
            self.cached(),
        )


def test_a_pending_decode_holds_a_placeholder_until_its_late_value():
    d = Driver()
    d.step([new("a", [1, 2, 3])], in_flight=False)  # prefill in flight, samples token 4
    d.step(pending=["a"])  # step 2: position 3 granted, its value still being sampled
    assert d.tokens("a") == [1, 2, 3, PENDING]
    assert d.pool.requests["a"].num_computed == 4 and d.pool.pending == {"a"}
    d.step(pending=["a"], late={"a": 4})  # step 3: learns 4, grants position 4
    assert d.tokens("a") == [1, 2, 3, 4, PENDING]
    assert d.pool.requests["a"].num_computed == 5 and d.pool.pending == {"a"}


def test_a_block_is_cached_only_once_the_step_that_filled_it_has_executed():
    d = Driver()
    d.step([new("a", [1, 2, 3])], in_flight=False)  # step 1 fills block 0, writes position 2
    d.step(pending=["a"])  # sent while step 1 executes: nothing may be cached yet
    assert d.cached() == 0
    d.step(pending=["a"], late={"a": 4})  # step 1 has executed: block 0 ([1, 2]) is cached
    assert d.cached() == 1
    # Step 2 filled block 1 ([3, 4]); it executes while step 3's call is made, so not yet.
    assert d.pool.requests["a"].num_committed == 3
    d.step(pending=["a"], late={"a": 5})
    assert d.cached() == 2
    # A new prompt sharing the prefix hits exactly the executed blocks.
    result = d.step([new("b", [1, 2, 3, 4, 9])], pending=["a"], late={"a": 6})
    assert [g.num_cached_tokens for g in result.grants if g.request_id == "b"] == [4]


def test_steps_are_committed_only_up_to_the_id_named_and_each_once():
    d = Driver()
    d.step([new("a", [1, 2, 3])], in_flight=False)
    d.step(pending=["a"])
    d.step(pending=["a"], late={"a": 4}, commit_through=0)  # nothing confirmed yet
    assert d.cached() == 0 and d.pool.requests["a"].num_committed == 0
    d.step(pending=["a"], late={"a": 5})  # through step 2: steps 1 and 2, oldest first
    assert d.cached() == 2 and d.pool.requests["a"].num_committed == 4
    d.step(pending=["a"], late={"a": 6}, commit_through=2)  # the same id again: nothing
    assert d.cached() == 2 and d.pool.requests["a"].num_committed == 4
    d.step(pending=["a"], late={"a": 7}, commit_through=4)  # steps 3 and 4 (counts 5, 6)
    assert d.pool.requests["a"].num_committed == 6 and d.cached() == 3


def test_a_step_out_of_the_pipeline_commits_everything_granted_so_far():
    d = Driver()
    d.step([new("a", [1, 2, 3])], in_flight=False)
    d.step(pending=["a"])
    # Both batches have executed (the engine went idle): one plain Step commits them all.
    d.step(late={"a": 4}, decodes=Decodes(["a"], [5]), in_flight=False)
    assert d.pool.requests["a"].num_committed == 4 and d.cached() == 2


def test_a_pending_decode_preempted_by_swap_drops_its_placeholder():
    d = Driver(num_blocks=4, num_cpu_blocks=4)
    d.step([new("a", [1, 2]), new("b", [1, 3, 5, 7, 9])], in_flight=False)
    # a enters a new block (3 needed, 4 - 3 - 1 free): b, behind it, is swapped out.
    result = d.step(pending=["a", "b"], swap=True)
    assert [p.request_id for p in result.preempted] == ["b"]
    assert d.tokens("b") == [1, 3, 5, 7, 9] and d.pool.pending == {"a"}
    assert d.pool.requests["b"].swapped


def test_a_commit_never_reaches_a_pending_token():
    d = Driver()
    d.step([new("a", [1, 2, 3])], in_flight=False)
    d.step(pending=["a"])  # position 3 pending: block 1 would be [3, PENDING]
    d.step(commits=[Commit("a", 4)], commit_through=0)  # a client's mistake
    assert d.pool.requests["a"].num_committed == 3 and d.cached() == 1
    d.step(late={"a": 4}, commits=[Commit("a", 4)], commit_through=0)
    assert d.cached() == 2


def test_a_pending_request_is_freed_cleanly_and_cannot_be_forked():
    d = Driver()
    d.step([new("a", [1, 2, 3]), new("b", [5, 6])], in_flight=False)
    d.step(pending=["a", "b"])
    with pytest.raises(FailedPrecondition, match="holds a pending token"):
        d.allocator.fork("p", d.pool.epoch, "a", ["c"], d.lease)
    d.step(free=["a"], late={"a": 4, "b": 7})  # a finished: its late value may come along
    assert not d.pool.pending and "a" not in d.pool.requests


@pytest.mark.parametrize("in_flight", [True, False], ids=["pipelined", "out-of-pipeline"])
def test_a_pending_request_aborted_and_admitted_again_in_one_step_starts_anew(in_flight: bool):
    # The gateway lost the step a pending request was in and starts it over: the abort and
    # the new admission go in one call; the old pending token goes with the old request.
    d = Driver()
    d.step([new("a", [1, 2, 3])], in_flight=False)
    d.step(pending=["a"])
    d.step([new("a", [1, 2, 3])], abort=["a"], in_flight=in_flight)
    assert d.tokens("a") == [1, 2, 3] and not d.pool.pending


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"late": {"b": 4}}, InvalidArgument, "'b' has no pending token"),
        ({"late": {"zz": 4}}, NotFound, "late token for unknown request 'zz'"),
        ({"late": {"a": -2}}, InvalidArgument, "a: late token ids must be >= 0, got -2"),
        ({"late": {"": 1}}, InvalidArgument, "needs a request_id"),
        ({"pending": ["a"]}, InvalidArgument, "'a' holds a pending token"),
        ({"pending": ["b", "b"]}, InvalidArgument, "'b' appears twice"),
        ({"pending": [""]}, InvalidArgument, "needs a request_id"),
        ({"pending": ["zz"]}, NotFound, "pending decode for unknown request 'zz'"),
        ({"pending": ["b"], "free": ["b"]}, InvalidArgument, "both freed and scheduled"),
        ({"pending": ["b"], "decodes": Decodes(["b"], [1])}, InvalidArgument, "appears twice"),
        ({"pending": ["c"]}, InvalidArgument, "'c' has 1 known tokens not computed"),
        ({"decodes": Decodes(["a"], [1])}, InvalidArgument, "'a' holds a pending token"),
        ({"items": [StepItem("a", 1, None, "", [1])]}, InvalidArgument, "holds a pending"),
        ({"pending": ["b"], "lease": "other"}, PermissionDenied, "belongs to another lease"),
        ({"late": {"a": 4}, "lease": "other"}, PermissionDenied, "belongs to another lease"),
        ({"pending": ["b"], "commit_through": 3}, InvalidArgument,
         "commit_through_step_id 3 names a step not sent yet"),
    ],
)
def test_bad_pipelining_fields_are_refused_and_change_nothing(kwargs, error, match):
    d = Driver()
    d.step([new("a", [1, 2, 3]), new("b", [5, 6]), new("c", [7, 8, 9], 2)], in_flight=False)
    d.step(pending=["a"])  # a holds a pending token; b is plain; c has a token not computed
    if kwargs.get("lease") == "other":
        kwargs["lease"] = d.allocator.create_lease(60.0).lease_id
    before = d.state()
    with pytest.raises(error, match=match):
        d.step(**kwargs)
    assert d.state() == before


def test_a_step_with_late_values_alone_is_not_empty():
    d = Driver()
    d.step([new("a", [1, 2, 3])], in_flight=False)
    d.step(pending=["a"])
    d.step(late={"a": 4}, in_flight=False)
    assert d.tokens("a") == [1, 2, 3, 4] and not d.pool.pending


@pytest.mark.e2e  # (a Python subprocess)
def test_service_pipelined_step_round_trip_and_bad_input(stub):
    pool = register(stub, block_size=2)

    def call(**fields):
        return stub.Step(pb.StepRequest(pool_id=pool.pool_id, epoch=pool.epoch,
                                        lease_id=stub.lease_id, **fields))

    call(items=[new("a", [1, 2, 3])], step_id=1)
    response = call(pending_decode_request_ids=["a"], step_id=2, compact_grants=True)
    assert not response.grants and not response.appended_request_ids  # position 3: block 1
    response = call(pending_decode_request_ids=["a"], late_request_ids=["a"],
                    late_token_ids=[4], step_id=3, commit_through_step_id=1,
                    compact_grants=True)
    assert list(response.appended_request_ids) == ["a"]  # position 4 starts block 2
    (grant,) = call(items=[new("b", [1, 2, 3, 4, 9])], step_id=4).grants
    assert grant.num_cached_tokens == 2  # block 0 only: block 1's step was still in flight
    for code, match, fields in [
        (grpc.StatusCode.INVALID_ARGUMENT, "late_request_ids has 1 entries",
         {"late_request_ids": ["a"]}),
        (grpc.StatusCode.INVALID_ARGUMENT, "holds a pending token",
         {"decode_request_ids": ["a"], "decode_token_ids": [7]}),
        (grpc.StatusCode.NOT_FOUND, "pending decode for unknown request 'zz'",
         {"pending_decode_request_ids": ["zz"]}),
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
    result = d.step(pending=["a", "r"], swap=True)
    assert [p.request_id for p in result.preempted] == ["r"]
    d.step([StepItem("r", 1, None, "", [9])], free=["a"], late={"a": 6})

    def cached() -> int:
        (match,) = d.allocator.match_prefix([4, 5, 6, 7, 8], "", ["p"])
        return match.num_cached_tokens

    d.step(pending=["r"])  # step 4: commits step 2
    assert cached() == 0
    d.step(pending=["r"], late={"r": 3})  # step 5: commits step 3, which swapped r in
    assert cached() == 4


def test_a_commit_of_the_latest_step_stops_short_of_a_pending_token():
    # A client commits a plain Step's predecessor while a request still holds a pending
    # token (its value never sent): the committed count stops before it.
    d = Driver(num_blocks=10)
    d.step([new("a", [1, 2])], in_flight=False)
    d.step(pending=["a"])  # position 2, in a block it does not fill
    d.step([new("b", [5])], in_flight=False)  # commits step 2's grants at current counts
    assert d.pool.requests["a"].num_committed == 2


@pytest.mark.parametrize("in_flight", [True, False])
def test_a_step_never_commits_a_request_it_aborts(in_flight: bool):
    # commit_through_step_id and an abort of the same request in one call: the abort wins
    # (an abort commits nothing), whichever of the kept steps the id covers.
    d = Driver()
    d.step([new("a", [1, 2, 3, 4, 5]), new("b", [7, 8])], in_flight=False)
    if in_flight:
        d.step(pending=["a", "b"])  # step 1 is now the one kept with its counts
    d.step([new("c", [9])], abort=["a"], late={"b": 1} if in_flight else None,
           in_flight=False)
    stored = [e.token_ids for e in d.pool.events.after(0, 1 << 10).events if e.token_ids]
    assert [1, 2] not in stored and [3, 4] not in stored
    assert [7, 8] in stored  # b's block: confirmed by the same id
