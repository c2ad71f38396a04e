"""Requests the allocator may still hold for a pool although no sequence here tracks them.

They appear when a call's outcome is unknown: a `Step` past its deadline or cut off (it is
not idempotent: its frees, preemptions, admissions and appended tokens may or may not have
been applied), a lost executor, a step interrupted by a gateway bug. Rather than guess, the
engine notes every id the allocator might hold and aborts them before the pool's next Step:
in one call when all are still there, else one by one, ignoring the ones already gone (or
never ours: another lease's request with the same id, which the allocator will not let us
touch).
Aborting commits nothing, so no unconfirmed KV enters the prefix cache (the commit rule).
"""

from __future__ import annotations

import structlog

from gateway.clients.call_failures import CallFailed, Denied, Lost, Stale, Unknown
from gateway.core.batch import ScheduledStep
from gateway.engine.state import EngineState

log = structlog.get_logger(__name__)


def note_held(engine: EngineState, plan: ScheduledStep | None = None) -> None:
    """Everything the allocator may hold for the engine's sequences (and for `plan`, a step
    whose outcome is unknown) becomes an orphan; the sequences then start over."""
    sched = engine.scheduler
    ids = engine.orphan_ids
    ids.update(s.seq_id for s in sched.sequences() if s.known_to_allocator)
    ids.update(sched.pending.free_ids)
    ids.update(sched.pending.abort_ids)
    if plan is not None:
        ids.update(plan.call.free_request_ids)
        ids.update(plan.call.abort_request_ids)
        ids.update(i.request_id for i in plan.call.items if i.is_new)


async def abort_orphans(engine: EngineState) -> CallFailed | None:
    """Abort every orphan the allocator still holds; the error that stopped it, if any
    (the orphans not yet aborted stay noted)."""
    ids = sorted(engine.orphan_ids)
    try:
        await engine.link.abort(ids)
    except _NOT_OURS:
        pass
    except CallFailed as exc:
        return _gone_with_pool(engine, exc)
    else:
        engine.orphan_ids.clear()
        log.info("orphans_aborted", pool_id=engine.pool_id, num=len(ids))
        return None
    # Some are gone already (the lost step freed or preempted them): one at a time.
    for request_id in ids:
        try:
            await engine.link.abort([request_id])
        except _NOT_OURS:
            pass
        except CallFailed as exc:
            return _gone_with_pool(engine, exc)
        engine.orphan_ids.discard(request_id)
    log.info("orphans_aborted", pool_id=engine.pool_id, num=len(ids))
    return None


# Nothing of ours to abort: gone already, or another lease's request with the same id
# (another gateway's; an id we only tried to admit).
_NOT_OURS = (Unknown, Denied)


def _gone_with_pool(engine: EngineState, exc: CallFailed) -> CallFailed | None:
    """Stale: the pool was reset since (new epoch), which dropped every request it held;
    the next Step re-registers. Lost: worth retrying, the allocator may answer later (the
    error is returned). A refusal that retrying cannot change (Rejected) is logged and the
    orphans are given up, so the engine does not wedge; what they hold comes back when the
    lease expires or the pool resets."""
    if isinstance(exc, Stale):
        engine.orphan_ids.clear()
        return None
    if not isinstance(exc, Lost):
        log.error("orphans_given_up", pool_id=engine.pool_id, code=exc.status,
                  details=exc.details, num=len(engine.orphan_ids))
        engine.orphan_ids.clear()
        return None
    return exc
