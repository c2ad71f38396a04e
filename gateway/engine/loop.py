"""One executor's step loop: Step at the allocator, Execute at the executor, then outputs.

One loop, at an async depth of at most two batches in flight. At depth 2 (the default, with an
executor that uses its own sampled tokens) step k+1 is planned and allocated while batch k
executes, on top of it: its sequences' next tokens are stand-ins the executor fills in itself.
Its Execute goes out as soon as its Step returns, and the executor starts it the moment batch k
ends; then batch k lands. At depth 1 (`--async-depth 1`, an executor that cannot use its own
sampled tokens, or speculative decoding while a running sequence may be drafted for) each
batch lands before the next is planned.

A landed batch's deltas (token ids: detokenizing and stop strings are the API's, on its own
loop) go to the client streams at once, while the next batch computes.

Single writer: the engines run on their own event loop and thread (engine/host.py), where
the loop is the only code that mutates its scheduler, between awaits, so no lock is needed.
The router (on the same loop) only appends sequences with `submit`, flags cancellations on
the request and wakes the loop; RPC handlers, on the API's loop, reach it through the host.

One engine class, built up in layers that never import this loop: its state and the
operations every part of a step shares (state.py), its calls off the hot path (side_calls.py:
Fork, idle Free/Abort/Release), beam searches' steps (beams.py), its batches in flight
(landing.py), then the loop here. Its collaborators keep their own state: `recovery`
(recovery.py: what happens when a call fails, and the allocator's outage), `orphans`
(orphans.py: what the allocator may hold after a call whose outcome is unknown) and `mover`
(hand_off.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field

import structlog

from gateway.clients.call_failures import CallFailed
from gateway.core.batch import Batch, InFlight, Landed, ScheduledStep
from gateway.core.drafts import may_draft
from gateway.core.request_state import Sequence
from gateway.core.step import StepOutcome
from gateway.engine import recovery
from gateway.engine.landing import Landing
from gateway.engine.recovery import Recovery
from gateway.engine.step_stats import StepRecord

log = structlog.get_logger(__name__)


@dataclass(slots=True, eq=False)
class Engine(Landing):
    # What the engine does when a call fails, and its record of an allocator outage.
    recovery: Recovery = field(init=False)

    def __post_init__(self) -> None:
        self.recovery = Recovery(self)

    @property
    def allocator_down_since(self) -> float | None:
        """Since when the allocator has not answered this engine (None: it answers)."""
        return self.recovery.down_since

    # Called by other coroutines.

    def submit(self, seq: Sequence, front: bool = False) -> None:
        self.scheduler.add(seq, front=front)
        if seq.request.cancelled:  # re-queued from a lost executor
            self.has_cancellations = True
        self.wakeup.set()

    def cancel(self) -> None:
        """Some request was cancelled: the loop aborts its sequences before the next step."""
        self.has_cancellations = True
        self.wakeup.set()

    @property
    def busy(self) -> bool:
        """Work left, or a step under way (its calls, a final Free among them, still out), or
        a hand-off from or to it not finished."""
        return (self.stepping or self._has_work() or bool(self.scheduler.parking.parked)
                or (self.mover is not None and self.mover.holds(self)))

    # The loop.

    async def run(self) -> None:
        while True:
            if not self.healthy:
                try:
                    await self.recovery.reconnect()
                except Exception:  # noqa: BLE001 - a bug must not end the loop either
                    log.exception("engine_reconnect_failed", pool_id=self.pool_id)
                continue
            if not self._has_work():
                if self.link.lease_renewed and not self.scheduler.parking.parked:
                    await self.recovery.register_again()  # (registering takes the renewal)
                    continue
                if self.link.lease_renewed:  # the allocator forgot the parked ones: a step
                    await self._step_once()   # takes the renewal and starts them over
                    continue
                await self._idle()
                continue
            progressed = await self._step_once()
            # Yield to the RPC handlers; back off a little when nothing could be scheduled.
            await asyncio.sleep(0 if progressed else 0.005)

    async def _idle(self) -> None:
        """Wait for work; after IDLE_PROBE_S without any, check that the executor is there."""
        self.wakeup.clear()
        self.last_landed = None
        try:
            await asyncio.wait_for(self.wakeup.wait(), recovery.IDLE_PROBE_S)
        except TimeoutError:
            try:
                await self.recovery.probe_idle()
            except Exception:  # noqa: BLE001 - a bug must not end the loop either
                log.exception("engine_idle_probe_failed", pool_id=self.pool_id)

    async def _step_once(self) -> bool:
        try:
            return await self.step()
        except Exception:  # noqa: BLE001 - a bug must not kill the loop and hang clients
            log.exception("engine_step_failed", pool_id=self.pool_id)
            self.abandon_in_flight()
            self.recovery.step_crashed(self.plan, self.batch)
            return True

    async def step(self) -> bool:
        """One scheduling step; False when nothing could run (all deferred)."""
        self.stepping = True
        try:
            return await self._step()
        finally:
            self.stepping = False
            self.deliver()

    async def _step(self) -> bool:
        """housekeep -> schedule -> allocate -> launch -> land -> emit. At depth 2 the batch
        in flight lands after this step's batch has gone out, planned on top of it."""
        self.plan = self.batch = None
        done = await self._housekeep()
        if done is not None:
            return done
        started = time.perf_counter()
        overlapped = bool(self.in_flight)
        plan = self.plan = self._schedule(overlapped)
        if plan is None or not plan.call.has_items():
            await self._without_a_step(plan)
            return True
        outcome = await self._allocator_step(plan, self.link.step(plan.call), settle=overlapped)
        if outcome is None:
            return False
        landed, lost = await self._meet_the_batch_in_flight(plan, overlapped)
        if lost:
            return True
        batch = self.batch = self._apply(plan, outcome)
        if batch.call.is_empty():
            await self._release_only(batch, landed)
            return False
        self.launch(batch)
        landed = await self._land(landed)
        if landed is not None:
            self._record(landed, started)
        return True

    # Pieces of a step, in order.

    async def _housekeep(self) -> bool | None:
        """Before planning: a renewed lease, cancellations, orphans, a batch in flight the
        next cannot be built on, sequences moving here. A bool ends the step with it."""
        renewal = self.link.take_lease_renewal()
        if renewal or self.orphans:
            # Recovery starts from a settled state: nothing executing. (No fork for a lost
            # lease: the parents are readmitted, and fork again once recomputed.)
            await self.settle(fork=not renewal)
        if renewal:
            self.recovery.allocator_forgot("lease_renewed")
            # The allocator may have restarted: it learns the pool again now, not at a Step
            # that may never come (routing leaves out a pool its allocator does not know).
            await self.recovery.register_again()
        if self.has_cancellations:
            self._apply_cancellations()
        if self.adapters_changed:
            self.fail_unserved()
        if self.orphans and not await self.recovery.abort_orphans():
            return False
        if self.in_flight and not self._can_build_on(self.in_flight[0]):
            landed = await self.settle()
            if landed is not None:  # (its step's stats: it lands here, not in _land)
                self._record(landed, time.perf_counter())
            if not self.healthy:
                return True
        if self.mover is not None and self.healthy:
            # Sequences moving here: adopted once their KV is in, reserved when new (between
            # this engine's own Steps: hand_off.py says why).
            await self.mover.receive(self)
        return None

    def _schedule(self, overlapped: bool) -> ScheduledStep | None:
        started = time.perf_counter()
        scheduler = self.scheduler
        if scheduler.drafts is not None:
            # As many drafts as the executor verifies, read every step: it may have been
            # replaced since (one that verifies none would compute drafts as tokens).
            scheduler.max_drafts = self.link.description.max_draft_tokens
        scheduler.parking.move_quota = self.mover.quota(self) if self.mover is not None else 0
        if self.mover is not None and scheduler.parking.move_quota:
            scheduler.parking.adapters = self.mover.adapters_served(self)
        plan = scheduler.schedule(overlapped)
        if scheduler.parking.newly_parked:
            assert self.mover is not None, "parked with no mover"
            self.mover.start(self, scheduler.parking.take_newly_parked())
        self.last_schedule_ms = (time.perf_counter() - started) * 1e3
        return plan

    async def _without_a_step(self, plan: ScheduledStep | None) -> None:
        """Nothing to compute: what is executing lands, housekeeping goes out on its own."""
        await self.settle()  # nothing to overlap with the batch executing
        if not self.in_flight:
            self.scheduler.pending.confirm_failed()  # (a later call carries it)
        self.deliver()  # no delta waits behind a call off the hot path
        if plan is None:
            await self.flush_releases()
        else:
            await self.flush_housekeeping(plan)

    async def _meet_the_batch_in_flight(
        self, plan: ScheduledStep, overlapped: bool
    ) -> tuple[Landed | None, bool]:
        """The batch in flight lands first if it returned while the Step was out (this
        step's batch is then built on its tokens), else is advanced (built on stand-ins).
        Returns what landed, and whether the executor was lost meanwhile."""
        if not overlapped:
            return None, False
        if not self.in_flight[0].execute.done():
            # Its tokens count as computed, their values as stand-ins that the executor
            # fills in itself (use_sampled_token): this step's batch goes out before it lands.
            self.scheduler.advance(self.in_flight[0].batch)
            return None, False
        landed = await self.land()
        if not self.healthy:  # the executor went away: the Step's outcome too
            self.orphans.note_held(self.scheduler, plan)
            return landed, True
        return landed, False

    def _apply(self, plan: ScheduledStep, outcome: StepOutcome) -> Batch:
        applying = time.perf_counter()
        batch = self.scheduler.apply_outcome(plan, outcome)
        self.last_schedule_ms += (time.perf_counter() - applying) * 1e3
        return batch

    async def _release_only(self, batch: Batch, landed: Landed | None) -> None:
        """Nothing to run, but releases (a recompute preemption) must still go out."""
        if self.in_flight:  # the batch in flight lands first
            landed = await self.land()
        await self.take_outputs(landed)
        self.scheduler.pending.release_ids.extend(batch.call.release_request_ids)
        await self.flush_releases()

    async def _land(self, landed: Landed | None) -> Landed | None:
        """Once this step's batch is out: the batch before it lands and its outputs go."""
        if len(self.in_flight) > 1:
            # The batch before lands now, while this one computes.
            landed = await self.land()
            await self.take_outputs(landed)
        elif self.depth > 1:
            # Depth 2, nothing was in flight (the first step after idle, or one that landed
            # early): this batch lands in the next step; the landed one's outputs go now,
            # once the Execute task has had its turn to send the call.
            await asyncio.sleep(0)
            await self.take_outputs(landed)
        else:
            landed = await self.settle()
        return landed

    def _record(self, landed: Landed, started: float) -> None:
        """A step's time runs from the previous step's landing to this one's: busy, that is
        the executor's period whatever overlaps what (at depth 2, a step's own span is not);
        the first step after idle counts from its start."""
        now = time.perf_counter()
        since, self.last_landed = self.last_landed or started, now
        done, result = landed.flight, landed.result
        self.stats.record(StepRecord(
            period_ms=(now - since) * 1e3,
            schedule_ms=done.schedule_ms,
            allocator_ms=done.allocator_ms,
            execute_ms=landed.execute_ms,
            forward_ms=result.forward_ms,
            sample_ms=result.sample_ms,
            executor_ms=result.executor_ms,
            num_seqs=len(landed.batch.scheduled),
            num_tokens=result.num_tokens,
            ahead=done.ahead,
        ), self.pool_id)
        if self.stats.should_report():
            log.info("engine_step_stats", pool_id=self.pool_id, **self.stats.summary())

    def _can_build_on(self, flight: InFlight) -> bool:
        """The next batch may be planned on top of this one still in flight: not when it has
        returned already (landing it first costs nothing and builds on what is known), nor
        when the one before it failed (it may fail too), nor while drafting may pay
        (`_drafting`)."""
        return (self.depth > 1 and not flight.after_failure and not flight.execute.done()
                and not self._drafting(flight))

    def _drafting(self, flight: InFlight) -> bool:
        """Drafts are proposed from landed tokens, and a drafted row's accepted drafts change
        what follows it: with drafting on, the step after one that drafted, or one in which a
        running sequence may be drafted for, waits for the batch in flight (depth 1).
        Sequences that are never drafted for (sampled, with logprobs, ...) keep the overlap."""
        scheduler = self.scheduler
        if scheduler.drafts is None:
            return False
        if any(w.num_draft_tokens for w in flight.batch.call.seqs):
            return True
        if not self.link.description.max_draft_tokens or scheduler.parking.move_quota:
            return False  # nothing will be drafted (the scheduler's own conditions)
        return any(may_draft(s.request) and not s.is_beam for s in scheduler.running)

    def _has_work(self) -> bool:
        pending = self.scheduler.pending
        return (
            self.scheduler.has_work() or pending.has_allocator_work()
            or (bool(pending.release_ids) and not self.releases_refused)
            or self.has_cancellations or bool(self.orphans) or bool(self.outbox)
            or bool(self.in_flight) or (self.mover is not None and self.mover.has_work(self))
        )

    async def _allocator_step(
        self, plan: ScheduledStep, call: Awaitable[StepOutcome], landed: Landed | None = None,
        settle: bool = False,
    ) -> StepOutcome | None:
        """The Step's outcome; None when it failed (after recovery; `landed`, a batch that
        returned meanwhile, has had its outputs taken first; with `settle`, the batch in
        flight lands first)."""
        sent = time.perf_counter()
        try:
            outcome = await call
        except CallFailed as exc:
            if settle:
                landed = await self.land()
            # (No fork: recovery readmits or fails the parents.)
            await self.take_outputs(landed, fork=False)
            await self.recovery.allocator_step_failed(plan, exc)
            return None
        self.last_step_ms = (time.perf_counter() - sent) * 1e3
        self.recovery.allocator_answered()
        if outcome.num_free_blocks is not None:
            self.num_free_blocks = outcome.num_free_blocks
        return outcome

    def _apply_cancellations(self) -> None:
        self.has_cancellations = False
        for seq in self.scheduler.sequences():
            request = seq.request
            if request.cancelled:
                self.scheduler.abort(seq)

