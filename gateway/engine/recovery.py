"""What an engine does when a step fails (called from its loop: still a single writer).

The failures are call_failures' outcomes, as the clients report them.

- the executor goes away (Lost: unreachable, or past `--execute-timeout-s`):
  every sequence of the engine is handed to `on_lost` (the router re-queues it elsewhere,
  for recompute, or fails it with UNAVAILABLE); what the allocator holds for them is aborted
  (orphans.py); the engine reconnects in the background and re-registers its pool (a
  restarted executor resets it);
- the executor rejects a step: that step's sequences fail, and the ones its Step swapped out
  (their KV never reached the CPU); its step is never confirmed executed; the engine keeps
  serving. A step launched ahead on it (use_sampled_token) is rejected too when it names
  those sequences; its other sequences start over (recompute), and the step after it waits
  for it to land;
- the allocator does not know the pool, the lease or a request, or the pool moved on
  (Unknown, Stale): the pool is re-registered and every sequence is readmitted (recompute);
- a Step cut off (Lost: unreachable, or past `--allocator-timeout-s`): whether
  the allocator applied it is unknown, so it is never resent: what the allocator may hold is
  aborted and every sequence is readmitted (recompute); while the allocator stays away
  longer than `--allocator-retry-s` (10 s), sequences fail with UNAVAILABLE;
- a bug interrupts a step: its sequences fail with INTERNAL; nothing is left held at the
  allocator or the executor.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import structlog

from common.errors import Internal, Unavailable
from gateway.clients.call_failures import CallFailed, Lost, Stale, Unknown
from gateway.core.batch import Batch, ScheduledStep
from gateway.core.request_state import Sequence, priority
from gateway.engine.state import EngineState

log = structlog.get_logger(__name__)

# The allocator no longer knows what we hold there: register again, readmit everything.
STALE_POOL = (Unknown, Stale)
RETRY_PAUSE_S = 0.2
RECONNECT_INTERVAL_S = 1.0
# An idle engine asks its executor this often whether it is still there (and the same one).
IDLE_PROBE_S = 2.0
IDLE_PROBE_TIMEOUT_S = 5.0


class GatewayError(Internal):
    """A bug in the gateway interrupted the request (its traceback is in the log)."""


@dataclass(slots=True, eq=False)
class Recovery:
    """One engine's recovery, and its own record of the allocator's outage: since when it has
    not answered (None: it answers)."""

    engine: EngineState
    down_since: float | None = None

    def allocator_answered(self) -> None:
        self.down_since = None

    async def allocator_step_failed(self, plan: ScheduledStep, exc: CallFailed) -> None:
        log.warning("allocator_step_failed", pool_id=self.engine.pool_id, code=exc.status,
                    details=exc.details)
        if isinstance(exc, STALE_POOL):
            await self.reregister(plan)
            return
        if isinstance(exc, Lost):
            # NOTE: Step is not idempotent (frees, admissions, appended tokens): never resent.
            self.engine.orphans.note_held(self.engine.scheduler, plan)
            self.readmit_all("allocator_step_unknown")
            await self.allocator_unreachable(exc)
            return
        # Rejected: the allocator validates a whole call before it changes anything.
        self.restore_housekeeping(plan)
        self.engine.fail_all(Unavailable(f"allocator step failed ({exc.status}): {exc.details}"))

    async def allocator_unreachable(self, exc: CallFailed) -> None:
        """Pause before the next try; past the engine's allocator_retry_s, what waits fails with
        UNAVAILABLE."""
        now = time.monotonic()
        self.down_since = self.down_since or now
        if now - self.down_since >= self.engine.allocator_retry_s:
            self.engine.fail_all(Unavailable(
                f"the allocator has not answered for {now - self.down_since:.0f} s "
                f"({exc.status}): check that it is running and reachable"
            ))
            # What arrives from now on gets a full wait of its own, not the end of this one.
            self.down_since = now
        await asyncio.sleep(RETRY_PAUSE_S)

    async def abort_orphans(self) -> bool:
        """Before the next Step: True once the allocator holds nothing we lost track of."""
        exc = await self.engine.orphans.abort(self.engine.link)
        if exc is None:
            self.down_since = None
            return True
        log.warning("orphan_abort_failed", pool_id=self.engine.pool_id, code=exc.status,
                    num=len(self.engine.orphans))
        await self.allocator_unreachable(exc)
        return False

    def restore_housekeeping(self, plan: ScheduledStep) -> None:
        """The call was refused, so nothing was applied: its commits, frees and aborts ride on
        the next one, and so does its commit_through_step_id (idempotent)."""
        pending = self.engine.scheduler.pending
        for commit in plan.call.commits:
            pending.commits.setdefault(commit.request_id, commit.num_computed_tokens)
        pending.free_request_ids[:0] = plan.call.free_request_ids
        pending.abort_request_ids[:0] = plan.call.abort_request_ids
        pending.sent_through = 0

    def execute_failed(
        self, batch: Batch, exc: CallFailed, after_failure: bool = False
    ) -> None:
        """`after_failure`: the batch was launched ahead on one that failed before it."""
        log.warning("execute_failed", pool_id=self.engine.pool_id, code=exc.status,
                    details=exc.details, num_seqs=len(batch.scheduled))
        # The releases may not have been applied: send them again (releasing is idempotent).
        self.engine.scheduler.pending.release_ids.extend(batch.call.release_request_ids)
        if isinstance(exc, Lost):
            self.lose_executor()
            return
        # The executor refused this step: nothing it wrote may be cached (the commit rule). Its
        # step is never marked executed; its sequences fail (aborted: a later step committed
        # through it skips them), and so do the ones it swapped out: their KV never reached the CPU.
        error = Unavailable(f"executor {self.engine.pool_id} rejected a step ({exc.status})")
        recomputed: set[Sequence] = set()
        if after_failure:
            # Most likely rejected for naming the failed batch's sequences (failed already):
            # the others start over, once (the allocator aborts what it holds for them), the
            # ones its Step swapped out too (their KV never reached the CPU).
            recomputed = {s for s in [*(s for s, _ in batch.scheduled), *batch.swapped_out]
                          if not s.is_finished}
            for seq in sorted(recomputed, key=priority, reverse=True):
                self.engine.scheduler.recompute(seq)
            log.warning("requests_recomputed", pool_id=self.engine.pool_id, num=len(recomputed),
                        why="rejected_after_failure")
        for seq in [*(s for s, _ in batch.scheduled), *batch.swapped_out]:
            if not seq.is_finished and seq not in recomputed:
                self.engine.fail(seq, error)  # (depth 2: one ended by the outputs taken meanwhile)

    def lose_executor(self) -> None:
        """The executor is gone: everything it ran goes elsewhere; reconnect in the background."""
        self.engine.abandon_in_flight()  # a batch launched ahead of the failed one is not awaited
        self.engine.healthy = False
        self.engine.deliver()  # tokens computed here reach their streams before any from elsewhere
        self.engine.orphans.note_held(self.engine.scheduler)
        seqs = self.engine.scheduler.evict_all()
        log.warning("executor_lost", pool_id=self.engine.pool_id, num_requeued=len(seqs))
        self.engine.on_lost([s for s in seqs if not s.request.cancelled])

    def step_crashed(self, plan: ScheduledStep | None, batch: Batch | None) -> None:
        """A bug interrupted a step anywhere: what the allocator and the executor hold is
        unknown. Every sequence fails; all the allocator may hold for them is aborted, all the
        executor may hold is released (both before anything else is sent)."""
        self.engine.orphans.note_held(self.engine.scheduler, plan)
        if batch is not None:
            self.engine.scheduler.pending.release_ids.extend(batch.call.release_request_ids)
        error = GatewayError(
            f"executor {self.engine.pool_id}: internal gateway error (see its log)")
        for seq in self.engine.scheduler.evict_all():
            self.engine.fail(seq, error)

    async def probe_idle(self) -> None:
        """An idle engine's check of its executor: one gone, hung or restarted is lost now, so
        that routing and the gateway's health say so before the next request fails on it."""
        try:
            found = await self.engine.link.executor.describe(timeout=IDLE_PROBE_TIMEOUT_S)
        except Lost as exc:
            log.warning("executor_unreachable_while_idle", pool_id=self.engine.pool_id,
                        code=exc.status, detail=exc.details[:200])
            self.lose_executor()
            return
        except CallFailed:
            return  # it answered: there, if unwilling; the next step says more
        link = self.engine.link
        if found.instance_id != link.description.instance_id:
            log.warning("executor_restarted_while_idle", pool_id=self.engine.pool_id)
            self.lose_executor()  # reconnecting registers the new instance: its pool is reset
        else:
            self.engine.take_lora_adapters(found)  # (another gateway's loads and unloads)

    async def reconnect(self) -> None:
        """A lost executor: try again every second; a restarted one resets its pool."""
        await asyncio.sleep(RECONNECT_INTERVAL_S)
        if self.engine.orphans and not await self.abort_orphans():
            return
        epoch = self.engine.link.epoch
        try:
            await self.engine.link.refresh(timeout_s=2.0)
        except CallFailed:
            return
        if self.engine.link.epoch != epoch:
            self.engine.orphans.clear()  # the pool was reset: it holds nothing
        self.engine.healthy = True
        log.info("executor_reconnected", pool_id=self.engine.pool_id)

    async def register_again(self) -> None:
        """The lease was replaced (the allocator may have restarted): register the pool again
        now, not when the next request comes, so that the allocator (its stats, routing by
        prefix, other gateways) knows it. Idempotent for a pool it still knows. A failure leaves
        it to the next Step (an unknown pool is registered then)."""
        try:
            await self.engine.link.refresh(timeout_s=5.0)
        except CallFailed as exc:
            log.warning("pool_reregister_failed", pool_id=self.engine.pool_id, code=exc.status)
            await asyncio.sleep(RECONNECT_INTERVAL_S)
            return
        self.engine.orphans.clear()  # a new lease: the allocator holds nothing of ours
        # It answered: routing may choose this pool again (an idle engine has no Step to say so).
        self.down_since = None

    async def reregister(self, plan: ScheduledStep | None = None) -> None:
        """The allocator no longer knows our pool, epoch, lease or some request: register
        again, readmit all. What the rejected call (`plan`) carried was not applied."""
        link = self.engine.link
        epoch, generation = link.epoch, link.lease.generation
        try:
            await link.lease.renew_if_lost()
            await link.refresh(timeout_s=5.0)
        except CallFailed as exc:
            log.warning("pool_reregister_failed", pool_id=self.engine.pool_id, code=exc.status)
            if plan is not None:
                self.engine.orphans.note_held(self.engine.scheduler, plan)
            self.lose_executor()
            return
        if link.epoch != epoch or link.lease.generation != generation:
            self.allocator_forgot("pool_reset")
            return
        # Same pool and lease: the allocator still holds what it held.
        self.engine.orphans.note_held(self.engine.scheduler, plan)
        self.readmit_all("pool_resync")

    def allocator_forgot(self, why: str) -> None:
        """A new pool epoch or a new lease: the allocator dropped every request we had."""
        self.engine.orphans.clear()
        self.readmit_all(why)

    def readmit_all(self, why: str) -> None:
        """Start every sequence over (the executor releases them); the caller has made sure the
        allocator holds none of them, or noted them as orphans."""
        seqs = self.engine.scheduler.evict_all()
        log.warning("requests_readmitted", pool_id=self.engine.pool_id, why=why, num=len(seqs))
        for seq in sorted(seqs, key=priority):
            if not seq.request.cancelled:
                self.engine.scheduler.add(seq)
