"""What an engine does when a step fails (called from its loop: still a single writer).

- the executor goes away (UNAVAILABLE, DEADLINE_EXCEEDED): every sequence of the engine is
  aborted at the allocator and handed to `on_lost` (the router re-queues it elsewhere, for
  recompute, or fails it with UNAVAILABLE); the engine reconnects in the background and
  re-registers its pool (a restarted executor resets it);
- the executor rejects a step: that step's sequences fail, the engine keeps serving;
- the allocator says the pool or the lease is stale: the pool is re-registered and every
  sequence is readmitted (recompute);
- the allocator is unreachable: retried for a while, then every sequence fails with
  UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import grpc
import structlog

from common.errors import Unavailable
from gateway.batch import Batch, ScheduledStep

if TYPE_CHECKING:
    from gateway.engine import Engine

log = structlog.get_logger(__name__)

LOST_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
STALE_POOL_CODES = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND)
ALLOCATOR_RETRY_S = 10.0
RECONNECT_INTERVAL_S = 1.0


async def allocator_step_failed(
engine: Engine, plan: ScheduledStep, exc: grpc.aio.AioRpcError
) -> None:
    code = exc.code()
    log.warning("allocator_step_failed", pool_id=engine.pool_id, code=code.name,
                details=exc.details())
    if code in STALE_POOL_CODES:
        await reregister(engine)
        return
    restore_housekeeping(engine, plan)
    if code in LOST_CODES:
        now = time.monotonic()
        engine.allocator_down_since = engine.allocator_down_since or now
        if now - engine.allocator_down_since < ALLOCATOR_RETRY_S:
            await asyncio.sleep(0.2)
            return
    error = Unavailable(f"allocator step failed ({code.name}): {exc.details()}")
    engine.fail_all(error)


def restore_housekeeping(engine: Engine, plan: ScheduledStep) -> None:
    """The Step failed: its commits, frees and aborts ride on the next call."""
    pending = engine.scheduler.pending
    for request_id, num_computed in plan.executed.items():
        pending.commits.setdefault(request_id, num_computed)
    for commit in plan.call.commits:
        pending.commits.setdefault(commit.request_id, commit.num_computed_tokens)
    pending.free_ids[:0] = plan.call.free_request_ids
    pending.abort_ids[:0] = plan.call.abort_request_ids


def execute_failed(engine: Engine, batch: Batch, exc: grpc.aio.AioRpcError) -> None:
    code = exc.code()
    log.warning("execute_failed", pool_id=engine.pool_id, code=code.name,
                details=exc.details(), num_seqs=len(batch.scheduled))
    if code in LOST_CODES:
        lose_executor(engine)
        return
    # The executor refused this step: nothing it wrote may be cached (the commit rule).
    # Its releases may not have been applied: send them again (releasing is idempotent).
    engine.scheduler.pending.release_ids.extend(batch.call.release_request_ids)
    error = Unavailable(f"executor {engine.pool_id} rejected a step ({code.name})")
    for seq, _ in batch.scheduled:
        engine.fail(seq, error)


def lose_executor(engine: Engine) -> None:
    """The executor is gone: everything it ran goes elsewhere; reconnect in the background."""
    engine.healthy = False
    known = [s.seq_id for s in engine.scheduler.sequences() if s.known_to_allocator]
    known += engine.scheduler.pending.free_ids + engine.scheduler.pending.abort_ids
    seqs = engine.scheduler.evict_all()
    log.warning("executor_lost", pool_id=engine.pool_id, num_requeued=len(seqs))
    if known:
        # Nothing the lost step wrote may be cached: abort, best effort (a restarted
        # executor resets the whole pool anyway).
        engine.spawn(_abort_quietly(engine, known))
    engine.on_lost([s for s in seqs if not s.request.cancelled])


async def _abort_quietly(engine: Engine, request_ids: list[str]) -> None:
    try:
        await engine.link.abort(request_ids)
    except grpc.aio.AioRpcError as exc:
        log.info("abort_after_loss_failed", pool_id=engine.pool_id, code=exc.code().name)


async def reconnect(engine: Engine) -> None:
    """A lost executor: try again every second; a restarted one resets its pool."""
    await asyncio.sleep(RECONNECT_INTERVAL_S)
    try:
        await engine.link.refresh(timeout_s=2.0)
    except grpc.aio.AioRpcError:
        return
    engine.healthy = True
    log.info("executor_reconnected", pool_id=engine.pool_id)


async def reregister(engine: Engine) -> None:
    """The allocator no longer knows our pool or epoch: register again, readmit all."""
    try:
        await engine.link.lease.renew_if_lost()
        await engine.link.refresh(timeout_s=5.0)
    except grpc.aio.AioRpcError as exc:
        log.warning("pool_reregister_failed", pool_id=engine.pool_id, code=exc.code().name)
        lose_executor(engine)
        return
    readmit_all(engine, "pool_reset")


def readmit_all(engine: Engine, why: str) -> None:
    """The allocator forgot our requests: start them over (the executor releases them)."""
    seqs = engine.scheduler.evict_all()
    log.warning("requests_readmitted", pool_id=engine.pool_id, why=why, num=len(seqs))
    for seq in sorted(seqs, key=lambda s: (s.request.arrival_time, s.index)):
        if not seq.request.cancelled:
            engine.scheduler.add(seq)
