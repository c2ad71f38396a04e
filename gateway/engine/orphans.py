"""Requests the allocator may still hold for a pool although no sequence here tracks them.

They appear when a call's outcome is unknown: a `Step` past its deadline or cut off (it is
not idempotent: its frees, preemptions, admissions and appended tokens may or may not have
been applied), a lost executor, a step interrupted by a gateway bug, a Fork whose children
the scheduler does not track yet. Rather than guess, the engine notes every id the allocator
might hold and aborts them before the pool's next Step: in one call when all are still there,
else one by one, ignoring the ones already gone (or never ours: another lease's request with
the same id, which the allocator will not let us touch).
Aborting commits nothing, so no unconfirmed KV enters the prefix cache (the commit rule).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import structlog

from gateway.clients.call_failures import CallFailed, Denied, Lost, Stale, Unknown
from gateway.clients.pool_link import PoolLink
from gateway.core.batch import ScheduledStep
from gateway.core.scheduler import Scheduler

log = structlog.get_logger(__name__)

# Nothing of ours to abort: gone already, or another lease's request with the same id
# (another gateway's; an id we only tried to admit).
_NOT_OURS = (Unknown, Denied)


@dataclass(slots=True, eq=False)
class Orphans:
    """One pool's orphans: noted here, aborted before its next Step."""

    ids: set[str] = field(default_factory=set)

    def __bool__(self) -> bool:
        return bool(self.ids)

    def __len__(self) -> int:
        return len(self.ids)

    def note(self, ids: Iterable[str]) -> None:
        self.ids.update(ids)

    def clear(self) -> None:
        """The allocator holds nothing of ours any more (a new pool epoch or lease)."""
        self.ids.clear()

    def note_held(self, scheduler: Scheduler, plan: ScheduledStep | None = None) -> None:
        """Everything the allocator may hold for the scheduler's sequences (and for `plan`, a
        step whose outcome is unknown) becomes an orphan; the sequences then start over."""
        ids = self.ids
        ids.update(s.seq_id for s in scheduler.sequences() if s.known_to_allocator)
        ids.update(scheduler.pending.free_request_ids)
        ids.update(scheduler.pending.abort_request_ids)
        if plan is not None:
            ids.update(plan.call.free_request_ids)
            ids.update(plan.call.abort_request_ids)
            ids.update(i.request_id for i in plan.call.items if i.is_new)

    @contextmanager
    def until_tracked(self, ids: list[str]) -> Iterator[None]:
        """Ids a call may create at the allocator (Fork's children) are orphans until the
        scheduler tracks them: forgotten when the call succeeded or was refused (not
        applied), kept when its outcome is unknown (Lost) or a bug cut in."""
        self.ids.update(ids)
        try:
            yield
        except CallFailed as exc:
            if not isinstance(exc, Lost):
                self.ids.difference_update(ids)
            raise
        self.ids.difference_update(ids)

    async def abort(self, link: PoolLink) -> CallFailed | None:
        """Abort every orphan the allocator still holds; the error that stopped it, if any
        (the orphans not yet aborted stay noted)."""
        ids = sorted(self.ids)
        try:
            await link.abort(ids)
        except _NOT_OURS:
            pass
        except CallFailed as exc:
            return self._gone_with_pool(link.pool_id, exc)
        else:
            self.ids.clear()
            log.info("orphans_aborted", pool_id=link.pool_id, num=len(ids))
            return None
        # Some are gone already (the lost step freed or preempted them): one at a time.
        for request_id in ids:
            try:
                await link.abort([request_id])
            except _NOT_OURS:
                pass
            except CallFailed as exc:
                return self._gone_with_pool(link.pool_id, exc)
            self.ids.discard(request_id)
        log.info("orphans_aborted", pool_id=link.pool_id, num=len(ids))
        return None

    def _gone_with_pool(self, pool_id: str, exc: CallFailed) -> CallFailed | None:
        """Stale: the pool was reset since (new epoch), which dropped every request it held;
        the next Step re-registers. Lost: worth retrying, the allocator may answer later (the
        error is returned). A refusal that retrying cannot change (Rejected) is logged and
        the orphans are given up, so the engine does not wedge; what they hold comes back
        when the lease expires or the pool resets."""
        if isinstance(exc, Stale):
            self.ids.clear()
            return None
        if not isinstance(exc, Lost):
            log.error("orphans_given_up", pool_id=pool_id, code=exc.status,
                      details=exc.details, num=len(self.ids))
            self.ids.clear()
            return None
        return exc
