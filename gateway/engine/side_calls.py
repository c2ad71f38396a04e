"""An engine's calls off the hot path: Fork (n > 1), and Free, Abort and Release when no
Step or Execute is there for them to ride on. Failures go to recovery.py like the hot
path's."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import structlog

from common.errors import Unavailable
from gateway.clients.call_failures import CallFailed, Lost
from gateway.core.batch import ScheduledStep
from gateway.core.request_state import Sequence
from gateway.core.seq_ids import child_seq_id, wire_id
from gateway.engine import recovery
from gateway.engine.recovery import Recovery
from gateway.engine.state import EngineState

log = structlog.get_logger(__name__)


class SideCalls(EngineState):
    """The engine's calls off the hot path (a base class of engine/loop.py's Engine)."""

    __slots__ = ()
    # What the engine does when a call fails (recovery.py); the Engine makes it.
    recovery: Recovery

    async def fork_children(self, parent: Sequence) -> None:
        """A computed prefill parent (n > 1) becomes its children, which share its blocks."""
        request = parent.request
        children = [
            Sequence(seq_id=child_seq_id(wire_id(request.id_namespace, request.request_id), i),
                     request=request, index=i,
                     seed_offset=i)
            for i in range(request.sampling.n)
        ]
        child_ids = [c.seq_id for c in children]
        try:
            with self.orphans.until_tracked(child_ids):
                tables = await self.link.fork(parent.seq_id, child_ids, request.request_id)
                self.scheduler.fork(parent, children, tables)
        except CallFailed as exc:
            log.warning("fork_failed", code=exc.status, details=exc.details)
            self.fail(parent, Unavailable(f"fork failed ({exc.status})"))

    async def flush_housekeeping(self, plan: ScheduledStep) -> None:
        """An idle engine: the allocator's aborts, frees and commits, and the executor's
        releases, go out without a step, the two services' calls side by side (neither
        depends on the other's, and a request arriving now waits for both). A task group: a
        bug in one cancels the other rather than leaving it running beside recovery."""
        async with asyncio.TaskGroup() as both:
            both.create_task(self._flush_allocator(plan))
            both.create_task(self.flush_releases())

    async def _flush_allocator(self, plan: ScheduledStep) -> None:
        """Aborts first: the Free confirms steps by id (commit_through_step_id), which may
        cover a rejected batch whose requests are among the aborts, and an aborted request is
        never committed. (A Step carries both, and the allocator skips the ones it aborts.)"""
        call = plan.call
        try:
            if call.abort_request_ids:
                self.num_free_blocks = await self.link.abort(call.abort_request_ids)
                # Applied: whatever fails next must not send them again.
                plan = ScheduledStep(call=replace(call, abort_request_ids=()), seqs=plan.seqs)
            if call.commits or call.free_request_ids or call.commit_through_step_id:
                self.num_free_blocks = await self.link.free(
                    call.commits, call.free_request_ids, call.commit_through_step_id)
        except CallFailed as exc:
            log.warning("allocator_free_failed", pool_id=self.pool_id, code=exc.status)
            if isinstance(exc, recovery.STALE_POOL):
                await self.recovery.reregister(plan)
            elif isinstance(exc, Lost):
                # Free may have been applied: abort the ids later, never free twice.
                self.orphans.note([*plan.call.free_request_ids, *plan.call.abort_request_ids])
                await self.recovery.allocator_unreachable(exc)
            else:
                self.recovery.restore_housekeeping(plan)
                await asyncio.sleep(recovery.RETRY_PAUSE_S)

    async def flush_releases(self) -> None:
        """Executor releases with no Execute to ride on."""
        ids = self.scheduler.pending.release_ids
        if not ids or self.releases_refused:
            return
        try:
            await self.link.release(list(ids))
            ids.clear()
        except CallFailed as exc:
            if isinstance(exc, Lost):
                # Kept: releasing is idempotent, and the executor may come back as the same
                # instance, still holding them (a new instance ignores unknown ids).
                self.recovery.lose_executor()
                return
            # A refusal: resent on every loop, it would keep the engine busy forever. Dropped,
            # the executor would still hold ids that may come back (a recompute readmission,
            # a client reusing its id) and refuse them. They ride on the next Execute.
            log.error("executor_release_refused", pool_id=self.pool_id, code=exc.status,
                      details=exc.details, num=len(ids))
            self.releases_refused = True
