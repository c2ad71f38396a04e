"""The allocator client sends the request id as x-request-id metadata (real server, port 0)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from gateway.clients.allocator_client import AllocatorClient
from pagedkv.allocator.v1 import allocator_pb2 as pb
from pagedkv.allocator.v1 import allocator_pb2_grpc as pb_grpc

pytestmark = pytest.mark.service


class RecordingAllocator(pb_grpc.AllocatorServiceServicer):
    def __init__(self) -> None:
        self.metadata: list[dict[str, str]] = []

    async def MatchPrefix(self, request, context):  # noqa: ANN001, N802
        self.metadata.append(dict(context.invocation_metadata() or ()))
        return pb.MatchPrefixResponse(matches=[pb.PrefixMatch(pool_id="p", num_cached_tokens=16)])

    async def Abort(self, request, context):  # noqa: ANN001, N802
        self.metadata.append(dict(context.invocation_metadata() or ()))
        return pb.AbortResponse()


def test_allocator_client_propagates_request_id_metadata():
    # One request's calls carry its id; a batch abort of several ids carries none.
    async def scenario() -> list[dict[str, str]]:
        servicer = RecordingAllocator()
        server = grpc.aio.server()
        pb_grpc.add_AllocatorServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        client = AllocatorClient(f"127.0.0.1:{port}")
        try:
            matches = await client.match_prefix([1, 2], "", ["p"], request_id="req-42")
            assert matches[0].num_cached_tokens == 16
            await client.abort("p", 1, ["req-42"], lease_id="lease-1")
            await client.abort("p", 1, ["a", "b"], lease_id="lease-1")
        finally:
            await client.close()
            await server.stop(None)
        return servicer.metadata

    first, second, third = asyncio.run(scenario())
    assert first["x-request-id"] == "req-42"
    assert second["x-request-id"] == "req-42"
    assert "x-request-id" not in third
