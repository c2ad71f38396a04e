"""The order of Execute calls sent ahead: a call naming a `previous_step_id` runs after the
call with that `step_id` has been taken (queued for the worker, refused, or given up by its
caller), however gRPC delivered the two (it does not order two calls on one channel).

Ids are matched exactly, so callers with their own numbering never release each other's
calls. An overtaken call arrives within milliseconds; one that never comes (refused before its
handler ran, say) is waited for at most ORDER_WAIT_S, after which the waiting call is refused:
it was built on a step this executor never took, and running it could write blocks that step
was to move first.
"""

from __future__ import annotations

import asyncio
from collections import deque

import structlog

log = structlog.get_logger(__name__)

ORDER_WAIT_S = 1.0


class StepOrder:
    """Which numbered calls have been taken (the last `remember` of them), and who waits."""

    def __init__(self, remember: int = 4096) -> None:
        self._taken: set[int] = set()
        self._oldest_first: deque[int] = deque()
        self._remember = remember
        self._waiters: dict[int, list[asyncio.Future[None]]] = {}

    def take(self, step_id: int) -> None:
        """The call numbered `step_id` is queued or refused: calls waiting for it go on."""
        if not step_id or step_id in self._taken:
            return
        self._taken.add(step_id)
        self._oldest_first.append(step_id)
        if len(self._oldest_first) > self._remember:
            self._taken.discard(self._oldest_first.popleft())
        for waiter in self._waiters.pop(step_id, ()):
            if not waiter.done():
                waiter.set_result(None)

    async def after(self, previous_step_id: int, timeout_s: float = ORDER_WAIT_S) -> bool:
        """True once `previous_step_id` (0: none) has been taken; False after `timeout_s`."""
        if not previous_step_id or previous_step_id in self._taken:
            return True
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiters = self._waiters.setdefault(previous_step_id, [])
        waiters.append(waiter)
        try:
            await asyncio.wait_for(waiter, timeout_s)
            return True
        except TimeoutError:
            log.warning("previous_step_not_seen", previous_step_id=previous_step_id,
                        waited_s=timeout_s)
            return False
        finally:
            if waiter in waiters:
                waiters.remove(waiter)
            if not waiters:
                self._waiters.pop(previous_step_id, None)
