"""Applying the allocator's answer to a planned step: grants, preemptions and deferrals move
sequences between the queues, and what was granted becomes the Execute call. The second of
the scheduler's calls in a step (scheduler.py). A row whose token is an UNSAMPLED stand-in
(launched ahead) goes with use_sampled_token.

The allocator preempts from the tail of the step's order when its pool is short and never
admits new requests in a step that preempted; a recompute preemption sends the sequence back
to the queue front (prompt + generated tokens), a swap keeps it aside for swap-in.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gateway.batch import Batch, ScheduledStep
from gateway.request_state import UNSAMPLED, SeqStatus, Sequence, priority
from gateway.step import ExecuteCall, SeqWork, StepCall, StepItem, StepOutcome, TableDelta

if TYPE_CHECKING:
    from gateway.scheduler import Scheduler


def apply_outcome(sched: Scheduler, step: ScheduledStep, outcome: StepOutcome) -> Batch:
    """Apply the allocator's grants, preemptions and deferrals; build the Execute call."""
    for seq in step.late:  # the allocator now holds these values
        if seq.known_to_allocator and seq.allocator_pending:
            seq.num_allocator_tokens += 1
            seq.allocator_pending = False
    swapped_out = _apply_preemptions(sched, step, outcome)
    skipped = outcome.deferred_request_ids | {p.request_id for p in outcome.preempted}
    admitted: set[Sequence] = set()
    work: list[SeqWork] = []
    scheduled: list[tuple[Sequence, int]] = []
    decodes = _DecodeColumns()
    block_size = sched.block_size
    grants, appended_blocks = outcome.grants, outcome.appended
    for request_id, item in _rows(step.call):
        seq = step.seqs[request_id]
        is_new = item is not None and item.is_new
        if not is_new and seq.known_to_allocator:
            # The allocator applies appends before scheduling: even when the item is then
            # deferred or swapped out, the tokens are recorded there.
            seq.num_allocator_tokens += 1 if item is None else len(item.append_token_ids)
        if request_id in skipped or seq.status is SeqStatus.FINISHED:
            continue
        if not is_new and not seq.known_to_allocator:
            continue  # started over since the plan (its batch was lost): readmitted later
        if item is _PENDING_DECODE:
            seq.allocator_pending = True  # its value goes with the next Step
        if (
            (item is None or item is _PENDING_DECODE) and seq.status is SeqStatus.RUNNING
            and request_id not in grants and request_id not in appended_blocks
            and _is_plain_decode(seq, seq.num_computed_tokens, 1, None)
        ):
            # Most rows of a busy step: a decode row with nothing granted or appended, and
            # plain, skips the general path below (bench.scheduler_phases: apply_outcome at
            # 256 running decodes, 0.36 -> 0.2 ms in process).
            decodes.add(seq, seq.num_computed_tokens)
            continue
        grant = grants.get(request_id)
        if is_new:
            assert item is not None and grant is not None, (
                f"new request {request_id} granted without a grant"
            )
            seq.known_to_allocator = True
            seq.num_allocator_tokens = len(item.prompt_token_ids)
            seq.num_computed_tokens = grant.start_position
            if seq.request.num_cached_tokens is None:
                seq.request.num_cached_tokens = grant.num_cached_tokens
            admitted.add(seq)
            sched.running.append(seq)
        elif seq.status is SeqStatus.SWAPPED:
            sched.swapped.remove(seq)
            sched.running.append(seq)
        seq.status = SeqStatus.RUNNING
        delta = grant.delta if grant is not None else None
        appended = appended_blocks.get(request_id)
        if appended is not None:
            assert len(seq.block_table) * block_size == seq.num_computed_tokens, (
                f"{seq.seq_id}: a block appended to a table that does not end at a boundary"
            )
            delta = TableDelta(len(seq.block_table), (appended,))
        if delta is not None:
            delta.apply(seq.block_table)
        num = (
            grant.num_scheduled_tokens
            if grant is not None
            else min(1 if item is None else item.num_tokens, seq.num_uncomputed_tokens)
        )
        start = grant.start_position if grant is not None else seq.num_computed_tokens
        assert start == seq.num_computed_tokens, (
            f"{seq.seq_id}: allocator starts at {start}, gateway holds "
            f"{seq.num_computed_tokens} computed tokens"
        )
        if num == 0:
            continue
        if _is_plain_decode(seq, start, num, delta):
            decodes.add(seq, start)
            continue
        work.append(_seq_work(seq, start, num, delta))
        scheduled.append((seq, num))
    if admitted:
        sched.waiting = deque(s for s in sched.waiting if s not in admitted)
    call = ExecuteCall(
        release_request_ids=tuple(sched.pending.release_ids),
        swap_out=outcome.swap_out,
        swap_in=outcome.swap_in,
        copies=outcome.copies,
        seqs=tuple(work),
        decode_request_ids=tuple(decodes.request_ids),
        decode_token_ids=tuple(decodes.token_ids),
        decode_positions=tuple(decodes.positions),
        decode_use_sampled_token=tuple(decodes.use_sampled) if decodes.num_unsampled else (),
    )
    sched.pending.release_ids.clear()
    return Batch(call=call, scheduled=[*decodes.scheduled, *scheduled],
                 num_decodes=len(decodes.scheduled), swapped_out=swapped_out)


# The row of a pending decode: one token scheduled, none appended (its value is late).
_PENDING_DECODE = StepItem("", 1)


def _rows(call: StepCall) -> Iterator[tuple[str, StepItem | None]]:
    """The step's requests in priority order with their item; None for a compact decode
    (one token appended, one scheduled), _PENDING_DECODE for a pending one."""
    for request_id in call.decode_request_ids:
        yield request_id, None
    for request_id in call.pending_decode_request_ids:
        yield request_id, _PENDING_DECODE
    for item in call.items:
        yield item.request_id, item


@dataclass(slots=True)
class _DecodeColumns:
    """The compact decodes of one Execute call, built column by column."""

    request_ids: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    use_sampled: list[bool] = field(default_factory=list)
    num_unsampled: int = 0
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)

    def add(self, seq: Sequence, start: int) -> None:
        token = seq.last_token_id
        unsampled = token == UNSAMPLED  # the executor has it: the batch before sampled it
        self.request_ids.append(seq.seq_id)
        self.token_ids.append(0 if unsampled else token)
        self.positions.append(start)
        self.use_sampled.append(unsampled)
        self.num_unsampled += unsampled
        self.scheduled.append((seq, 1))


def _is_plain_decode(seq: Sequence, start: int, num: int, delta: TableDelta | None) -> bool:
    """One token, the sequence's last, sampled; no table change; the executor holds it."""
    return (
        num == 1 and delta is None and seq.known_to_executor and not seq.is_prefill_parent
        and start + 1 == seq.num_tokens
    )


def _apply_preemptions(
    sched: Scheduler, step: ScheduledStep, outcome: StepOutcome
) -> list[Sequence]:
    """Move the preempted sequences; returns the ones swapped out."""
    if not outcome.preempted:
        return []
    by_id = {s.seq_id: s for s in sched.running}
    recomputed: list[Sequence] = []
    swapped_out: list[Sequence] = []
    for preemption in outcome.preempted:
        seq = by_id.get(preemption.request_id) or step.seqs.get(preemption.request_id)
        assert seq is not None, f"allocator preempted unknown {preemption.request_id}"
        sched.num_preemptions += 1
        if seq.is_finished:
            # It ended while its batch executed, after this Step was planned (pipelined).
            if not preemption.swapped:
                sched.forget_freed(seq)  # the allocator freed it already
            continue
        if seq.status is SeqStatus.WAITING and not seq.known_to_allocator:
            # Started over since the plan (Scheduler.recompute): queued already, its abort
            # pending; a recompute preemption has freed it at the allocator instead.
            if not preemption.swapped:
                sched.forget_freed(seq)
            continue
        if seq in sched.running:
            sched.running.remove(seq)
        if preemption.swapped:
            seq.status = SeqStatus.SWAPPED
            seq.block_table.clear()
            sched.swapped.append(seq)
            swapped_out.append(seq)
            continue
        if seq in sched.swapped:
            sched.swapped.remove(seq)
        sched.forget_freed(seq)  # e.g. the count its batch in flight executed (pipelined)
        seq.reset_for_recompute()
        sched.release(seq)
        recomputed.append(seq)
    sched.swapped.sort(key=priority)
    # The earliest preempted sequence goes first: the queue front keeps FCFS order.
    for seq in sorted(recomputed, key=priority, reverse=True):
        sched.add(seq, front=True)
    return swapped_out


def _seq_work(seq: Sequence, start: int, num: int, delta: TableDelta | None) -> SeqWork:
    first = not seq.known_to_executor
    seq.known_to_executor = True
    token_ids = seq.token_slice(start, start + num)
    # A stand-in is the sequence's last token, so it can only open the row.
    unsampled = token_ids[0] == UNSAMPLED
    assert not first or not unsampled, f"{seq.seq_id}: a stand-in sent to a new executor"
    assert UNSAMPLED not in token_ids[1:], f"{seq.seq_id}: a stand-in inside a row"
    return SeqWork(
        request_id=seq.seq_id,
        token_ids=(0, *token_ids[1:]) if unsampled else tuple(token_ids),
        start_position=start,
        delta=TableDelta(0, tuple(seq.block_table)) if first else delta,
        sample=not seq.is_prefill_parent and start + num == seq.num_tokens,
        sampling=seq.exec_sampling() if first else None,
        use_sampled_token=unsampled,
    )

