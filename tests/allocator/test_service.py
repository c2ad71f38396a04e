"""The allocator service over real gRPC on loopback: the contract and every bad input."""

from __future__ import annotations

import itertools
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pagedkv.allocator.v1 import allocator_pb2 as pb
from tests.allocator.conftest import AUTH

pytestmark = pytest.mark.e2e  # the `stub` fixture: a real allocator process

_ids = itertools.count()


def register(stub, num_blocks=16, block_size=4, num_cpu_blocks=4, instance="inst-1", pool_id=None):
    pool_id = pool_id or f"pool-{next(_ids)}"
    return stub.RegisterPool(
        pb.RegisterPoolRequest(
            pool_id=pool_id,
            num_blocks=num_blocks,
            block_size=block_size,
            num_cpu_blocks=num_cpu_blocks,
            model_fingerprint="tiny",
            executor_instance_id=instance,
            enable_prefix_caching=True,
        )
    ).pool


def step(stub, pool, items=(), commits=None, free=(), abort=(), **kwargs):
    kwargs.setdefault("lease_id", stub.lease_id)  # every call that changes a request names one
    return stub.Step(
        pb.StepRequest(
            pool_id=pool.pool_id,
            epoch=pool.epoch,
            items=list(items),
            commits=[
                pb.Commit(request_id=k, num_computed_tokens=v) for k, v in (commits or {}).items()
            ],
            free_request_ids=list(free),
            abort_request_ids=list(abort),
            **kwargs,
        )
    )


def new(request_id, prompt, num_tokens=None, salt=""):
    return pb.StepItem(
        request_id=request_id,
        prompt_token_ids=prompt,
        cache_salt=salt,
        num_tokens=len(prompt) if num_tokens is None else num_tokens,
    )


def stats(stub, pool):
    return stub.GetStats(pb.GetStatsRequest(pool_id=pool.pool_id)).pools[0]


def expect_error(code, fn, *args, match=""):
    with pytest.raises(grpc.RpcError) as info:
        fn(*args)
    assert info.value.code() == code, info.value.details()
    assert match in info.value.details()
    return info.value.details()


def test_service_register_is_idempotent_and_reports_hash_profile(stub):
    # Same executor instance: same epoch; the hash profile names algorithm and block size.
    pool = register(stub, pool_id="idem")
    again = register(stub, pool_id="idem")
    assert again.epoch == pool.epoch
    assert (
        pool.hash_profile.version,
        pool.hash_profile.algorithm,
        pool.hash_profile.block_size,
    ) == ("pagedkv-block-hash-v1", "sha256", 4)
    assert stub.DescribePool(pb.DescribePoolRequest(pool_id="idem")).pool == pool


def test_service_new_executor_instance_resets_pool_and_epoch(stub):
    # A restarted executor re-registers: requests are dropped, the old epoch is refused.
    # (This allocator runs with --verify-pool-resets false: there is no executor to ask;
    # the confirmed reset is tested through the whole stack, in e2e test_restart and
    # test_trust.)
    pool = register(stub, pool_id="restart")
    step(stub, pool, [new("a", [1, 2, 3])])
    reset = stub.RegisterPool(
        pb.RegisterPoolRequest(
            pool_id="restart",
            num_blocks=16,
            block_size=4,
            num_cpu_blocks=4,
            model_fingerprint="tiny",
            executor_instance_id="inst-2",
            enable_prefix_caching=True,
        )
    )
    assert reset.reset and reset.pool.epoch > pool.epoch
    expect_error(
        grpc.StatusCode.FAILED_PRECONDITION, step, stub, pool, [new("b", [1])], match="epoch"
    )
    assert stats(stub, reset.pool).num_requests == 0


def test_service_step_round_trip_with_prefix_hit(stub):
    # a prefills 9 tokens, commits them and is freed; b with the same prompt hits 8 tokens.
    pool = register(stub)
    response = step(stub, pool, [new("a", list(range(9)))])
    (grant,) = response.grants
    assert list(grant.delta.block_ids) == [0, 1, 2] and grant.new_request
    assert response.num_free_blocks == 13
    step(stub, pool, commits={"a": 9}, free=["a"])
    match = stub.MatchPrefix(
        pb.MatchPrefixRequest(token_ids=list(range(9)), pool_ids=[pool.pool_id])
    )
    assert match.matches[0].num_cached_tokens == 8
    # An empty prompt (or one token: always recomputed) matches nothing; the call succeeds.
    for tokens in ([], [0]):
        match = stub.MatchPrefix(pb.MatchPrefixRequest(token_ids=tokens, pool_ids=[pool.pool_id]))
        assert match.matches[0].num_cached_tokens == 0
    (grant,) = step(stub, pool, [new("b", list(range(9)))]).grants
    assert (grant.num_cached_tokens, grant.start_position, grant.num_scheduled_tokens) == (8, 8, 1)
    s = stats(stub, pool)
    assert (s.num_prefix_hits, s.num_prefix_queries, s.num_requests) == (8, 18, 1)
    detail = stub.GetStats(pb.GetStatsRequest(pool_id=pool.pool_id, request_ids=["b"])).requests[0]
    assert (detail.num_cached_tokens, detail.num_blocks, detail.num_blocks_written) == (8, 3, 1)


def test_service_preemption_and_deferral_reported(stub):
    # 2 blocks of 4: a and b each hold one full block; both decode: b (the tail) is preempted,
    # and the new c is deferred in that step.
    pool = register(stub, num_blocks=2, num_cpu_blocks=0)
    step(stub, pool, [new("a", [1] * 4), new("b", [2] * 4)])
    decode = [pb.StepItem(request_id=r, num_tokens=1) for r in ("a", "b")]
    response = step(
        stub,
        pool,
        [*decode, new("c", [3])],
        commits={"a": 4, "b": 4},
        preemption_mode=pb.PREEMPTION_MODE_RECOMPUTE,
        append_request_ids=["a", "b"],
        append_token_ids=[5, 5],
    )
    assert [(p.request_id, p.mode) for p in response.preempted] == [
        ("b", pb.PREEMPTION_MODE_RECOMPUTE)
    ]
    assert list(response.deferred_request_ids) == ["c"]
    assert stats(stub, pool).num_preemptions == 1


def test_service_fork_and_swap_out(stub):
    # Children share the parent's table; swapping a child out returns GPU->CPU copies.
    pool = register(stub, num_cpu_blocks=4)
    step(stub, pool, [new("p", [1, 2, 3, 4, 5, 6])])
    fork = stub.Fork(
        pb.ForkRequest(lease_id=stub.lease_id,
            pool_id=pool.pool_id,
            epoch=pool.epoch,
            parent_request_id="p",
            child_request_ids=["c1", "c2"],
        )
    )
    assert [list(t.block_ids) for t in fork.child_tables] == [[0, 1], [0, 1]]
    swap = stub.SwapOut(pb.SwapOutRequest(lease_id=stub.lease_id,
                                          pool_id=pool.pool_id, epoch=pool.epoch, request_id="c1"))
    assert [(c.src_block_id, c.dst_block_id) for c in swap.swap_out] == [(0, 0), (1, 1)]
    s = stats(stub, pool)
    assert (s.num_swapped_requests, s.num_free_cpu_blocks) == (1, 2)
    stub.Free(pb.FreeRequest(lease_id=stub.lease_id,
                             pool_id=pool.pool_id, epoch=pool.epoch, request_ids=["p", "c1", "c2"]))
    s = stats(stub, pool)
    assert (s.num_free_blocks, s.num_free_cpu_blocks, s.num_requests) == (16, 4, 0)


def test_service_events_follow_cache_with_cursor_and_snapshot(stub):
    # Committing 2 full blocks emits 2 BlockStored events; the snapshot agrees.
    pool = register(stub)
    step(stub, pool, [new("a", list(range(8)))])
    step(stub, pool, commits={"a": 8})
    events = stub.GetEvents(pb.GetEventsRequest(pool_id=pool.pool_id, after_seq=0))
    assert [e.seq for e in events.events] == [1, 2] and not events.truncated
    assert [e.stored.block_id for e in events.events] == [0, 1]
    assert events.events[1].stored.parent_block_hash == events.events[0].stored.block_hash
    assert list(events.events[0].stored.token_ids) == [0, 1, 2, 3]
    snapshot = stub.GetSnapshot(pb.GetSnapshotRequest(pool_id=pool.pool_id))
    assert snapshot.seq == 2 and {b.block_id for b in snapshot.blocks} == {0, 1}
    after = stub.GetEvents(pb.GetEventsRequest(pool_id=pool.pool_id, after_seq=2))
    assert list(after.events) == [] and after.last_seq == 2


def test_service_lease_expiry_frees_requests(stub):
    # A lease that is not kept alive expires and its requests' blocks come back.
    pool = register(stub)
    lease = stub.CreateLease(pb.CreateLeaseRequest(ttl_ms=200))
    kept = stub.CreateLease(pb.CreateLeaseRequest(ttl_ms=400))
    step(stub, pool, [new("gone", [1] * 8)], lease_id=lease.lease_id)
    step(stub, pool, [new("kept", [2] * 8)], lease_id=kept.lease_id)
    for _ in range(8):
        time.sleep(0.1)
        stub.KeepAlive(pb.KeepAliveRequest(lease_id=kept.lease_id))
    s = stats(stub, pool)
    assert (s.num_requests, s.num_free_blocks) == (1, 14)
    expect_error(
        grpc.StatusCode.NOT_FOUND,
        stub.KeepAlive,
        pb.KeepAliveRequest(lease_id=lease.lease_id),
        match="expired",
    )
    expect_error(
        grpc.StatusCode.NOT_FOUND,
        lambda: step(stub, pool, [new("x", [1])], lease_id=lease.lease_id),
        match="lease",
    )


def test_service_another_leases_requests_are_permission_denied(stub):
    # Two clients picked the same kind of ids; one may not touch the other's requests, in a
    # Step or outside one, and the refused calls change nothing.
    pool = register(stub)
    mine = stub.CreateLease(pb.CreateLeaseRequest(ttl_ms=60_000)).lease_id
    theirs = stub.CreateLease(pb.CreateLeaseRequest(ttl_ms=60_000)).lease_id
    step(stub, pool, [new("theirs", [1, 2, 3])], lease_id=theirs)
    before = stats(stub, pool)
    denied = grpc.StatusCode.PERMISSION_DENIED
    expect_error(
        denied,
        stub.Step,
        pb.StepRequest(
            pool_id=pool.pool_id, epoch=pool.epoch, lease_id=mine,
            decode_request_ids=["theirs"], append_request_ids=["theirs"], append_token_ids=[4],
        ),
        match="'theirs' in pool",
    )
    expect_error(denied, lambda: step(stub, pool, abort=["theirs"], lease_id=mine))
    expect_error(denied, stub.Abort, pb.AbortRequest(
        pool_id=pool.pool_id, epoch=pool.epoch, request_ids=["theirs"], lease_id=mine))
    expect_error(denied, stub.Free, pb.FreeRequest(
        pool_id=pool.pool_id, epoch=pool.epoch, request_ids=["theirs"], lease_id=mine))
    expect_error(denied, stub.Fork, pb.ForkRequest(
        pool_id=pool.pool_id, epoch=pool.epoch, parent_request_id="theirs",
        child_request_ids=["c"], lease_id=mine))
    expect_error(denied, stub.SwapOut, pb.SwapOutRequest(
        pool_id=pool.pool_id, epoch=pool.epoch, request_id="theirs", lease_id=mine))
    assert stats(stub, pool) == before
    stub.Abort(pb.AbortRequest(
        pool_id=pool.pool_id, epoch=pool.epoch, request_ids=["theirs"], lease_id=theirs))
    assert stats(stub, pool).num_free_blocks == 16


@pytest.mark.parametrize(
    ("num_blocks", "block_size", "fragment"),
    [
        (0, 16, "num_blocks=0"),
        (10**9, 16, "num_blocks=1000000000"),
        (8, 0, "block_size=0"),
        (8, 4096, "block_size=4096"),
    ],
)
def test_service_rejects_zero_or_absurd_pool(stub, num_blocks, block_size, fragment):
    expect_error(
        grpc.StatusCode.INVALID_ARGUMENT,
        stub.RegisterPool,
        pb.RegisterPoolRequest(pool_id="bad", num_blocks=num_blocks, block_size=block_size),
        match=fragment,
    )


def test_service_bad_input_gets_precise_status_and_changes_nothing(stub):
    # Each bad call is refused whole: the valid item beside the bad one is not admitted.
    pool = register(stub)
    step(stub, pool, [new("a", [1, 2, 3])])
    before = stats(stub, pool)
    code = grpc.StatusCode
    cases = [
        (
            code.NOT_FOUND,
            "unknown pool",
            lambda: stub.Step(pb.StepRequest(pool_id="nope", epoch=1, items=[new("z", [1])],
                                             lease_id=stub.lease_id)),
        ),
        (
            code.INVALID_ARGUMENT,
            "lease_id is required",
            lambda: step(stub, pool, [new("no-lease", [1])], lease_id=""),
        ),
        (
            code.INVALID_ARGUMENT,
            "request_id has 257 characters; at most 256",
            lambda: step(stub, pool, [new("r" * 257, [1])]),
        ),
        (
            code.INVALID_ARGUMENT,
            "cache_salt has 257 characters; at most 256",
            lambda: step(stub, pool, [new("salted", [1], salt="s" * 257)]),
        ),
        (
            code.NOT_FOUND,
            "unknown request",
            lambda: step(
                stub, pool, [new("ok", [1]), pb.StepItem(request_id="ghost", num_tokens=1)]
            ),
        ),
        (
            code.ALREADY_EXISTS,
            "already admitted",
            lambda: step(stub, pool, [new("ok", [1]), new("a", [1])]),
        ),
        (code.INVALID_ARGUMENT, ">= 0", lambda: step(stub, pool, [new("neg", [1, -5])])),
        (code.INVALID_ARGUMENT, "empty step", lambda: step(stub, pool, [])),
        (
            code.INVALID_ARGUMENT,
            "maximum batch",
            lambda: step(stub, pool, [new(f"n{i}", [1]) for i in range(9)]),
        ),
        (code.INVALID_ARGUMENT, "twice", lambda: step(stub, pool, [new("d", [1]), new("d", [1])])),
        (
            code.RESOURCE_EXHAUSTED,
            "needs 17 blocks",
            lambda: step(stub, pool, [new("big", [1] * 65)]),
        ),
        (code.INVALID_ARGUMENT, "granted only", lambda: step(stub, pool, commits={"a": 99})),
        (code.NOT_FOUND, "unknown request", lambda: step(stub, pool, free=["ghost"])),
        (code.INVALID_ARGUMENT, "freed twice", lambda: step(stub, pool, free=["a", "a"])),
        (
            code.INVALID_ARGUMENT,
            "both freed and scheduled",
            lambda: step(stub, pool, [pb.StepItem(request_id="a", num_tokens=1)], free=["a"]),
        ),
        (
            code.NOT_FOUND,
            "unknown parent",
            lambda: stub.Fork(
                pb.ForkRequest(lease_id=stub.lease_id,
                    pool_id=pool.pool_id,
                    epoch=pool.epoch,
                    parent_request_id="ghost",
                    child_request_ids=["c"],
                )
            ),
        ),
        (
            code.ALREADY_EXISTS,
            "already exists",
            lambda: stub.Fork(
                pb.ForkRequest(lease_id=stub.lease_id,
                    pool_id=pool.pool_id,
                    epoch=pool.epoch,
                    parent_request_id="a",
                    child_request_ids=["a"],
                )
            ),
        ),
        (
            code.NOT_FOUND,
            "unknown request",
            lambda: stub.GetStats(pb.GetStatsRequest(pool_id=pool.pool_id, request_ids=["ghost"])),
        ),
        (
            code.INVALID_ARGUMENT,
            ">= 0",
            lambda: stub.MatchPrefix(pb.MatchPrefixRequest(token_ids=[-1])),
        ),
    ]
    for status, fragment, call in cases:
        expect_error(status, call, match=fragment)
    assert stats(stub, pool) == before
    # Double free: the first succeeds, the second is NOT_FOUND and nothing else moves.
    stub.Free(pb.FreeRequest(lease_id=stub.lease_id,
                             pool_id=pool.pool_id, epoch=pool.epoch, request_ids=["a"]))
    expect_error(
        grpc.StatusCode.NOT_FOUND,
        stub.Free,
        pb.FreeRequest(lease_id=stub.lease_id,
                       pool_id=pool.pool_id, epoch=pool.epoch, request_ids=["a"]),
        match="unknown request",
    )
    assert stats(stub, pool).num_free_blocks == 16


def test_service_stays_up_health_open_reflection_closed(allocator_server, stub):
    # After all the bad input above, the server is SERVING. Health needs no credential
    # (probes); reflection is not offered on an authenticated server (it is an RPC too).
    channel = grpc.insecure_channel(allocator_server.address)
    health = health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service="pagedkv.allocator.v1.AllocatorService")
    )
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    with pytest.raises(grpc.RpcError) as info:
        list(reflection.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    channel.close()


@pytest.mark.parametrize("method", sorted(
    pb.DESCRIPTOR.services_by_name["AllocatorService"].methods_by_name))
@pytest.mark.parametrize("authorization", [None, "Bearer not-the-token-0123456789", "Basic x"])
def test_a_stranger_gets_unauthenticated_from_every_method(allocator_server, method,
                                                           authorization):
    # Raw bytes (an empty message: valid for every request type), no or a wrong credential.
    with grpc.insecure_channel(allocator_server.address) as channel:
        call = channel.unary_unary(f"/pagedkv.allocator.v1.AllocatorService/{method}")
        metadata = (("authorization", authorization),) if authorization else None
        with pytest.raises(grpc.RpcError) as info:
            call(b"", metadata=metadata, timeout=5)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, info.value.details()


@pytest.mark.parametrize("method", ["Step", "RegisterPool", "GetEvents", "CreateLease"])
def test_undecodable_bytes_are_invalid_argument(allocator_server, method):
    with AUTH.channel(allocator_server.address) as channel:
        call = channel.unary_unary(f"/pagedkv.allocator.v1.AllocatorService/{method}")
        with pytest.raises(grpc.RpcError) as info:
            call(b"\xff\xff\xff\xff", timeout=5)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "could not be decoded" in info.value.details()


def test_bounds_on_leases_and_pools(stub):
    expect_error(grpc.StatusCode.INVALID_ARGUMENT, stub.CreateLease,
                 pb.CreateLeaseRequest(ttl_ms=4_000_000_000), match="over this allocator's maximum")
    expect_error(grpc.StatusCode.INVALID_ARGUMENT, stub.RegisterPool,
                 pb.RegisterPoolRequest(pool_id="huge", num_blocks=4_194_304, block_size=16),
                 match="num_blocks=4194304 is out of range")
    expect_error(grpc.StatusCode.INVALID_ARGUMENT, stub.RegisterPool,
                 pb.RegisterPoolRequest(pool_id="p" * 300, num_blocks=4, block_size=16),
                 match="pool_id has 300 characters")


def test_service_decode_column_and_commit_through_step_id(stub):
    # decode_request_ids mean one token more each, their values in append_*; commit_through_step_id
    # commits what the numbered steps up to it granted, so a later request hits the
    # committed block.
    pool = register(stub)
    step(stub, pool, [new("a", [1, 2, 3])], step_id=1)
    response = stub.Step(
        pb.StepRequest(
            lease_id=stub.lease_id,
            pool_id=pool.pool_id,
            epoch=pool.epoch,
            step_id=2,
            commit_through_step_id=1,
            decode_request_ids=["a"],
            append_request_ids=["a"], append_token_ids=[4],
        )
    )
    assert list(response.grants) == []  # the token fit the private last block
    stub.Step(
        pb.StepRequest(
            lease_id=stub.lease_id,
            pool_id=pool.pool_id,
            epoch=pool.epoch,
            step_id=3,
            commit_through_step_id=2,
            decode_request_ids=["a"],
            append_request_ids=["a"], append_token_ids=[5],
        )
    )
    (grant,) = step(stub, pool, [new("b", [1, 2, 3, 4, 9])]).grants
    assert grant.num_cached_tokens == 4
    expect_error(
        grpc.StatusCode.INVALID_ARGUMENT,
        stub.Step,
        pb.StepRequest(
            lease_id=stub.lease_id,
            pool_id=pool.pool_id,
            epoch=pool.epoch,
            decode_request_ids=["a", "b"],
            append_request_ids=["a", "b"], append_token_ids=[1],
        ),
        match="append_request_ids has 2 entries but append_token_ids has 1",
    )


def test_service_pools_are_independent_with_their_own_block_sizes(stub):
    # One allocator, two pools (block 4 and block 8): the same committed prompt is cached in
    # the pool that ran it only, and MatchPrefix reports each pool in its own block size.
    small = register(stub, num_blocks=16, block_size=4)
    large = register(stub, num_blocks=4, block_size=8)
    prompt = list(range(100, 117))  # 17 tokens
    step(stub, small, [new("a", prompt)])
    step(stub, small, commits={"a": 17}, free=["a"])
    (grant,) = step(stub, large, [new("a", prompt)]).grants  # same id, other pool: allowed
    assert (grant.num_cached_tokens, list(grant.delta.block_ids)) == (0, [0, 1, 2])
    step(stub, large, commits={"a": 17})
    matches = stub.MatchPrefix(
        pb.MatchPrefixRequest(token_ids=prompt, pool_ids=[small.pool_id, large.pool_id])
    ).matches
    assert [(m.pool_id, m.num_cached_tokens) for m in matches] == [
        (small.pool_id, 16),
        (large.pool_id, 16),
    ]
    assert stats(stub, large).num_free_blocks == 1 and stats(stub, small).num_free_blocks == 16


def test_service_unknown_preemption_mode_is_invalid_argument(stub):
    pool = register(stub)
    expect_error(
        grpc.StatusCode.INVALID_ARGUMENT,
        lambda: step(stub, pool, [new("a", [1])], preemption_mode=7),
        match="preemption_mode=7",
    )
    assert stats(stub, pool).num_requests == 0


def test_service_decode_entering_a_new_block_travels_in_the_appended_columns(stub):
    # A decode at a block boundary gets its one new block in appended_*, not in grants, and
    # so does a one-token item that only appends a block; a forked child's first write into
    # the shared partial block stays a grant (copy-on-write).
    pool = register(stub)  # block size 4

    def decode(request_id, token, as_item=False):
        column = {"items": [pb.StepItem(request_id=request_id, num_tokens=1)]} if as_item else {
            "decode_request_ids": [request_id]}
        return stub.Step(
            pb.StepRequest(
                lease_id=stub.lease_id,
                pool_id=pool.pool_id, epoch=pool.epoch,
                append_request_ids=[request_id], append_token_ids=[token], **column,
            )
        )

    (admitted,) = step(stub, pool, [new("a", [1, 2, 3, 4])]).grants
    entering = decode("a", 5)
    assert list(entering.grants) == [] and list(entering.appended_request_ids) == ["a"]
    (block,) = entering.appended_block_ids
    assert block not in admitted.delta.block_ids
    step(stub, pool, [new("a2", [1, 2, 3, 9])])
    as_item = decode("a2", 5, as_item=True)
    assert list(as_item.grants) == [] and list(as_item.appended_request_ids) == ["a2"]
    step(stub, pool, [new("p", [1, 2, 3, 4, 5, 6])])
    stub.Fork(
        pb.ForkRequest(lease_id=stub.lease_id,
            pool_id=pool.pool_id, epoch=pool.epoch, parent_request_id="p",
            child_request_ids=["c"],
        )
    )
    cow = decode("c", 7)
    (grant,) = cow.grants
    assert list(cow.appended_request_ids) == [] and grant.delta.start_index == 1
    (copy,) = cow.copies
    assert copy.dst_block_id == grant.delta.block_ids[0]


def test_service_a_freed_id_may_be_admitted_again_in_the_same_step(stub):
    # A client reuses the id of a request that has just finished: the gateway's next Step
    # frees the old one and admits the new one. The free applies first; the new request
    # starts from its own prompt (a running item under a freed id stays refused).
    pool = register(stub, block_size=2)
    step(stub, pool, [new("a", [1, 2, 3])])
    response = step(stub, pool, [new("a", [7, 8])], commits={"a": 3}, free=["a"])
    (grant,) = response.grants
    assert grant.request_id == "a" and grant.new_request and grant.num_scheduled_tokens == 2
    stats = stub.GetStats(pb.GetStatsRequest(pool_id=pool.pool_id, request_ids=["a"]))
    assert stats.requests[0].num_tokens == 2 and stats.pools[0].num_requests == 1
    (grant,) = step(stub, pool, [new("b", [1, 2, 3])]).grants
    assert grant.num_cached_tokens == 2  # the old request's block, committed before its free


def test_service_free_commits_through_a_step_id_and_refuses_one_not_sent(stub):
    # An idle gateway confirms its numbered steps with its Free; an id this lease never sent
    # is INVALID_ARGUMENT and changes nothing (the request is not freed).
    pool = register(stub)
    lease = stub.CreateLease(pb.CreateLeaseRequest(ttl_ms=60_000)).lease_id
    step(stub, pool, [new("a", [1, 2, 3, 4, 5])], lease_id=lease, step_id=1)
    expect_error(
        grpc.StatusCode.INVALID_ARGUMENT,
        stub.Free,
        pb.FreeRequest(pool_id=pool.pool_id, epoch=pool.epoch, request_ids=["a"],
                       lease_id=lease, commit_through_step_id=2),
        match="commit_through_step_id 2 names a step not sent yet",
    )
    assert stats(stub, pool).num_requests == 1
    stub.Free(pb.FreeRequest(pool_id=pool.pool_id, epoch=pool.epoch, request_ids=["a"],
                             lease_id=lease, commit_through_step_id=1))
    (grant,) = step(stub, pool, [new("b", [1, 2, 3, 4, 9])]).grants
    assert grant.num_cached_tokens == 4  # step 1's full block, committed by the Free
