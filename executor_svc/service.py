"""The gRPC servicer: decode the proto, call the runner, encode the answer.

Steps (and Releases) run in the executor's compute thread (compute_thread.py: the thread that
loaded the model), in the order they are queued, so the event loop keeps answering health
checks and Describe while the model computes. Execute calls waiting together, from any
callers (several gateways may schedule onto one executor), merge into one forward pass, and
each caller gets its own rows (merged_calls.py). A step that arrives while another computes
(the gateway launches ahead) is decoded meanwhile and waits in the queue: the compute thread
takes it the moment the turn before ends, with no hop through the event loop. A step naming a
`previous_step_id` not taken yet waits for it first, and is refused if it never comes
(step_order.py); one taken but still waiting runs in the forward after it. Domain exceptions
raised by the runner reach common.interceptor, which maps them to their status codes.

A request's lifecycle is logged here, each line naming it (`seq_id` on the wire, the
client's `request_id`: common.interceptor.client_request_id): started (its first step),
released, idle-released. Each forward records its metrics (StepMetrics) from the results.

ImportKV and ExportKV (KV hand-off between executors) are kv_handoff.py's: they run beside
the steps, not in the compute thread's queue.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TypeVar

import grpc
import structlog
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from common.credentials import InternalAuth
from common.errors import FailedPrecondition, InvalidArgument, ServiceError
from common.interceptor import client_request_id
from common.server import Registration
from executor_svc import convert
from executor_svc.compute_thread import ComputeQueue, compute_thread
from executor_svc.kv_handoff import HandOffMetrics, KVHandOff
from executor_svc.runner_api import StepRunner
from executor_svc.step import SequenceWork, StepRequest, StepResult
from executor_svc.step_order import ORDER_WAIT_S, StepOrder
from pagedkv.executor.v1 import executor_pb2 as pb
from pagedkv.executor.v1 import executor_pb2_grpc as pb_grpc

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ExecutorService"].full_name
T = TypeVar("T")
log = structlog.get_logger(__name__)

# From 1 ms (a small decode on GPU) to 10 s (a long prefill on CPU).
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5,
                0.75, 1.0, 2.5, 5.0, 10.0)
SEQ_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
CALL_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64)
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class StepMetrics:
    """What a step records: about 6 us (six observations, three increments) per forward."""

    def __init__(self, registry: CollectorRegistry, runner: StepRunner) -> None:
        def histogram(name: str, text: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(name, text, registry=registry, buckets=buckets)

        self.forward = histogram("pagedkv_executor_forward_seconds",
                                 "A step's forward pass (with its releases, copies, swaps)",
                                 STEP_BUCKETS)
        self.sample = histogram("pagedkv_executor_sample_seconds", "A step's sampling",
                                STEP_BUCKETS)
        self.step = histogram("pagedkv_executor_step_seconds",
                              "A step's compute: forward pass and sampling", STEP_BUCKETS)
        self.sequences = histogram("pagedkv_executor_batch_sequences",
                                   "Sequences in a step", SEQ_BUCKETS)
        self.tokens = histogram("pagedkv_executor_batch_tokens",
                                "Tokens computed in a step", TOKEN_BUCKETS)
        self.calls = histogram("pagedkv_executor_batch_calls",
                               "Execute calls (from any callers) merged into a step's forward",
                               CALL_BUCKETS)
        self.steps = Counter("pagedkv_executor_steps", "Execute steps run", registry=registry)
        self.computed = Counter("pagedkv_executor_tokens", "Tokens computed (prompt and "
                                "decode)", registry=registry)
        self.sampled = Counter("pagedkv_executor_sampled_tokens", "Tokens sampled",
                               registry=registry)
        self.started = Counter("pagedkv_executor_requests_started",
                               "Requests whose first step ran here", registry=registry)
        released = Counter("pagedkv_executor_requests_released",
                           "Requests dropped: released by the caller, or idle too long",
                           ["reason"], registry=registry)
        self.released, self.idle_released = released.labels("released"), released.labels("idle")
        self.handoff = HandOffMetrics(registry)
        registry.register(_RunnerCollector(runner))

    def observe(self, steps: Sequence[StepRequest],
                results: Sequence[StepResult | ServiceError]) -> None:
        """One turn of the compute thread: every call that ran counts as a step; their
        merged forward, if they had sequences, is one batch."""
        ran = [(s, r) for s, r in zip(steps, results, strict=True)
               if not isinstance(r, ServiceError)]
        self.steps.inc(len(ran))
        batch = [(s, r) for s, r in ran if s.seqs]
        if not batch:  # releases or copies only: no batch
            return
        timings = batch[0][1].timings  # the merged forward's, the same in every result
        num_tokens = sum(r.num_tokens for _, r in batch)
        self.forward.observe(timings.forward_ms / 1000)
        self.sample.observe(timings.sample_ms / 1000)
        self.step.observe(timings.total_ms / 1000)
        self.sequences.observe(sum(len(s.seqs) for s, _ in batch))
        self.tokens.observe(num_tokens)
        self.calls.observe(len(batch))
        self.computed.inc(num_tokens)
        self.sampled.inc(sum(len(r.tokens) for _, r in batch))


class _RunnerCollector(Collector):
    """Read at scrape time, in the metrics thread: lengths and constants only."""

    def __init__(self, runner: StepRunner) -> None:
        self.runner = runner

    def collect(self) -> Iterator[Metric]:
        info = self.runner.info
        yield GaugeMetricFamily("pagedkv_executor_requests", "Requests held (KV state kept)",
                                value=len(self.runner.requests))
        yield GaugeMetricFamily("pagedkv_executor_kv_blocks", "KV blocks on the device",
                                value=info.num_blocks)
        yield GaugeMetricFamily("pagedkv_executor_cpu_kv_blocks",
                                "KV blocks on CPU: swap space and the prefix cache's CPU tier",
                                value=info.num_cpu_blocks)
        yield GaugeMetricFamily("pagedkv_executor_cpu_cache_kv_blocks",
                                "Of the CPU KV blocks, those for the prefix cache's CPU tier",
                                value=info.num_cpu_cache_blocks)
        labels = {"model": info.model_name, "backend": info.backend, "device": info.device,
                  "dtype": info.dtype, "instance_id": info.instance_id}
        metric = GaugeMetricFamily("pagedkv_executor_info", "This executor (value 1)",
                                   labels=list(labels))
        metric.add_metric(list(labels.values()), 1)
        yield metric


@dataclass(slots=True)
class _Executed:
    result: StepResult
    released: list[str]  # held requests the step released


def _ids(seq_id: str) -> dict[str, str]:
    return {"seq_id": seq_id, "request_id": client_request_id(seq_id)}


class ExecutorServicer(pb_grpc.ExecutorServiceServicer):
    def __init__(self, runner: StepRunner, worker: ThreadPoolExecutor | None = None,
                 metrics: StepMetrics | None = None, pool_name: str = "",
                 auth: InternalAuth | None = None) -> None:
        """`auth`: the credentials this executor serves with, which it also presents to
        the executors it imports KV from."""
        self._runner = runner
        self._pool_name = pool_name
        # One thread: the runner is not thread-safe, and its queue keeps the order.
        info = runner.info
        self.queue = ComputeQueue(worker or compute_thread(), self._execute_merged,
                                   info.max_num_seqs, info.max_num_batched_tokens)
        self._order = StepOrder()
        self._metrics = metrics
        self._handoff = KVHandOff(runner, self.queue.run, self._order, auth,
                                  metrics.handoff if metrics else None)

    async def close(self) -> None:
        await self._handoff.close()

    async def Describe(  # noqa: N802 - gRPC method name
        self, request: pb.DescribeRequest, context: grpc.aio.ServicerContext
    ) -> pb.DescribeResponse:
        return replace(self._runner.info, pool_name=self._pool_name).to_proto()

    async def Execute(  # noqa: N802
        self, request: pb.ExecuteRequest, context: grpc.aio.ServicerContext
    ) -> pb.ExecuteResponse:
        try:
            step = convert.step_from_proto(request)
            previous = request.previous_step_id
            if previous and previous == request.step_id:
                raise InvalidArgument(f"previous_step_id {previous} names this call itself")
            if not await self._order.after(previous):
                raise FailedPrecondition(
                    f"previous_step_id {previous}: no such call reached this executor within "
                    f"{ORDER_WAIT_S:g} s; this call builds on it, so it does not run"
                )
            executed = self.queue.execute(step, request.step_id, previous)
        finally:
            self._order.take(request.step_id)  # queued, refused or given up: the next goes on
        try:
            done: _Executed = await executed
        except asyncio.CancelledError:
            # Its caller went away: a call whose turn has not come is dropped; one that has
            # runs to its end with the others merged with it.
            self.queue.withdraw(executed)
            raise
        num_compact = len(request.decode_request_ids)
        self._log_step(request.step_id, step, num_compact, done)
        return convert.result_to_proto(done.result, num_compact)

    async def Release(  # noqa: N802
        self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReleaseResponse:
        released = await self.queue.run(self._release, tuple(request.request_ids))
        self._log_released(released)
        return pb.ReleaseResponse(num_released=len(released))

    async def LoadLoraAdapter(  # noqa: N802
        self, request: pb.LoadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.LoraAdapter:
        # Files are read beside the steps; the slot is written in the compute thread, between
        # steps, never under a forward reading it.
        adapter = await asyncio.to_thread(self._runner.read_lora_adapter, request.name,
                                          request.path)
        loaded = await self.queue.run(self._runner.install_lora_adapter, adapter)
        return loaded.to_proto()

    async def UnloadLoraAdapter(  # noqa: N802
        self, request: pb.UnloadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.UnloadLoraAdapterResponse:
        await self.queue.run(self._runner.unload_lora_adapter, request.name)
        return pb.UnloadLoraAdapterResponse()

    async def ImportKV(  # noqa: N802
        self, request: pb.ImportKVRequest, context: grpc.aio.ServicerContext
    ) -> pb.ImportKVResponse:
        return await self._handoff.import_kv(request, context)

    async def ExportKV(  # noqa: N802
        self, request: pb.ExportKVRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.KVBlock]:
        async for block in self._handoff.export(request):
            yield block

    # In the compute thread: the runner's state is read there, between turns.
    def _execute_merged(self, steps: list[StepRequest]) -> list[_Executed | ServiceError]:
        runner = self._runner
        held = runner.requests
        released = [[r for r in s.release_request_ids if r in held] for s in steps]
        # NOTE: the runner drops idle requests itself, at most every idle_release_s / 10, and
        # says how many, not which: the held ids are compared only on a turn that checks.
        checks_idle = runner.idle_release_s and runner.clock() >= runner.next_idle_check
        before = set(held) if checks_idle else None
        try:
            results = runner.execute_merged(steps)
        finally:  # the idle ones are gone even when the step is then refused
            if before is not None:
                self._log_idle(before - held.keys() - {r for rs in released for r in rs})
        if self._metrics is not None:
            self._metrics.observe(steps, results)
        return [r if isinstance(r, ServiceError) else _Executed(r, rel)
                for r, rel in zip(results, released, strict=True)]

    def _release(self, request_ids: tuple[str, ...]) -> list[str]:
        held = [r for r in dict.fromkeys(request_ids) if r in self._runner.requests]
        self._runner.release(request_ids)
        return held

    # Logs and counts.
    def _log_step(self, step_id: int, step: StepRequest, num_compact: int,
                  done: _Executed) -> None:
        self._log_released(done.released)
        # First steps carry sampling params; compact decodes never do.
        started = [w for w in step.seqs[num_compact:] if w.sampling is not None]
        self._log_started(started)
        if step.seqs and log.is_enabled_for(logging.DEBUG):  # one line a step, not a request
            log.debug("batch_executed", step_id=step_id, num_tokens=done.result.num_tokens,
                      seq_ids=[w.request_id for w in step.seqs])

    def _log_started(self, started: list[SequenceWork]) -> None:
        for work in started:
            log.info("request_started", start_position=work.start_position,
                     num_tokens=len(work.token_ids), **_ids(work.request_id))
        if started and self._metrics is not None:
            self._metrics.started.inc(len(started))

    def _log_released(self, released: list[str]) -> None:
        for seq_id in released:
            log.info("request_released", **_ids(seq_id))
        if released and self._metrics is not None:
            self._metrics.released.inc(len(released))

    def _log_idle(self, idle: set[str]) -> None:
        for seq_id in sorted(idle):
            log.info("request_idle_released", **_ids(seq_id))
        if idle and self._metrics is not None:
            self._metrics.idle_released.inc(len(idle))

def registration(runner: StepRunner, worker: ThreadPoolExecutor | None = None,
                 metrics: StepMetrics | None = None, pool_name: str = "",
                 auth: InternalAuth | None = None) -> Registration:
    """`worker`: the thread that built `runner` (compute_thread.py); None: a new one.
    `metrics`: where steps are recorded (None: nowhere). `pool_name`: what Describe reports.
    `auth`: the credentials it serves with (ImportKV calls its sources with them)."""
    servicer = ExecutorServicer(runner, worker, metrics, pool_name, auth)
    return (servicer, SERVICE_NAME)
