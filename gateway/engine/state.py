"""One executor's engine, as data: its pool link, scheduler, batches in flight and what
waits to be sent, with the operations every part of a step shares (emit, deliver, fail).

The engine class is built on this in layers (side_calls.py, beams.py, landing.py, loop.py);
its collaborators (recovery.py, orphans.py, hand_off.py) work on it; none imports the loop.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from common.errors import Internal, NotFound, ServiceError
from common.executor_description import ExecutorDescription
from gateway.clients.pool_link import PoolLink
from gateway.core.batch import Batch, InFlight, ScheduledStep
from gateway.core.finish_rules import FinishRules
from gateway.core.request_state import CompletionDelta, Request, Sequence, emit_all
from gateway.core.scheduler import Scheduler
from gateway.engine.orphans import Orphans
from gateway.engine.step_stats import StepStats


class Mover(Protocol):
    """Moves sequences between engines (engine/hand_off.py)."""

    def quota(self, engine: EngineState) -> int: ...

    def adapters_served(self, source: EngineState) -> frozenset[tuple[str, str]]: ...

    def start(self, source: EngineState, seqs: list[Sequence]) -> None: ...

    def has_work(self, target: EngineState) -> bool: ...

    def holds(self, engine: EngineState) -> bool: ...

    async def receive(self, target: EngineState) -> None: ...


@dataclass(slots=True, eq=False)
class EngineState:
    link: PoolLink
    scheduler: Scheduler
    finish_rules: FinishRules
    on_lost: Callable[[list[Sequence]], None]
    healthy: bool = True
    has_cancellations: bool = False
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    stats: StepStats = field(default_factory=StepStats)
    adapters_changed: bool = False  # its executor's LoRA adapters changed (fail_unserved)
    # How long requests wait for an allocator that does not answer before they fail.
    allocator_retry_s: float = 10.0
    # Ids the allocator may hold that no sequence tracks: aborted before the next Step.
    orphans: Orphans = field(default_factory=Orphans)
    # The executor refused a Release of its own: the ids wait for the next Execute to carry
    # them (it releases before it creates, so an id readmitted meanwhile still works) and
    # keep no idle engine busy.
    releases_refused: bool = False
    # The step in progress, for recovery when a bug interrupts it.
    plan: ScheduledStep | None = None
    batch: Batch | None = None
    # The deltas of the batch landing now: each reading loop gets them in one callback.
    outbox: list[tuple[Request, CompletionDelta]] = field(default_factory=list)
    # Batches in flight at most (README, "How it fits together"). 2, with an executor that
    # uses its own sampled tokens: step k+1 is planned, allocated and sent while batch k
    # executes, and batch k lands after. 1: each batch lands before the next is planned.
    async_depth: int = 2
    in_flight: deque[InFlight] = field(default_factory=deque)  # oldest first; at most two
    # Execute numbers (step_id), from a random start: unlike any other caller's at the executor.
    step_ids: itertools.count[int] = field(
        default_factory=lambda: itertools.count(secrets.randbits(62) + 1)
    )
    last_step_ms: float = 0.0  # the latest Step's round trip
    # The pool's free blocks (every caller's requests and pins hold the others) as the
    # allocator's latest Step, or an idle engine's Free or Abort, reported: the pool-usage
    # gauges (metrics.py). None before the first.
    num_free_blocks: int | None = None
    last_schedule_ms: float = 0.0  # the scheduler's share of the latest step
    last_landed: float | None = None  # when the last step that landed a batch ended (stats)
    stepping: bool = False
    # Its executor left discovery: no new requests; its own move to other executors (when
    # any can take them) or finish here, then it is stopped.
    draining: bool = False
    # Hands its parked sequences to other engines (None: a lone engine, nothing moves).
    mover: Mover | None = None


    @property
    def pool_id(self) -> str:
        return self.link.pool_id

    @property
    def description(self) -> ExecutorDescription:
        return self.link.description

    @property
    def load(self) -> int:
        return self.scheduler.num_unfinished

    @property
    def num_admitted(self) -> int:
        """Its sequences the allocator holds: what this gateway adds to the pool's count."""
        s = self.scheduler
        return len(s.running) + len(s.swapped) + len(s.parking.parked)

    @property
    def depth(self) -> int:
        """The async depth this executor allows (it may have been replaced since)."""
        return self.async_depth if self.link.description.uses_sampled_tokens else 1

    def emit(self, seq: Sequence, token: int) -> None:
        request = seq.request
        if len(seq.output_token_ids) == 1 and request.needs_prompt_logprobs:
            # Its first token, and some of the prompt's logprobs never came: an executor (or
            # allocator) that does not implement them. The client is told, not given holes.
            self.fail(seq, Internal(
                "the executor returned no logprobs for some prompt tokens: it must implement "
                "SamplingParams.prompt_logprobs (pagedkv.executor.v1; see tests/conformance)"))
            return
        ahead = seq.num_unemitted  # landed with it, after it (speculative decoding)
        if ahead:
            seq.num_unemitted = ahead - 1
        delta = self.finish_rules.delta(seq, token, ahead)
        if delta.finish_reason is not None:
            seq.num_unemitted = 0
        self.outbox.append((seq.request, delta))
        if delta.finish_reason is not None:
            self.scheduler.finish(seq)

    def deliver(self) -> None:
        """Hand every delta in the outbox to its stream, in order (none to a cancelled
        request)."""
        outbox, self.outbox = self.outbox, []
        emit_all((request, delta) for request, delta in outbox if not request.cancelled)

    def take_lora_adapters(self, found: ExecutorDescription) -> None:
        """An executor's adapters from a Describe answer, unless one taken already is newer
        (or it is another instance: reconnecting takes that). Its waiting sequences of an
        adapter gone fail before the next step (`fail_unserved`), not now: a Step may be out
        with them in it."""
        link = self.link
        if (found.instance_id != link.description.instance_id
                or found.lora_generation <= link.description.lora_generation):
            return
        link.description = replace(link.description, lora_adapters=found.lora_adapters,
                                   lora_generation=found.lora_generation)
        self.adapters_changed = True
        self.wakeup.set()

    def fail_unserved(self) -> None:
        """Between steps: waiting sequences of an adapter this executor no longer has (with
        their contents) and does not hold them for fail with NOT_FOUND; it would refuse their
        whole step."""
        self.adapters_changed = False
        served = {(a.name, a.digest) for a in self.link.description.lora_adapters}
        for seq in list(self.scheduler.waiting):
            lora = seq.request.lora
            if lora is None or (lora.name, lora.digest) in served or seq.known_to_executor:
                continue
            self.scheduler.waiting.remove(seq)
            self.fail(seq, NotFound(f"LoRA adapter {lora.name!r} was unloaded from executor "
                                    f"{self.pool_id}"))

    def fail(self, seq: Sequence, error: ServiceError) -> None:
        self.deliver()  # the tokens before the failure first
        if not seq.request.cancelled:
            seq.request.emit(CompletionDelta(index=seq.index, error=error))
        self.scheduler.abort(seq)

    def fail_all(self, error: ServiceError) -> None:
        for seq in self.scheduler.sequences():
            if not seq.is_finished:
                self.fail(seq, error)

    def abandon_in_flight(self) -> None:
        """A bug interrupted a step, or the executor is gone: the batches in flight are not
        awaited (the caller fails or evicts their sequences and releases them)."""
        while self.in_flight:
            flight = self.in_flight.popleft()
            self.scheduler.land(flight.batch)
            # Its releases may not have been applied: they go again (releasing is idempotent).
            self.scheduler.pending.release_ids.extend(flight.batch.call.release_request_ids)
            flight.execute.add_done_callback(retrieve)
            flight.execute.cancel()


def retrieve(future: asyncio.Future[Any]) -> None:
    """Mark an abandoned call's failure as seen (asyncio would log it as never retrieved)."""
    if not future.cancelled():
        future.exception()
