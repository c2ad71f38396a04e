"""What the scheduler carries from one call of a step to the next (plain records)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from common.step_records import StepCall
from gateway.core.request_state import Sequence
from gateway.core.step import ExecuteCall, ExecuteResult


@dataclass(frozen=True, slots=True)
class Budget:
    max_num_seqs: int
    max_num_batched_tokens: int


@dataclass(slots=True)
class Pending:
    """Work that rides on the next allocator call (commits, frees, aborts) or Execute."""

    commits: dict[str, int] = field(default_factory=dict)
    free_request_ids: list[str] = field(default_factory=list)
    abort_request_ids: list[str] = field(default_factory=list)
    release_ids: list[str] = field(default_factory=list)
    # The newest step whose batch executed (landed with its tokens): every Step, and an idle
    # engine's Free, says "commit every step up to it" (idempotent). A failed batch's steps
    # are covered by a later one too: its sequences are failed, recomputed or evicted, which
    # aborts them at the allocator first, and an aborted request is never committed.
    executed_through: int = 0
    sent_through: int = 0  # the newest executed_through an allocator call has carried
    # The newest step whose batch failed or was abandoned. Once nothing executes it is
    # confirmed like an executed one (`confirm_failed`): its requests were aborted first, and
    # the allocator gives back the blocks it held for that step's copies.
    failed_through: int = 0

    def confirm_failed(self) -> None:
        """Nothing executes now: the failed steps count as through too."""
        self.executed_through = max(self.executed_through, self.failed_through)

    def has_allocator_work(self) -> bool:
        return bool(
            self.commits or self.free_request_ids or self.abort_request_ids
            or self.executed_through > self.sent_through
        )


@dataclass(slots=True)
class ScheduledStep:
    """A planned step: the allocator call and the sequences of its items."""

    call: StepCall
    seqs: dict[str, Sequence]
    # The sequences whose token values the call carries, and how many each.
    appends: list[tuple[Sequence, int]] = field(default_factory=list)
    # Speculative decoding: the drafts proposed for its items' sequences, and the sequences
    # whose accepted drafts the call counts.
    drafts: dict[str, tuple[int, ...]] = field(default_factory=dict)
    accepts: list[Sequence] = field(default_factory=list)


@dataclass(slots=True)
class Batch:
    """A granted step: the Execute call and how many tokens each sequence computes.

    The first `num_decodes` of `scheduled` are the call's compact decodes, in column order;
    the rest are its `seqs`, in order."""

    call: ExecuteCall
    scheduled: list[tuple[Sequence, int]]
    step_id: int = 0  # the Step that granted it
    num_decodes: int = 0
    # Swapped out by this step: their KV reaches the CPU blocks only with this Execute.
    swapped_out: list[Sequence] = field(default_factory=list)
    # Once advanced (Scheduler.advance): each sequence it samples for (which holds a
    # placeholder for that token until the batch lands) and its row in the batch. None before.
    stand_ins: list[tuple[Sequence, int]] | None = None


@dataclass(slots=True)
class InFlight:
    """A batch whose Execute is out: the next step is planned and allocated meanwhile."""

    batch: Batch
    execute: asyncio.Future[ExecuteResult]
    launched: float  # time.perf_counter() when the call went out
    step_id: int = 0  # its number at the executor (0: not numbered)
    # The batch launched before it failed: this one, which may build on it (sampled tokens),
    # may fail too, so the next is not launched before it lands.
    after_failure: bool = False
    # The step that built it (ms): the scheduler's share, the Step's round trip; and whether
    # it went out while another batch was in flight (then it waits for that one too).
    schedule_ms: float = 0.0
    allocator_ms: float = 0.0
    ahead: bool = False


@dataclass(slots=True)
class Landed:
    """A batch whose Execute returned: its result, round trip (ms) and sampled tokens."""

    flight: InFlight  # what it was while in flight (its step's timings)
    result: ExecuteResult
    execute_ms: float
    sampled: list[tuple[Sequence, int]]

    @property
    def batch(self) -> Batch:
        return self.flight.batch
