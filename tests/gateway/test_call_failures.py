"""The clients' failures as the engine sees them: one outcome per status, decided at the edge.

Against a real allocator server on loopback: the clients raise call_failures' outcomes, never
a gRPC error, with the status and the server's message kept for the logs.
"""

from __future__ import annotations

import asyncio
import socket
from dataclasses import replace

import grpc
import pytest

from allocator_svc.core.allocator import Allocator, Limits
from allocator_svc.service import AllocatorServicer
from common.server import start_server
from common.step_records import StepCall
from gateway.clients.allocator_client import AllocatorClient, PoolSpec
from gateway.clients.call_failures import (
    CallFailed,
    Denied,
    Lost,
    Rejected,
    Stale,
    Unknown,
    failure,
    translated,
)
from gateway.clients.executor_client import ExecutorClient
from gateway.core.step import ExecuteCall, SeqWork, TableDelta
from pagedkv.executor.v1 import executor_pb2 as epb
from pagedkv.executor.v1 import executor_pb2_grpc as epb_grpc

pytestmark = pytest.mark.service


@pytest.mark.parametrize(
    ("code", "outcome"),
    [
        (grpc.StatusCode.UNAVAILABLE, Lost),
        (grpc.StatusCode.DEADLINE_EXCEEDED, Lost),
        (grpc.StatusCode.NOT_FOUND, Unknown),
        (grpc.StatusCode.FAILED_PRECONDITION, Stale),
        (grpc.StatusCode.PERMISSION_DENIED, Denied),
        (grpc.StatusCode.INVALID_ARGUMENT, Rejected),
        (grpc.StatusCode.INTERNAL, Rejected),
        (grpc.StatusCode.UNIMPLEMENTED, Rejected),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, Rejected),
    ],
)
def test_each_status_is_one_outcome(code: grpc.StatusCode, outcome: type[CallFailed]) -> None:
    got = failure(code, "why")
    assert type(got) is outcome
    assert (got.status, got.details) == (code.name, "why")


def test_translated_turns_a_grpc_error_into_its_outcome() -> None:
    metadata = grpc.aio.Metadata()
    with pytest.raises(Stale) as caught:
        with translated():
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.FAILED_PRECONDITION, metadata, metadata, "epoch 3 is stale"
            )
    assert caught.value.details == "epoch 3 is stale"
    assert isinstance(caught.value.__cause__, grpc.aio.AioRpcError)


def _unused_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


SPEC = PoolSpec(
    pool_id="p",
    num_blocks=16,
    block_size=4,
    num_cpu_blocks=0,
    model_fingerprint="m",
    executor_instance_id="i",
    enable_prefix_caching=True,
)


def test_a_real_allocator_s_refusals_arrive_as_outcomes() -> None:
    async def scenario() -> None:
        registration = (
            AllocatorServicer(Allocator(Limits())),
            "pagedkv.allocator.v1.AllocatorService",
        )
        server = await start_server([registration], "127.0.0.1", 0)
        client = AllocatorClient(f"127.0.0.1:{server.port}", timeout_s=5)
        try:
            lease_id, _ = await client.create_lease(10_000)
            empty = StepCall(commits=(), free_request_ids=(), abort_request_ids=(), items=())
            with pytest.raises(Unknown, match="register it first"):
                await client.step("p", 1, lease_id, empty)
            epoch = await client.register_pool(SPEC)
            with pytest.raises(Stale):
                await client.step("p", epoch + 1, lease_id, empty)
            with pytest.raises(Unknown, match="lease"):
                await client.keep_alive("no-such-lease")
            with pytest.raises(Rejected) as refused:
                await client.register_pool(replace(SPEC, pool_id="q", num_blocks=0))
            assert refused.value.status == "INVALID_ARGUMENT"
        finally:
            await client.close()
            await server.server.stop(0)

    asyncio.run(scenario())


def test_nobody_listening_is_lost() -> None:
    async def scenario() -> None:
        address = f"127.0.0.1:{_unused_port()}"
        allocator = AllocatorClient(address, timeout_s=2)
        executor = ExecutorClient(address)
        try:
            with pytest.raises(Lost):
                await allocator.register_pool(SPEC)
            with pytest.raises(Lost):
                await executor.describe(timeout=2)
        finally:
            await allocator.close()
            await executor.close()

    asyncio.run(scenario())


class _ContractBreaker(epb_grpc.ExecutorServiceServicer):
    """An executor that answers Execute, but not as the contract says."""

    def __init__(self, response: epb.ExecuteResponse) -> None:
        self.response = response

    async def Execute(self, request, context):  # noqa: N802 - the generated name
        return self.response


@pytest.mark.parametrize(
    ("response", "status", "message"),
    [
        # Ignores the compact decode columns: no token for the one decode row.
        (epb.ExecuteResponse(), "UNIMPLEMENTED", "must implement decode_request_ids"),
        # A token for a sequence that does not sample, none for the one that does.
        (
            epb.ExecuteResponse(
                decode_sampled_token_ids=[5],
                tokens=[epb.SampledToken(request_id="other", token_id=1)],
            ),
            "INTERNAL",
            "not one for each of the 1 that sample",
        ),
    ],
)
def test_an_answer_that_breaks_the_executor_contract_is_rejected(
    response: epb.ExecuteResponse, status: str, message: str
) -> None:
    call = ExecuteCall(
        release_request_ids=(),
        swap_out=(),
        swap_in=(),
        copies=(),
        seqs=(SeqWork("a", (1, 2), 0, TableDelta(0, (0,)), sample=True, sampling=None),),
        decode_request_ids=("b",),
        decode_token_ids=(3,),
        decode_positions=(4,),
    )

    async def scenario() -> None:
        registration = (
            _ContractBreaker(response),
            "pagedkv.executor.v1.ExecutorService",
        )
        server = await start_server([registration], "127.0.0.1", 0)
        client = ExecutorClient(f"127.0.0.1:{server.port}")
        try:
            with pytest.raises(Rejected, match=message) as refused:
                await client.execute(call, timeout=5)
            assert refused.value.status == status
        finally:
            await client.close()
            await server.server.stop(0)

    asyncio.run(scenario())
