"""The gateway's lease with the allocator: every request joins it; keep-alives every ttl/3.

If the gateway dies, the lease expires and the allocator frees every request in it. If a
keep-alive finds the lease gone (the gateway stalled past the ttl, or the allocator
restarted), a new lease is taken and `generation` moves on: the engines then readmit their
requests, since the allocator has forgotten them.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from common.credentials import lease_tag
from gateway.clients.allocator_client import AllocatorClient
from gateway.clients.call_failures import CallFailed, Unknown

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class Lease:
    allocator: AllocatorClient
    ttl_ms: int
    lease_id: str = ""
    generation: int = 0
    renewing: asyncio.Lock = field(default_factory=asyncio.Lock)
    # Step numbers for every engine on this lease: increasing per pool even when an executor
    # leaves and joins again (the allocator refuses a number not newer than the last).
    step_ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    # Called after every new lease (the engines' wake-ups: an idle one registers again).
    on_acquired: list[Callable[[], None]] = field(default_factory=list)

    async def acquire(self) -> None:
        self.lease_id, granted_ms = await self.allocator.create_lease(self.ttl_ms)
        self.ttl_ms = granted_ms or self.ttl_ms
        self.generation += 1
        log.info("lease_acquired", lease=lease_tag(self.lease_id), ttl_ms=self.ttl_ms)
        for callback in self.on_acquired:
            callback()

    async def keep_alive_forever(self) -> None:
        while True:
            await asyncio.sleep(self.ttl_ms / 3000)
            try:
                await self.allocator.keep_alive(self.lease_id)
            except Unknown:
                try:
                    await self.renew_if_lost()
                except CallFailed as again:
                    log.warning("lease_acquire_failed", code=again.status)
            except CallFailed as exc:
                log.warning("lease_keep_alive_failed", code=exc.status)

    async def renew_if_lost(self) -> None:
        """An allocator call said Unknown: if the lease is gone (allocator restarted),
        take a new one now rather than at the next keep-alive. Engines call this at once;
        only the first one renews."""
        async with self.renewing:
            try:
                await self.allocator.keep_alive(self.lease_id)
            except Unknown:
                log.warning("lease_lost", lease=lease_tag(self.lease_id))
                await self.acquire()
