"""Held outputs: a busy step's deltas reach the client streams while the next Execute runs.

Writing a stream message costs ~60-76 us of grpc CPU (`python -m bench.rpc_floor`), ~4 ms a
step at 64 running. The writes run on the API's loop (engine/host.py), but on two cores they
still compete for the CPU (and the GIL) with the allocator's reply and the executor's intake
of the next call. So a step's deltas
(detokenized, stop conditions applied at once, so the next step never schedules a finished
sequence) are held, and handed to the streams once the next Execute has had
EXECUTE_HEAD_START_S to reach the executor, or has returned: started at once, the writers
starved the executor's intake on two cores.

They wait for nothing else. The engine delivers them before any other call (frees, releases,
orphan aborts, forks), before an error or a move to another executor, when it goes idle, and
once a Step has taken STEP_HOLD_LIMIT_S. A step with fewer than `min_to_hold` deltas delivers
them at once: there the writers cost little, and holding would make every token a Step round
trip later.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from gateway.core.request_state import CompletionDelta, Request, emit_all

# How long the next Execute gets before the previous step's streams are written. Measured at
# 64 running (four interleaved runs each): writing at once raised the Execute round trip by
# ~1.2 ms; after 1 ms the control plane went 6.8 -> 5.3 ms.
EXECUTE_HEAD_START_S = 0.001
# Held outputs wait at most this long for the next Step (1.5-5 ms under load here).
STEP_HOLD_LIMIT_S = 0.01

T = TypeVar("T")


@dataclass(slots=True)
class HeldOutputs:
    min_to_hold: int = 16  # ~1 ms of stream writes
    deltas: list[tuple[Request, CompletionDelta]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.deltas)

    def add(self, request: Request, delta: CompletionDelta) -> None:
        self.deltas.append((request, delta))

    def worth_holding(self) -> bool:
        return len(self.deltas) >= self.min_to_hold

    def deliver(self) -> None:
        """Hand every held delta to its stream, in order (none to a cancelled request)."""
        deltas, self.deltas = self.deltas, []
        emit_all((request, delta) for request, delta in deltas if not request.cancelled)

    async def during_execute(
        self, execute: Awaitable[T], head_start_s: float = EXECUTE_HEAD_START_S
    ) -> T:
        """Await the Execute call, delivering once it has had its head start (`head_start_s`
        from now: less when the call went out before this await) or has returned."""
        return await self._deliver_during(execute, head_start_s, after_return=True)

    async def during_step(self, step: Awaitable[T]) -> T:
        """Await the Step call, delivering if it takes longer than the hold limit."""
        if not self.deltas:
            return await step
        return await self._deliver_during(step, STEP_HOLD_LIMIT_S, after_return=False)

    async def _deliver_during(self, call: Awaitable[T], after_s: float, after_return: bool) -> T:
        task = asyncio.ensure_future(call)
        try:
            await asyncio.wait([task], timeout=after_s)
            if after_return or not task.done():
                self.deliver()
            return await task
        except BaseException:
            _cancel(task)
            raise


def _cancel(task: asyncio.Future[Any]) -> None:
    """Cancel a call no longer awaited (its failure, if any, is the one being raised)."""
    if task.done() and not task.cancelled():
        task.exception()  # retrieved: asyncio does not log it as never retrieved
    task.cancel()
