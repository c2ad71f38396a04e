"""The executors a gateway routes to, kept in step with discovery (clients/discovery.py).

Every `interval_s` the discovery is asked again. A new address joins: it is described, its
pool registered, and its engine started; one serving another model than the gateway's is
refused, with both names in the log. An address that is gone drains: no new requests go to
its engine, its own ones finish (or, if its executor is gone, move to another executor as on
any loss), then its loop stops and it leaves the router. A lookup that fails, or that lists no
executor, changes nothing: a file caught between its truncation and its write reads empty, and
draining every executor on that would fail the requests of the ones still listed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import structlog

from gateway.clients.call_failures import CallFailed
from gateway.clients.discovery import Discovery, DiscoveryFailed
from gateway.engine.loop import Engine
from gateway.engine.router import Router

log = structlog.get_logger(__name__)
DRAIN_POLL_S = 0.1


@dataclass(slots=True)
class Membership:
    discovery: Discovery
    router: Router
    join: Callable[[str], Awaitable[Engine | None]]  # describe, register, build (None: refused)
    interval_s: float
    tasks: dict[Engine, asyncio.Task[None]] = field(default_factory=dict)
    leaving: set[Engine] = field(default_factory=set)
    last_problem: str = ""

    def start(self, engine: Engine) -> None:
        self.tasks[engine] = asyncio.get_running_loop().create_task(engine.run())

    async def run_forever(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.refresh()

    async def refresh(self) -> None:
        try:
            found = set(await self.discovery.addresses())
        except DiscoveryFailed as exc:
            self._problem(f"{self.discovery.source}: {exc}")
            return
        if not found:
            self._problem(f"{self.discovery.source} lists no executor")
            return
        current = {e.link.executor.address: e for e in self.router.engines}
        for address in sorted(found - current.keys()):
            try:
                engine = await self.join(address)
            except CallFailed as exc:
                log.warning("executor_join_failed", address=address, code=exc.status,
                            detail=exc.details)
                continue
            if engine is not None:
                self.start(engine)
                log.info("executor_joined", address=address, pool_id=engine.pool_id)
        for address, engine in current.items():
            if address not in found and engine not in self.leaving:
                self.leaving.add(engine)
                asyncio.get_running_loop().create_task(self.drain(engine))

    def _problem(self, problem: str) -> None:
        if problem != self.last_problem:
            log.warning("executor_discovery_failed", problem=problem,
                        num_executors=len(self.router.engines))
        self.last_problem = problem

    async def drain(self, engine: Engine) -> None:
        """No new requests; its own move to the others (hand_off.py) or finish here; stop
        once none is left (or its executor is gone, whose requests the engine has already
        moved to the others)."""
        engine.draining = True
        moved = self.router.move_waiting(engine)  # running ones move as they become idle
        engine.wakeup.set()
        log.info("executor_leaving", pool_id=engine.pool_id, num_requests=engine.load,
                 num_waiting_moved=moved)
        while engine.healthy and engine.busy:
            await asyncio.sleep(DRAIN_POLL_S)
        task = self.tasks.pop(engine, None)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        self.router.remove(engine)
        self.leaving.discard(engine)
        await engine.link.executor.close()
        log.info("executor_left", pool_id=engine.pool_id)

    async def close(self) -> None:
        for task in self.tasks.values():
            task.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
