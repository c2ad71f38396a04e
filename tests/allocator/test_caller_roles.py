"""The allocator answers gateways alone (issue 30): an executor's role token, which every
executor holds, may not step, commit, free, abort, read events, take leases or register a
pool, so it cannot fill a tenant's prefix cache with blocks no model computed nor read the
tenants' prompts; and no log line names a lease id (a lease id is a capability: with one, an
Abort of another gateway's requests passes)."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from structlog.testing import capture_logs

from allocator_svc.core.allocator import Allocator, Limits
from allocator_svc.service import METHOD_ROLES, AllocatorServicer
from common.auth import Access, internal_authenticator
from common.server import start_server
from pagedkv.allocator.v1 import allocator_pb2 as pb
from pagedkv.allocator.v1 import allocator_pb2_grpc
from tests.allocator.conftest import AUTH, EXECUTOR_AUTH, ROLE_TOKENS

pytestmark = pytest.mark.e2e

SERVICE = "pagedkv.allocator.v1.AllocatorService"
PROMPT = list(range(100, 109))  # two full blocks of 4, and one token
METHODS = sorted(pb.DESCRIPTOR.services_by_name["AllocatorService"].methods_by_name)


@pytest.fixture
def executor_stub(allocator_server: Any) -> Any:
    with EXECUTOR_AUTH.channel(allocator_server.address) as channel:
        yield allocator_pb2_grpc.AllocatorServiceStub(channel)


def _denied(call: Any) -> str:
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, info.value.details()
    return str(info.value.details())


def _register(stub: Any, pool_id: str) -> Any:
    return stub.RegisterPool(pb.RegisterPoolRequest(
        pool_id=pool_id, num_blocks=16, block_size=4, model_fingerprint="tiny",
        executor_instance_id="inst-1", enable_prefix_caching=True)).pool


@pytest.mark.parametrize("method", METHODS)
def test_an_executors_token_may_call_no_allocator_method(executor_stub: Any,
                                                         method: str) -> None:
    # Every method, its own pool's registration too (the gateway registers pools).
    request = getattr(pb, f"{method}Request")(pool_id="pool-of-the-executor") if method in (
        "RegisterPool", "GetEvents", "GetStats") else getattr(pb, f"{method}Request")()
    details = _denied(lambda: getattr(executor_stub, method)(request, timeout=10))
    assert details == f"the executor role's token may not call {method}: only gateway may"


def test_cache_poisoning_with_an_executors_token_is_refused_and_nothing_is_cached(
    stub: Any, executor_stub: Any
) -> None:
    # Issue 30's sequence: Step a prompt, then Free it with a commit, with no Execute. Under
    # the executor's token both are refused; a gateway then finds nothing cached.
    pool = _register(stub, "roles-poison")
    lease = stub.lease_id  # a lease id read from somewhere: still no use to an executor
    item = pb.StepItem(request_id="poison", prompt_token_ids=PROMPT, num_tokens=9)
    _denied(lambda: executor_stub.Step(pb.StepRequest(
        pool_id=pool.pool_id, epoch=pool.epoch, lease_id=lease, items=[item]), timeout=10))
    _denied(lambda: executor_stub.Free(pb.FreeRequest(
        pool_id=pool.pool_id, epoch=pool.epoch, lease_id=lease, request_ids=["poison"],
        commits=[pb.Commit(request_id="poison", num_computed_tokens=9)]), timeout=10))
    _denied(lambda: executor_stub.GetEvents(pb.GetEventsRequest(pool_id=pool.pool_id),
                                            timeout=10))
    matched = stub.MatchPrefix(pb.MatchPrefixRequest(token_ids=PROMPT, pool_ids=[pool.pool_id]))
    assert [m.num_cached_tokens for m in matched.matches] == [0]
    # The same sequence under the gateway's token caches the two full blocks (the test
    # would pass for nothing if the prompt could not be cached at all).
    stub.Step(pb.StepRequest(pool_id=pool.pool_id, epoch=pool.epoch, lease_id=lease,
                             items=[item]))
    stub.Free(pb.FreeRequest(pool_id=pool.pool_id, epoch=pool.epoch, lease_id=lease,
                             request_ids=["poison"],
                             commits=[pb.Commit(request_id="poison", num_computed_tokens=9)]))
    matched = stub.MatchPrefix(pb.MatchPrefixRequest(token_ids=PROMPT, pool_ids=[pool.pool_id]))
    assert [m.num_cached_tokens for m in matched.matches] == [8]


def test_the_allocators_own_token_may_not_call_it_either(allocator_server: Any) -> None:
    # Only the gateway role: the allocator's token exists for its calls to executors.
    with ROLE_TOKENS.auth("allocator").channel(allocator_server.address) as channel:
        details = _denied(lambda: allocator_pb2_grpc.AllocatorServiceStub(channel).CreateLease(
            pb.CreateLeaseRequest(), timeout=10))
    assert details == "the allocator role's token may not call CreateLease: only gateway may"


async def _leased_calls() -> tuple[list[dict[str, Any]], tuple[str, ...]]:
    """An allocator in process (the production table), called as a gateway would: a lease
    taken and kept alive, a step under it, a refused call naming another lease, a Free
    under an unknown one. Returns every log event, and the lease ids to look for."""
    servicer = AllocatorServicer(Allocator(Limits()))
    with capture_logs() as events:
        server = await start_server([(servicer, SERVICE)], "127.0.0.1", 0,
                                    authenticator=internal_authenticator(AUTH),
                                    access=Access(METHOD_ROLES))
        try:
            async with AUTH.aio_channel(f"127.0.0.1:{server.port}") as channel:
                stub = allocator_pb2_grpc.AllocatorServiceStub(channel)
                meta = AUTH.call_metadata()
                mine = (await stub.CreateLease(pb.CreateLeaseRequest(), metadata=meta)).lease_id
                theirs = (await stub.CreateLease(pb.CreateLeaseRequest(),
                                                 metadata=meta)).lease_id
                await stub.KeepAlive(pb.KeepAliveRequest(lease_id=mine), metadata=meta)
                pool = (await stub.RegisterPool(pb.RegisterPoolRequest(
                    pool_id="logged", num_blocks=16, block_size=4, model_fingerprint="tiny",
                    executor_instance_id="i", enable_prefix_caching=True), metadata=meta)).pool
                item = pb.StepItem(request_id="r", prompt_token_ids=PROMPT, num_tokens=9)
                await stub.Step(pb.StepRequest(pool_id="logged", epoch=pool.epoch,
                                               lease_id=theirs, items=[item]), metadata=meta)
                for request in (
                    pb.FreeRequest(pool_id="logged", epoch=pool.epoch, lease_id=mine,
                                   request_ids=["r"]),  # another lease's request
                    pb.FreeRequest(pool_id="logged", epoch=pool.epoch, lease_id="gone-lease",
                                   request_ids=["r"]),  # an unknown lease
                ):
                    with pytest.raises(grpc.aio.AioRpcError):
                        await stub.Free(request, metadata=meta)
                await stub.Abort(pb.AbortRequest(pool_id="logged", epoch=pool.epoch,
                                                 lease_id=theirs, request_ids=["r"]),
                                 metadata=meta)
        finally:
            await server.stop(0)
    return events, (mine, theirs, "gone-lease")


def test_no_log_line_names_a_lease_id() -> None:
    # Every event (INFO and the rest) of a lease's life and of refused calls; the tag stands
    # in for the id where a line needs to tell leases apart.
    events, lease_ids = asyncio.run(_leased_calls())
    assert {"lease_created", "rpc_rejected"} <= {e["event"] for e in events}
    for event in events:
        for lease_id in lease_ids:
            assert lease_id not in repr(event), event
    created = [e for e in events if e["event"] == "lease_created"]
    assert len(created) == 2 and all(e["lease"].startswith("lease-") for e in created)
