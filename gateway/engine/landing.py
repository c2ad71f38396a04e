"""The batches in flight: an engine sends each Execute as a task (`launch`), and awaits it in
the same step or, at depth 2, in the next (`land`): its tokens advance the scheduler, and
become deltas for the streams, finishes and forks (`take_outputs`). `settle` does both;
recovery, housekeeping and idle start from there.

At depth 2, a step's Execute goes out before the previous one lands: two are in flight
for that while (`in_flight`, oldest first), and they land in order. The older one has
been advanced already (Scheduler.advance): landing it only puts its sampled values in.
"""

from __future__ import annotations

import asyncio
import time

from gateway.clients.call_failures import CallFailed
from gateway.core.batch import Batch, InFlight, Landed
from gateway.core.request_state import SeqStatus
from gateway.engine.beams import BeamSteps


class Landing(BeamSteps):
    """The engine's batches in flight (a base class of engine/loop.py's Engine)."""

    __slots__ = ()

    def launch(self, batch: Batch) -> InFlight:
        """Send the batch's Execute; it is awaited by `land`, in this step or the next. Numbered
        for an executor that uses its sampled tokens, and launched ahead, naming the one before
        (the executor runs it after that one, however the two arrive)."""
        step_id = next(self.step_ids) if self.link.description.uses_sampled_tokens else 0
        previous = self.in_flight[-1].step_id if self.in_flight else 0
        execute = asyncio.ensure_future(self.link.execute(batch.call, step_id, previous))
        self.scheduler.launch(batch)  # at depth 2 the next step is planned on top of it
        flight = InFlight(batch, execute, time.perf_counter(), step_id,
                          schedule_ms=self.last_schedule_ms, allocator_ms=self.last_step_ms,
                          ahead=bool(self.in_flight))
        self.in_flight.append(flight)
        return flight

    async def land(self) -> Landed | None:
        """Await the oldest batch in flight, if any, and take its tokens: computed counts and
        outputs advance (an advanced batch's outputs get their values); what they mean for the
        streams waits for `take_outputs`. None if nothing landed."""
        if not self.in_flight:
            return None
        flight = self.in_flight.popleft()
        batch = self.batch = flight.batch
        try:
            result = await flight.execute
        except CallFailed as exc:
            self.scheduler.land(batch)
            if self.in_flight:  # launched ahead on top of this one: it may fail too
                self.in_flight[0].after_failure = True
            self.recovery.execute_failed(batch, exc, flight.after_failure)
            return None
        except BaseException:
            self.scheduler.land(batch)
            raise
        execute_ms = (time.perf_counter() - flight.launched) * 1e3
        self.releases_refused = False  # any waiting releases went out with this Execute
        sampled = self.scheduler.apply_result(batch, result)
        return Landed(flight, result, execute_ms, sampled)

    async def take_outputs(self, landed: Landed | None, fork: bool = True) -> None:
        """A landed batch's tokens become deltas, handed to the streams at once; its finished
        sequences end, its computed prefill parents fork and its beam searches step (unless
        `fork` is False: recovery is about to readmit or fail them)."""
        if landed is None:
            return
        landed_beams = []
        for seq, token in landed.sampled:
            if seq.status is SeqStatus.FINISHED:  # ended since, e.g. cancelled
                continue
            if seq.is_beam:
                landed_beams.append(seq)
            else:
                self.emit(seq, token)
        self.deliver()
        if landed_beams and fork:
            await self.advance_beams(landed_beams)
        parents = self.scheduler.ready_to_fork(landed.batch) if fork else []
        for parent in parents:
            await self.fork_children(parent)

    async def settle(self, fork: bool = True) -> Landed | None:
        """Land every batch in flight and take its outputs; the last one landed, if any."""
        landed = None
        while self.in_flight:
            landed = await self.land()
            await self.take_outputs(landed, fork)
        return landed
