"""ReserveHandOff over real gRPC on loopback: a reservation sharing the cached prefix runs on
as any request; every refusal has its status and changes nothing; an expired lease frees a
reserved request; the tenant quota; the gateway's client and PoolLink."""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

import grpc
import pytest

from common.credentials import lease_tag
from gateway.clients.allocator_client import AllocatorClient, HandOffReservation
from gateway.clients.call_failures import Denied, Rejected, Stale, Unknown
from gateway.clients.executor_client import ExecutorClient
from gateway.clients.lease import Lease
from gateway.clients.pool_link import PoolLink
from pagedkv.allocator.v1 import allocator_pb2 as pb
from pagedkv.allocator.v1 import allocator_pb2_grpc
from tests.allocator.conftest import AUTH, start_allocator, stop_process
from tests.gateway.loopback_allocator import description

pytestmark = pytest.mark.e2e

A = list(range(9))  # two full blocks of 4, and one token
HANDED = list(range(8)) + [90, 91, 92, 93, 94]  # A's two full blocks, then 5 of its own
_ids = itertools.count()


def register(stub: Any, num_blocks: int = 16, block_size: int = 4, fingerprint: str = "tiny",
             pool_id: str | None = None) -> Any:
    return stub.RegisterPool(pb.RegisterPoolRequest(
        pool_id=pool_id or f"hand-{next(_ids)}", num_blocks=num_blocks, block_size=block_size,
        model_fingerprint=fingerprint, executor_instance_id="inst-1",
        enable_prefix_caching=True)).pool


def step(stub: Any, pool: Any, items: tuple[Any, ...] = (), **kwargs: Any) -> Any:
    kwargs.setdefault("lease_id", stub.lease_id)
    return stub.Step(pb.StepRequest(pool_id=pool.pool_id, epoch=pool.epoch, items=list(items),
                                    **kwargs))


def cache_a(stub: Any, pool: Any) -> None:
    """A's two full blocks cached (blocks 0 and 1), free."""
    step(stub, pool, (pb.StepItem(request_id="a", prompt_token_ids=A, num_tokens=9),))
    step(stub, pool, commits=[pb.Commit(request_id="a", num_computed_tokens=9)],
         free_request_ids=["a"])


def reservation(stub: Any, pool: Any, **fields: Any) -> pb.ReserveHandOffRequest:
    base: dict[str, Any] = {
        "pool_id": pool.pool_id, "epoch": pool.epoch, "lease_id": stub.lease_id,
        "request_id": "h", "token_ids": HANDED, "num_prompt_tokens": 10,
        "source_model_fingerprint": "tiny", "source_block_size": 4,
    }
    return pb.ReserveHandOffRequest(**{**base, **fields})


def stats(stub: Any, pool: Any) -> Any:
    return stub.GetStats(pb.GetStatsRequest(pool_id=pool.pool_id)).pools[0]


def test_hand_off_service_reserves_the_cached_prefix_and_the_request_runs_on(stub):
    # The table shares blocks 0 and 1, fresh 2 and 3 hold the rest; a decode with the
    # commit of the moved tokens caches block 2; a Free ends it.
    pool = register(stub)
    cache_a(stub, pool)
    response = stub.ReserveHandOff(reservation(stub, pool, source_pool_id="on-another-shard"))
    assert (response.table.start_index, list(response.table.block_ids)) == (0, [0, 1, 2, 3])
    assert (response.num_cached_tokens, response.num_free_blocks) == (8, 12)
    decoded = step(stub, pool, decode_request_ids=["h"], append_request_ids=["h"],
                   append_token_ids=[5],
                   commits=[pb.Commit(request_id="h", num_computed_tokens=13)])
    assert list(decoded.grants) == [] and list(decoded.appended_request_ids) == []
    held = stub.GetStats(pb.GetStatsRequest(pool_id=pool.pool_id, request_ids=["h"]))
    assert (held.requests[0].num_tokens, held.requests[0].num_computed_tokens) == (14, 14)
    match = stub.MatchPrefix(pb.MatchPrefixRequest(token_ids=HANDED, pool_ids=[pool.pool_id]))
    assert match.matches[0].num_cached_tokens == 12
    stub.Free(pb.FreeRequest(pool_id=pool.pool_id, epoch=pool.epoch, request_ids=["h"],
                             lease_id=stub.lease_id))
    s = stats(stub, pool)
    assert (s.num_free_blocks, s.num_cached_blocks, s.num_requests) == (16, 3, 0)
    assert (s.num_prefix_queries, s.num_prefix_hits) == (9, 0)  # a hand-off is not a prompt


def test_hand_off_service_refusals_have_their_status_and_change_nothing(stub):
    pool = register(stub, num_blocks=8)
    register(stub, fingerprint="other", pool_id="hand-other-model")
    register(stub, block_size=8, pool_id="hand-other-size")
    cache_a(stub, pool)
    stub.ReserveHandOff(reservation(stub, pool, request_id="held", token_ids=[5] * 5,
                                    num_prompt_tokens=5))
    theirs = stub.CreateLease(pb.CreateLeaseRequest(ttl_ms=60_000)).lease_id
    stub.ReserveHandOff(reservation(stub, pool, request_id="theirs", token_ids=[6] * 5,
                                    num_prompt_tokens=5,
                                    lease_id=theirs))
    before = stats(stub, pool)
    code = grpc.StatusCode
    cases: list[tuple[grpc.StatusCode, str, dict[str, Any]]] = [
        (code.INVALID_ARGUMENT, "lease_id is required", {"lease_id": ""}),
        (code.INVALID_ARGUMENT, "request_id is required", {"request_id": ""}),
        (code.INVALID_ARGUMENT, "token_ids is empty", {"token_ids": []}),
        (code.INVALID_ARGUMENT, "token ids must be >= 0, got -3", {"token_ids": [1, -3]}),
        (code.INVALID_ARGUMENT, "num_prompt_tokens=14 is more than its 13",
         {"num_prompt_tokens": 14}),
        (code.INVALID_ARGUMENT, "source_block_size is required", {"source_block_size": 0}),
        (code.INVALID_ARGUMENT, "request_id has 257 characters", {"request_id": "r" * 257}),
        (code.NOT_FOUND, "unknown pool 'nope'", {"pool_id": "nope"}),
        (code.NOT_FOUND, f"{lease_tag('lease-gone')} is unknown or expired",
         {"lease_id": "lease-gone"}),
        (code.FAILED_PRECONDITION, f"is at epoch {pool.epoch}", {"epoch": pool.epoch - 1}),
        (code.FAILED_PRECONDITION, "model fingerprint 'llama', target pool "
         f"'{pool.pool_id}' has 'tiny'", {"source_model_fingerprint": "llama"}),
        (code.FAILED_PRECONDITION, f"block size 16, target pool '{pool.pool_id}' has 4",
         {"source_block_size": 16}),
        (code.FAILED_PRECONDITION, "source pool 'hand-other-model' has model fingerprint "
         "'other'", {"source_pool_id": "hand-other-model"}),
        (code.FAILED_PRECONDITION, "source pool 'hand-other-size' has block size 8",
         {"source_pool_id": "hand-other-size"}),
        (code.INVALID_ARGUMENT, "both the source and the target",
         {"source_pool_id": pool.pool_id}),
        (code.ALREADY_EXISTS, "'held' is already in pool", {"request_id": "held"}),
        (code.PERMISSION_DENIED, "belongs to another lease", {"request_id": "theirs"}),
        (code.RESOURCE_EXHAUSTED, "needs 9 blocks", {"token_ids": [1] * 33}),
        (code.RESOURCE_EXHAUSTED, "4 free blocks", {"token_ids": [1] * 24}),
    ]
    for status, fragment, fields in cases:
        with pytest.raises(grpc.RpcError) as info:
            stub.ReserveHandOff(reservation(stub, pool, **fields))
        assert info.value.code() == status, (fields, info.value.details())
        assert fragment in info.value.details(), (fields, info.value.details())
        assert stats(stub, pool) == before, fields


def test_hand_off_service_an_expired_lease_frees_the_reserved_request(stub):
    pool = register(stub)
    cache_a(stub, pool)
    lease = stub.CreateLease(pb.CreateLeaseRequest(ttl_ms=200)).lease_id
    stub.ReserveHandOff(reservation(stub, pool, lease_id=lease))
    assert stats(stub, pool).num_free_blocks == 12
    deadline = time.monotonic() + 10
    while stats(stub, pool).num_requests and time.monotonic() < deadline:
        time.sleep(0.05)  # the sweep runs every 50 ms here
    s = stats(stub, pool)
    assert (s.num_requests, s.num_free_blocks, s.num_cached_blocks) == (0, 16, 2)


def test_hand_off_service_over_the_tenants_quota_is_resource_exhausted(tmp_path):
    server = start_allocator(tmp_path, "--max-blocks-per-tenant", "4")
    try:
        with AUTH.channel(server.address) as channel:
            stub = allocator_pb2_grpc.AllocatorServiceStub(channel)
            stub.lease_id = stub.CreateLease(pb.CreateLeaseRequest(ttl_ms=60_000)).lease_id
            pool = register(stub)
            step(stub, pool, (pb.StepItem(request_id="t1", prompt_token_ids=[1] * 12,
                                          num_tokens=12, tenant="t"),))
            before = stats(stub, pool)
            with pytest.raises(grpc.RpcError) as info:
                stub.ReserveHandOff(reservation(stub, pool, tenant="t"))
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "tenant 't' holds 3 blocks" in info.value.details()
            assert stats(stub, pool) == before
            stub.ReserveHandOff(reservation(stub, pool, tenant="u"))
    finally:
        assert stop_process(server) == 0


def test_hand_off_service_through_the_gateways_client_and_pool_link(allocator_server):
    # PoolLink passes its pool id, epoch and lease; refusals arrive as CallFailed kinds.
    async def scenario() -> None:
        client = AllocatorClient(allocator_server.address, timeout_s=5, auth=AUTH)
        executor = ExecutorClient("127.0.0.1:1")
        lease = Lease(allocator=client, ttl_ms=60_000)
        await lease.acquire()
        link = PoolLink(pool_id="hand-link", executor=executor, allocator=client, lease=lease,
                        description=description(fingerprint="fp-x"), enable_prefix_caching=True)
        await link.register()
        reserved = await link.reserve_hand_off("gw/h", HANDED, 10, "", "", "fp-x", 4, "", "h")
        assert reserved == HandOffReservation((0, 1, 2, 3), 0, 12)
        other = await client.reserve_hand_off(
            "hand-link", link.epoch, "gw/i", [7] * 4, 4, "salt", "", "fp-x", 4, "src", "i",
            link.lease_id)
        assert other == HandOffReservation((4,), 0, 11)
        refusals = [
            (Rejected, ("gw/h", HANDED, 10, "", "", "fp-x", 4, "", "h")),  # ALREADY_EXISTS
            (Stale, ("gw/j", HANDED, 10, "", "", "fp-y", 4, "", "j")),  # FAILED_PRECONDITION
        ]
        for kind, args in refusals:
            with pytest.raises(kind):
                await link.reserve_hand_off(*args)
        with pytest.raises(Unknown):
            await client.reserve_hand_off("hand-nope", 1, "x", [1], 1, "", "", "fp-x", 4, "",
                                          "x", link.lease_id)
        someone_else, _ = await client.create_lease(60_000)
        with pytest.raises(Denied):
            await client.reserve_hand_off("hand-link", link.epoch, "gw/h", [1], 1, "", "",
                                          "fp-x", 4, "", "h", someone_else)
        assert await link.abort(["gw/h", "gw/i"]) == 16
        await client.close()
        await executor.close()

    asyncio.run(scenario())
