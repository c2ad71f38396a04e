"""Helpers for the KV hand-off tests: executors served in process on loopback (port 0, the
role tokens required), a client that plays the gateway over gRPC, and a test-only source
whose ExportKV breaks the stream on purpose."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from concurrent.futures import Future
from dataclasses import dataclass, field

import grpc

from common.auth import Access, internal_authenticator
from common.credentials import InternalAuth, RoleTokens
from common.server import Server, start_server
from executor_svc.kv_transfer import crc32
from executor_svc.runner_api import StepRunner
from executor_svc.service import SERVICE_NAME, ExecutorServicer, StepMetrics
from pagedkv.executor.v1 import executor_pb2 as pb
from pagedkv.executor.v1 import executor_pb2_grpc as pb_grpc

# The tests play the gateway (AUTH); the executors' servicers pull KV from each other with
# the executor's token (EXECUTOR_AUTH).
TOKENS = RoleTokens.new()
AUTH = TOKENS.auth("gateway")
EXECUTOR_AUTH = TOKENS.auth("executor")


@dataclass(slots=True)
class Served:
    """A server on its own event loop thread, and a blocking client with the token."""

    servicer: object
    server: Server
    loop: asyncio.AbstractEventLoop
    thread: threading.Thread
    channel: grpc.Channel
    stub: pb_grpc.ExecutorServiceStub

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    def close(self) -> None:
        self.channel.close()

        async def stop() -> None:
            await self.server.stop(0)
            if isinstance(self.servicer, ExecutorServicer):
                await self.servicer.close()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


def serve(servicer: object, auth: InternalAuth = AUTH, access: Access | None = None,
          client: InternalAuth | None = None) -> Served:
    """`access`: the method table (None: any role); `client`: the test's own credentials
    (None: `auth`)."""
    loop = asyncio.new_event_loop()
    started: Future[Server] = Future()

    def run() -> None:
        asyncio.set_event_loop(loop)
        started.set_result(loop.run_until_complete(start_server(
            [(servicer, SERVICE_NAME)], "127.0.0.1", 0,
            authenticator=internal_authenticator(auth), access=access)))
        loop.run_forever()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    server = started.result(timeout=30)
    channel = (client or auth).channel(f"127.0.0.1:{server.port}")
    return Served(servicer, server, loop, thread, channel, pb_grpc.ExecutorServiceStub(channel))


def serve_runner(runner: StepRunner, metrics: StepMetrics | None = None) -> Served:
    return serve(ExecutorServicer(runner, metrics=metrics, auth=EXECUTOR_AUTH))


@dataclass(slots=True)
class Gateway:
    """Plays the gateway and the allocator for one executor over gRPC: its own free blocks,
    tables and token counts."""

    served: Served
    free: list[int]
    block_size: int
    tables: dict[str, list[int]] = field(default_factory=dict)
    held: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, served: Served, blocks: list[int]) -> Gateway:
        info = served.stub.Describe(pb.DescribeRequest())
        return cls(served, list(blocks), info.block_size)

    @property
    def stub(self) -> pb_grpc.ExecutorServiceStub:
        return self.served.stub

    def take(self, n: int) -> list[int]:
        return [self.free.pop() for _ in range(n)]

    def step(self, rid: str, tokens: list[int], history: list[int] | None = None,
             new: bool = False) -> int:
        """Compute `tokens` for `rid` (a new request when `new`: sampling, its whole table,
        `history` before it) and return its sampled token."""
        start = self.held.get(rid, len(history or []))
        table = self.tables.setdefault(rid, [])
        end = start + len(tokens)
        table.extend(self.take(-(-end // self.block_size) - len(table)))
        work = pb.SequenceWork(request_id=rid, token_ids=tokens, start_position=start,
                               delta=pb.BlockTableDelta(start_index=0, block_ids=table),
                               sample=True)
        if new:
            work.sampling.CopyFrom(pb.SamplingParams())
            work.history_token_ids.extend(history or [])
        self.held[rid] = end
        reply = self.stub.Execute(pb.ExecuteRequest(seqs=[work]), timeout=60)
        return int(reply.tokens[0].token_id)

    def generate(self, rid: str, first_token: int, num_new: int) -> list[int]:
        """`first_token` (sampled already) and `num_new - 1` greedy tokens after it."""
        out = [first_token]
        while len(out) < num_new:
            out.append(self.step(rid, [out[-1]]))
        return out

    def import_kv(self, source: str, rid: str, num_tokens: int, block_ids: list[int],
                  first_block_index: int = 0) -> pb.ImportKVResponse:
        table = self.tables.setdefault(rid, [])
        del table[first_block_index:]
        table.extend(block_ids)
        return self.stub.ImportKV(pb.ImportKVRequest(
            source_address=source, request_id=rid, first_block_index=first_block_index,
            block_ids=block_ids, num_tokens=num_tokens), timeout=60)


class FaultySource(pb_grpc.ExecutorServiceServicer):
    """A source whose ExportKV sends well-formed messages that break the contract: a wrong
    checksum, a block missing, one too many, two out of order, or a short block."""

    def __init__(self, fault: str, bytes_per_block: int) -> None:
        self.fault = fault
        self.bytes_per_block = bytes_per_block

    async def ExportKV(  # noqa: N802
        self, request: pb.ExportKVRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.KVBlock]:
        first, fault = request.first_block_index, self.fault
        indices = list(range(first, first + request.num_blocks))
        if fault == "missing":
            indices.pop()
        elif fault == "extra":
            indices.append(first + request.num_blocks)
        elif fault == "out_of_order":
            indices[0], indices[1] = indices[1], indices[0]
        for index in indices:
            data = bytes([index % 251]) * self.bytes_per_block
            crc = crc32(data)
            if fault == "crc" and index == indices[-1]:
                crc ^= 0x1
            if fault == "short":
                data = data[:-4]
            yield pb.KVBlock(block_index=index, data=data, crc32=crc)
