"""One executor's step loop: Step at the allocator, Execute at the executor, then outputs.

Single writer: the loop is the only code that mutates its scheduler, between awaits, so no
lock is needed. Other coroutines (RPC handlers) only append sequences with `submit`, flag
cancellations on the request, and wake the loop.

Failures:
- the executor goes away (UNAVAILABLE, DEADLINE_EXCEEDED): every sequence of this engine is
  aborted at the allocator and handed to `on_lost` (the router re-queues it elsewhere, for
  recompute, or fails it with UNAVAILABLE); the engine reconnects in the background and
  re-registers its pool (a restarted executor resets it);
- the executor rejects a step: that step's sequences fail, the engine keeps serving;
- the allocator says the pool or the lease is stale: the pool is re-registered and every
  sequence is readmitted (recompute);
- the allocator is unreachable: retried, then every sequence fails with UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import grpc
import structlog

from common.errors import ServiceError, Unavailable
from gateway.allocator_client import AllocatorClient, PoolSpec
from gateway.batch import Batch, ScheduledStep
from gateway.executor_client import ExecutorClient, ExecutorDescription
from gateway.lease import Lease
from gateway.output import OutputProcessor
from gateway.request_state import CompletionDelta, Sequence
from gateway.scheduler import Scheduler
from gateway.step import StepOutcome
from gateway.step_stats import StepStats

log = structlog.get_logger(__name__)

LOST_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
STALE_POOL_CODES = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND)
ALLOCATOR_RETRY_S = 10.0
RECONNECT_INTERVAL_S = 1.0


@dataclass(slots=True, eq=False)
class Engine:
    pool_id: str
    executor: ExecutorClient
    allocator: AllocatorClient
    lease: Lease
    scheduler: Scheduler
    output: OutputProcessor
    description: ExecutorDescription
    enable_prefix_caching: bool
    on_lost: Callable[[list[Sequence]], None]
    epoch: int = 0
    healthy: bool = True
    lease_generation: int = 0
    has_cancellations: bool = False
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    stats: StepStats = field(default_factory=StepStats)
    allocator_down_since: float | None = None
    tasks: set[asyncio.Task[None]] = field(default_factory=set)

    # ---- called by other coroutines -----------------------------------------------------

    def submit(self, seq: Sequence, front: bool = False) -> None:
        if seq.detokenizer is None and not seq.is_prefill_parent:
            self.output.start(seq)
        self.scheduler.add(seq, front=front)
        self.wakeup.set()

    def cancel(self) -> None:
        """Some request was cancelled: the loop aborts its sequences before the next step."""
        self.has_cancellations = True
        self.wakeup.set()

    @property
    def busy(self) -> bool:
        return self._has_work()

    @property
    def load(self) -> int:
        return self.scheduler.num_unfinished

    async def register(self) -> None:
        self.epoch = await self.allocator.register_pool(
            PoolSpec(
                pool_id=self.pool_id,
                num_blocks=self.description.num_blocks,
                block_size=self.description.block_size,
                num_cpu_blocks=self.description.num_cpu_blocks,
                model_fingerprint=self.description.model_fingerprint,
                executor_instance_id=self.description.instance_id,
                enable_prefix_caching=self.enable_prefix_caching,
            )
        )
        self.lease_generation = self.lease.generation
        log.info("pool_registered", pool_id=self.pool_id, epoch=self.epoch,
                 num_blocks=self.description.num_blocks)

    # ---- the loop -----------------------------------------------------------------------

    async def run(self) -> None:
        while True:
            if not self.healthy:
                await self._reconnect()
                continue
            if not self._has_work():
                self.wakeup.clear()
                await self.wakeup.wait()
                continue
            try:
                progressed = await self.step()
            except Exception:  # noqa: BLE001 - a bug must not kill the loop and hang clients
                log.exception("engine_step_failed", pool_id=self.pool_id)
                self._fail_all(Unavailable(f"executor {self.pool_id}: internal gateway error"))
                progressed = True
            # Yield to the RPC handlers; back off a little when nothing could be scheduled.
            await asyncio.sleep(0 if progressed else 0.005)

    async def step(self) -> bool:
        """One scheduling step; False when nothing could run (all deferred)."""
        if self.lease.generation != self.lease_generation:
            self._readmit_all("lease_renewed")
            self.lease_generation = self.lease.generation
        if self.has_cancellations:
            self._apply_cancellations()
        started = time.perf_counter()
        plan = self.scheduler.schedule()
        if plan is None:
            await self._flush_releases()
            return True
        if not plan.call.items:
            await self._flush_housekeeping(plan)
            return True
        outcome = await self._allocator_step(plan)
        if outcome is None:
            return False
        t_alloc = time.perf_counter()
        batch = self.scheduler.apply_outcome(plan, outcome)
        if batch.call.is_empty():
            await self._flush_releases()
            return False
        t_sched = time.perf_counter()
        try:
            result = await self.executor.execute(batch.call)
        except grpc.aio.AioRpcError as exc:
            self._on_execute_error(batch, exc)
            return True
        t_exec = time.perf_counter()
        for seq, token in self.scheduler.apply_result(batch, result):
            self._emit(seq, token)
        for parent in self.scheduler.ready_to_fork(batch):
            await self._fork(parent)
        done = time.perf_counter()
        self.stats.record(
            total_ms=(done - started) * 1e3,
            allocator_ms=(t_alloc - started) * 1e3,
            execute_ms=(t_exec - t_sched) * 1e3,
            compute_ms=result.compute_ms,
            num_seqs=len(batch.scheduled),
        )
        if self.stats.should_report():
            log.info("engine_step_stats", pool_id=self.pool_id, **self.stats.summary())
        return True

    # ---- pieces of a step ---------------------------------------------------------------

    def _has_work(self) -> bool:
        pending = self.scheduler.pending
        return (
            self.scheduler.has_work() or pending.has_allocator_work()
            or bool(pending.release_ids) or self.has_cancellations
        )

    def _emit(self, seq: Sequence, token: int) -> None:
        delta = self.output.process(seq, token)
        if not seq.request.cancelled:
            seq.request.emit(delta)
        if delta.finish_reason is not None:
            self.scheduler.finish(seq)

    async def _allocator_step(self, plan: ScheduledStep) -> StepOutcome | None:
        try:
            outcome = await self.allocator.step(self.pool_id, self.epoch, self.lease.lease_id,
                                                plan.call)
        except grpc.aio.AioRpcError as exc:
            await self._on_allocator_error(plan, exc)
            return None
        self.allocator_down_since = None
        return outcome

    async def _on_allocator_error(self, plan: ScheduledStep, exc: grpc.aio.AioRpcError) -> None:
        code = exc.code()
        log.warning("allocator_step_failed", pool_id=self.pool_id, code=code.name,
                    details=exc.details())
        if code in STALE_POOL_CODES:
            await self._reregister()
            return
        self._restore_housekeeping(plan)
        if code in LOST_CODES:
            now = time.monotonic()
            self.allocator_down_since = self.allocator_down_since or now
            if now - self.allocator_down_since < ALLOCATOR_RETRY_S:
                await asyncio.sleep(0.2)
                return
        error = Unavailable(f"allocator step failed ({code.name}): {exc.details()}")
        self._fail_all(error)

    def _restore_housekeeping(self, plan: ScheduledStep) -> None:
        pending = self.scheduler.pending
        for request_id, num_computed in plan.executed.items():
            pending.commits.setdefault(request_id, num_computed)
        for commit in plan.call.commits:
            pending.commits.setdefault(commit.request_id, commit.num_computed_tokens)
        pending.free_ids[:0] = plan.call.free_request_ids
        pending.abort_ids[:0] = plan.call.abort_request_ids

    def _on_execute_error(self, batch: Batch, exc: grpc.aio.AioRpcError) -> None:
        code = exc.code()
        log.warning("execute_failed", pool_id=self.pool_id, code=code.name,
                    details=exc.details(), num_seqs=len(batch.scheduled))
        if code in LOST_CODES:
            self._lose_executor()
            return
        # The executor refused this step: nothing it wrote may be cached (the commit rule).
        error = Unavailable(f"executor {self.pool_id} rejected a step ({code.name})")
        for seq, _ in batch.scheduled:
            self._fail(seq, error)

    def _lose_executor(self) -> None:
        self.healthy = False
        known = [s.seq_id for s in self.scheduler.sequences() if s.known_to_allocator]
        known += self.scheduler.pending.free_ids + self.scheduler.pending.abort_ids
        seqs = self.scheduler.evict_all()
        log.warning("executor_lost", pool_id=self.pool_id, num_requeued=len(seqs))
        if known:
            # Nothing the lost step wrote may be cached: abort, best effort (a restarted
            # executor resets the whole pool anyway).
            self._background(self._abort_quietly(known))
        self.on_lost([s for s in seqs if not s.request.cancelled])

    async def _abort_quietly(self, request_ids: list[str]) -> None:
        try:
            await self.allocator.abort(self.pool_id, self.epoch, request_ids)
        except grpc.aio.AioRpcError as exc:
            log.info("abort_after_loss_failed", pool_id=self.pool_id, code=exc.code().name)

    def _background(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _reconnect(self) -> None:
        await asyncio.sleep(RECONNECT_INTERVAL_S)
        try:
            self.description = await self.executor.describe(timeout=2.0)
            await self.register()
        except grpc.aio.AioRpcError:
            return
        self.healthy = True
        log.info("executor_reconnected", pool_id=self.pool_id)

    async def _reregister(self) -> None:
        try:
            self.description = await self.executor.describe(timeout=5.0)
            await self.register()
        except grpc.aio.AioRpcError as exc:
            log.warning("pool_reregister_failed", pool_id=self.pool_id, code=exc.code().name)
            self._lose_executor()
            return
        self._readmit_all("pool_reset")

    def _readmit_all(self, why: str) -> None:
        """The allocator forgot our requests: release them at the executor, start over."""
        releases = [s.seq_id for s in self.scheduler.sequences() if s.known_to_executor]
        seqs = self.scheduler.evict_all()
        self.scheduler.pending.release_ids.extend(releases)
        log.warning("requests_readmitted", pool_id=self.pool_id, why=why, num=len(seqs))
        for seq in sorted(seqs, key=lambda s: (s.request.arrival_time, s.index)):
            if not seq.request.cancelled:
                self.scheduler.add(seq)

    async def _fork(self, parent: Sequence) -> None:
        request = parent.request
        children = [
            Sequence(seq_id=f"{request.request_id}-{i}", request=request, index=i, seed_offset=i)
            for i in range(request.sampling.n)
        ]
        try:
            tables = await self.allocator.fork(
                self.pool_id, self.epoch, parent.seq_id, [c.seq_id for c in children],
                request.request_id,
            )
        except grpc.aio.AioRpcError as exc:
            log.warning("fork_failed", code=exc.code().name, details=exc.details())
            self._fail(parent, Unavailable(f"fork failed ({exc.code().name})"))
            return
        for child in children:
            self.output.start(child)
        self.scheduler.fork(parent, children, tables)

    def _apply_cancellations(self) -> None:
        self.has_cancellations = False
        for seq in self.scheduler.sequences():
            if seq.request.cancelled:
                self.scheduler.abort(seq)

    def _fail(self, seq: Sequence, error: ServiceError) -> None:
        if not seq.request.cancelled:
            seq.request.emit(CompletionDelta(index=seq.index, error=error))
        self.scheduler.abort(seq)

    def _fail_all(self, error: ServiceError) -> None:
        for seq in self.scheduler.sequences():
            if not seq.is_finished:
                self._fail(seq, error)

    async def _flush_housekeeping(self, plan: ScheduledStep) -> None:
        """An idle engine: frees, commits and aborts go out without a step."""
        call = plan.call
        try:
            if call.commits or call.free_request_ids:
                await self.allocator.free(self.pool_id, self.epoch, call.commits,
                                          call.free_request_ids)
            if call.abort_request_ids:
                await self.allocator.abort(self.pool_id, self.epoch, call.abort_request_ids)
        except grpc.aio.AioRpcError as exc:
            log.warning("allocator_free_failed", pool_id=self.pool_id, code=exc.code().name)
            if exc.code() in STALE_POOL_CODES:
                await self._reregister()
            else:
                self._restore_housekeeping(plan)
                await asyncio.sleep(0.2)
        await self._flush_releases()

    async def _flush_releases(self) -> None:
        ids = self.scheduler.pending.release_ids
        if not ids:
            return
        try:
            await self.executor.release(list(ids))
            ids.clear()
        except grpc.aio.AioRpcError as exc:
            if exc.code() in LOST_CODES:
                ids.clear()
                self._lose_executor()
