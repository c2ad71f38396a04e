"""KV hand-off, the servicer's part: ExportKV streams a held request's blocks, ImportKV pulls
them from another executor's ExportKV into reserved blocks (the checks: kv_transfer.py).

Blocks are read in a transfer thread of their own (kv_blocks.py says why that is safe):
never on the event loop, so health checks and Describe keep answering, and never in the
compute thread, so an export neither waits behind a step nor holds one up. They are written
in the compute thread, queued like Executes, after the one the import names
(`previous_step_id`): the target's allocator may have reserved blocks that an Execute sent
before still writes or copies (a request freed, preempted or swapped out by the Step before
the reservation), and a write queued behind it lands after it. A write a cancelled import had
queued still lands before any Execute that arrives later. At most TRANSFER_BATCH_BYTES of
blocks are in memory per call, whatever the request's length.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc
import structlog
from prometheus_client import CollectorRegistry, Counter

from common.channel import InternalChannel, call_metadata
from common.credentials import InternalAuth
from common.errors import FailedPrecondition, NotFound, ServiceError
from common.executor_description import layout_from_proto, layout_to_proto
from common.interceptor import client_request_id
from executor_svc.kv_transfer import (
    BlockReceiver,
    ExportRange,
    ImportPlan,
    KVLayout,
    check_import,
    crc32,
    export_block_ids,
)
from executor_svc.runner_api import StepRunner
from executor_svc.step_order import ORDER_WAIT_S, StepOrder
from pagedkv.executor.v1 import executor_pb2 as pb
from pagedkv.executor.v1 import executor_pb2_grpc as pb_grpc

T = TypeVar("T")
log = structlog.get_logger(__name__)
# Blocks read or written per hop to the transfer thread: bounded memory, few hops.
TRANSFER_BATCH_BYTES = 4 * 2**20
MAX_SOURCES = 64  # channels to source executors kept open


class HandOffMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        def counter(name: str, text: str) -> Counter:
            return Counter(name, text, registry=registry)

        self.imported_blocks = counter("pagedkv_executor_kv_imported_blocks",
                                       "KV blocks imported from other executors (ImportKV)")
        self.imported_bytes = counter("pagedkv_executor_kv_imported_bytes",
                                      "Bytes of KV imported from other executors (ImportKV)")
        self.exported_blocks = counter("pagedkv_executor_kv_exported_blocks",
                                       "KV blocks streamed to other executors (ExportKV)")
        self.exported_bytes = counter("pagedkv_executor_kv_exported_bytes",
                                      "Bytes of KV streamed to other executors (ExportKV)")


class SourceError(ServiceError):
    """The source's failure, as the ImportKV caller sees it."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def source_error(address: str, exc: grpc.aio.AioRpcError) -> SourceError:
    """The source's status, passed through with its message prefixed by "source <addr>: ",
    but for those that would say something false of the ImportKV call itself."""
    code, details, prefix = exc.code(), exc.details() or "", f"source {address}: "
    if code == grpc.StatusCode.UNAVAILABLE:
        return SourceError(code, f"{prefix}unreachable ({details})")
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return SourceError(grpc.StatusCode.FAILED_PRECONDITION,
                           f"{prefix}refused this executor's credentials ({code.name}: "
                           f"{details}); give executors the same internal token or CA")
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return SourceError(grpc.StatusCode.FAILED_PRECONDITION,
                           f"{prefix}it does not implement ExportKV ({details})")
    return SourceError(code, prefix + details)


def _ids(seq_id: str) -> dict[str, str]:
    return {"seq_id": seq_id, "request_id": client_request_id(seq_id)}


class KVHandOff:
    def __init__(self, runner: StepRunner, in_worker: Callable[..., asyncio.Future[Any]],
                 order: StepOrder, auth: InternalAuth | None = None,
                 metrics: HandOffMetrics | None = None) -> None:
        """`in_worker` queues a call in the compute thread, behind the Executes queued
        before it; `order` says which Executes have been queued (service.py's own)."""
        self._runner = runner
        self._in_worker = in_worker
        self._order = order
        self._auth = auth or InternalAuth()  # ours: the source asks for the same
        self._metrics = metrics
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="executor-kv")
        # One channel per source, least recently used first.
        self._sources: dict[str, tuple[InternalChannel, pb_grpc.ExecutorServiceStub]] = {}
        self._closing: set[asyncio.Task[None]] = set()

    def _layout(self) -> KVLayout:
        layout = self._runner.info.kv_layout
        if layout is None:
            raise FailedPrecondition("this executor reports no kv_layout: it moves no KV")
        return layout

    def _batch(self, layout: KVLayout) -> int:
        return max(1, TRANSFER_BATCH_BYTES // max(layout.bytes_per_block, 1))

    async def export(self, request: pb.ExportKVRequest) -> AsyncIterator[pb.KVBlock]:
        began = time.perf_counter()
        rid, layout = request.request_id, self._layout()
        state = self._runner.requests.get(rid)
        if state is None:
            raise NotFound(f"request {rid!r} is not held here: export it from the executor "
                           "that computed it, before it is released")
        # NOTE: read here, not in the compute thread (where a step may be running): a request
        # being handed off is parked, so no step changes its table or count meanwhile.
        table, num_computed = tuple(state.block_table), state.num_tokens
        wanted = ExportRange(rid, request.first_block_index, request.num_blocks,
                             request.num_tokens)
        block_ids = export_block_ids(wanted, table, num_computed, layout,
                                     layout_from_proto(request.layout))
        index, size = request.first_block_index, self._batch(layout)
        for start in range(0, len(block_ids), size):
            blocks = await self._in_thread(self._runner.kv_blocks.read,
                                           block_ids[start:start + size])
            for data in blocks:
                yield pb.KVBlock(block_index=index, data=data, crc32=crc32(data))
                index += 1
        num_bytes = len(block_ids) * layout.bytes_per_block
        log.info("kv_export_done", num_blocks=len(block_ids), num_bytes=num_bytes,
                 ms=round((time.perf_counter() - began) * 1e3, 3), **_ids(rid))
        if self._metrics is not None:
            self._metrics.exported_blocks.inc(len(block_ids))
            self._metrics.exported_bytes.inc(num_bytes)

    async def import_kv(self, request: pb.ImportKVRequest,
                        context: grpc.aio.ServicerContext) -> pb.ImportKVResponse:
        began = time.perf_counter()
        layout = self._layout()
        plan = ImportPlan(request.source_address, request.request_id,
                          request.first_block_index, tuple(request.block_ids),
                          request.num_tokens)
        check_import(plan, layout.block_size, self._runner.info.num_blocks)
        previous = request.previous_step_id
        if not await self._order.after(previous):
            raise FailedPrecondition(
                f"previous_step_id {previous}: no such Execute reached this executor within "
                f"{ORDER_WAIT_S:g} s; the reserved blocks may still be written by it, so "
                "nothing is imported")
        try:
            await self._pull(plan, layout, context.time_remaining())
        except grpc.aio.AioRpcError as exc:
            raise source_error(plan.source_address, exc) from None
        elapsed_ms = (time.perf_counter() - began) * 1e3
        num_bytes = len(plan.block_ids) * layout.bytes_per_block
        log.info("kv_import_done", source=plan.source_address, num_blocks=len(plan.block_ids),
                 num_bytes=num_bytes, ms=round(elapsed_ms, 3), **_ids(plan.request_id))
        if self._metrics is not None:
            self._metrics.imported_blocks.inc(len(plan.block_ids))
            self._metrics.imported_bytes.inc(num_bytes)
        return pb.ImportKVResponse(num_blocks=len(plan.block_ids), num_bytes=num_bytes,
                                   elapsed_ms=elapsed_ms)

    async def _pull(self, plan: ImportPlan, layout: KVLayout, timeout: float | None) -> None:
        """Stream the blocks from the source, check each, write them in batches."""
        channel, stub = self._source(plan.source_address)
        call = stub.ExportKV(
            pb.ExportKVRequest(request_id=plan.request_id,
                               first_block_index=plan.first_block_index,
                               num_blocks=len(plan.block_ids), num_tokens=plan.num_tokens,
                               layout=layout_to_proto(layout)),
            metadata=call_metadata(channel.auth_metadata, plan.request_id), timeout=timeout,
        )
        receiver = BlockReceiver(f"source {plan.source_address}", plan.first_block_index,
                                 len(plan.block_ids), layout.bytes_per_block)
        size = self._batch(layout)
        pending: list[bytes] = []
        try:
            async for block in call:
                receiver.check(block.block_index, block.data, block.crc32)
                pending.append(block.data)
                if len(pending) == size:
                    await self._modelled_transfer(len(pending))
                    await self._write(plan, receiver.received - len(pending), pending)
                    pending = []
            receiver.finish()
            await self._modelled_transfer(len(pending))
            await self._write(plan, receiver.received - len(pending), pending)
        finally:
            call.cancel()  # a no-op once it has ended; stops the source's stream otherwise

    async def _modelled_transfer(self, num_blocks: int) -> None:
        delay = self._runner.kv_blocks.transfer_s(num_blocks)
        if delay > 0:
            await asyncio.sleep(delay)

    async def _write(self, plan: ImportPlan, first: int, blocks: list[bytes]) -> None:
        """Write `blocks` into block_ids[first:], in Execute order (the module docstring)."""
        if not blocks:
            return
        ids = plan.block_ids[first:first + len(blocks)]
        await self._in_worker(self._runner.kv_blocks.write, ids, blocks)

    def _source(self, address: str) -> tuple[InternalChannel, pb_grpc.ExecutorServiceStub]:
        """A channel per source, the most recent MAX_SOURCES kept (pod addresses change)."""
        found = self._sources.pop(address, None)
        if found is None:
            channel = InternalChannel(address, self._auth)
            found = (channel, pb_grpc.ExecutorServiceStub(channel.channel))
            if len(self._sources) >= MAX_SOURCES:
                oldest = next(iter(self._sources))
                stale, _ = self._sources.pop(oldest)
                task = asyncio.get_running_loop().create_task(stale.close())
                self._closing.add(task)
                task.add_done_callback(self._closing.discard)
        self._sources[address] = found  # (last: the most recently used)
        return found

    async def close(self) -> None:
        for channel, _ in self._sources.values():
            await channel.close()
        self._sources.clear()
        self._thread.shutdown(wait=False)

    def _in_thread(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """`fn(*args)` in the transfer thread, in the caller's context (its log bindings)."""
        context = contextvars.copy_context()
        return asyncio.get_running_loop().run_in_executor(self._thread, context.run, fn, *args)
