"""The scheduler of one executor's pool: its queues, and which sequences run in the next step.
Plain Python: no gRPC, no tokenizer, no clock.

One step is three calls, made by the engine in this order:

    plan = scheduler.schedule()               # -> StepCall for the allocator (None: idle)
    batch = scheduler.apply_outcome(plan, o)  # allocator's answer -> ExecuteCall
    sampled = scheduler.apply_result(batch, r)  # executor's answer -> (sequence, token) pairs

Pipelined, step k+1 is planned while batch k executes (`launch` marks it), so the calls
interleave: schedule(k+1), apply_result(k), apply_outcome(k+1), launch(k+1). With sampled
tokens (the executor uses its own), batch k+1 goes out before batch k returns: apply_result
splits into `advance` (counts; UNSAMPLED stand-ins for the tokens) and `fill` (the values):
schedule(k+1), advance(k), apply_outcome(k+1), launch(k+1), fill(k).

The first is planned in step_plan.py, the second applied in step_outcome.py; this module owns
the state they work on and the lifecycle of sequences (add, finish, abort, fork, evict).
Commits, frees, aborts and executor releases accumulate in `pending` and ride on the next
calls.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from gateway.batch import Batch, Budget, Pending, ScheduledStep
from gateway.request_state import UNSAMPLED, SeqStatus, Sequence
from gateway.step import ExecuteResult, StepOutcome, TableDelta
from gateway.step_outcome import apply_outcome
from gateway.step_plan import plan_step


@dataclass(slots=True)
class Scheduler:
    budget: Budget
    block_size: int
    swap: bool = False
    waiting: deque[Sequence] = field(default_factory=deque)
    running: list[Sequence] = field(default_factory=list)
    swapped: list[Sequence] = field(default_factory=list)
    pending: Pending = field(default_factory=Pending)
    num_preemptions: int = 0
    num_advanced: int = 0  # batches advanced and not landed: their stand-ins are out

    def add(self, seq: Sequence, front: bool = False) -> None:
        seq.status = SeqStatus.WAITING
        if front:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    @property
    def num_unfinished(self) -> int:
        return sum(
            1 for q in (self.waiting, self.running, self.swapped) for s in q if not s.is_finished
        )

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def sequences(self) -> list[Sequence]:
        return [s for q in (self.running, self.swapped, self.waiting) for s in q]

    # One step.
    def schedule(self, in_flight: bool = False) -> ScheduledStep | None:
        """The step's items under the budgets; None when there is nothing to send.
        `in_flight`: planned while the previous batch executes (pipelined)."""
        assert not self.num_advanced, "planning with stand-ins out: they would reach the allocator"
        self._compact()
        return plan_step(self, in_flight)

    def apply_outcome(self, step: ScheduledStep, outcome: StepOutcome) -> Batch:
        """Apply the allocator's grants, preemptions and deferrals; build the Execute call."""
        return apply_outcome(self, step, outcome)

    def apply_result(self, batch: Batch, result: ExecuteResult) -> list[tuple[Sequence, int]]:
        """Advance computed counts; return the sampled (sequence, token) pairs: the compact
        decodes first (column order), then the other sequences in schedule order."""
        if batch.stand_ins is None:
            self.advance(batch)
        return self.fill(batch, result)

    def advance(self, batch: Batch) -> None:
        """The batch's computed counts, as if it had returned, with an UNSAMPLED stand-in for
        each token it samples (`fill` puts the values in). This also lands it: the next batch
        is built on top of it. A sequence finished while it executed is left alone."""
        executed = self.pending.executed
        stand_ins: list[tuple[Sequence, int, int]] = []
        num_decodes, works = batch.num_decodes, batch.call.seqs
        for row, (seq, num) in enumerate(batch.scheduled):
            seq.num_in_flight = 0
            seq.samples_in_flight = False
            if seq.status is SeqStatus.FINISHED:
                continue
            seq.num_computed_tokens += num
            executed[seq.seq_id] = seq.num_computed_tokens
            if row < num_decodes or works[row - num_decodes].sample:
                outputs = seq.output_token_ids
                stand_ins.append((seq, len(outputs), row))
                outputs.append(UNSAMPLED)
        batch.stand_ins = stand_ins
        self.num_advanced += 1

    def fill(self, batch: Batch, result: ExecuteResult) -> list[tuple[Sequence, int]]:
        """Put the sampled values in place of the advanced batch's stand-ins; the (sequence,
        token) pairs in batch order, but for sequences that finished since."""
        assert batch.stand_ins is not None, "fill before advance"
        self.num_advanced -= 1
        decoded, num_decodes = result.decode_token_ids, batch.num_decodes
        tokens = {t.request_id: t.token_id for t in result.tokens} if result.tokens else {}
        sampled: list[tuple[Sequence, int]] = []
        for seq, index, row in batch.stand_ins:
            token = decoded[row] if row < num_decodes else tokens[seq.seq_id]
            seq.output_token_ids[index] = token
            if seq.status is not SeqStatus.FINISHED:
                sampled.append((seq, token))
        return sampled

    def launch(self, batch: Batch) -> None:
        """The batch is executing: the next step plans on top of it (pipelined)."""
        for seq, num in batch.scheduled:
            seq.num_in_flight = num
            seq.samples_in_flight = (
                not seq.is_prefill_parent and seq.num_computed_tokens + num == seq.num_tokens
            )

    def land(self, batch: Batch) -> None:
        """The batch failed or is abandoned: it is no longer executing, and an advanced one's
        stand-ins are taken out (its sequences are failed, recomputed or evicted next, so
        its counts do not matter)."""
        if batch.stand_ins is None:
            for seq, _ in batch.scheduled:
                seq.num_in_flight = 0
                seq.samples_in_flight = False
            return
        for seq, index, _ in batch.stand_ins:
            assert seq.output_token_ids[index:] == [UNSAMPLED], f"{seq.seq_id}: stand-in moved"
            del seq.output_token_ids[index]
        batch.stand_ins = None  # (landing it again is harmless)
        self.num_advanced -= 1

    def ready_to_fork(self, batch: Batch) -> list[Sequence]:
        """Prefill parents (n > 1) whose shared prompt is now computed."""
        return [
            s for s, _ in batch.scheduled
            if s.is_prefill_parent and s.num_uncomputed_tokens == 0 and not s.is_finished
        ]

    # Lifecycle.
    def finish(self, seq: Sequence) -> None:
        """The sequence is done: free it at the allocator and release it at the executor."""
        if seq.is_finished:
            return
        seq.status = SeqStatus.FINISHED
        if seq.known_to_allocator:
            self.pending.commits[seq.seq_id] = seq.num_computed_tokens
            self.pending.free_ids.append(seq.seq_id)
            seq.known_to_allocator = False
        self.release(seq)

    def abort(self, seq: Sequence) -> None:
        """Cancelled: abort at the allocator, release at the executor; nothing is committed."""
        if seq.is_finished:
            return
        seq.status = SeqStatus.FINISHED
        self.pending.commits.pop(seq.seq_id, None)
        self.pending.executed.pop(seq.seq_id, None)
        if seq.known_to_allocator:
            self.pending.abort_ids.append(seq.seq_id)
            seq.known_to_allocator = False
        self.release(seq)

    def forget_freed(self, seq: Sequence) -> None:
        """The allocator has freed the sequence on its own (a recompute preemption): nothing
        queued for it may reach the allocator (it would name an unknown request)."""
        pending = self.pending
        pending.commits.pop(seq.seq_id, None)
        pending.executed.pop(seq.seq_id, None)
        for ids in (pending.free_ids, pending.abort_ids):
            if seq.seq_id in ids:
                ids.remove(seq.seq_id)

    def recompute(self, seq: Sequence) -> None:
        """Start the sequence over at the queue front (its step was lost): the allocator aborts
        what it holds (nothing is committed), the executor releases it."""
        pending = self.pending
        pending.commits.pop(seq.seq_id, None)
        pending.executed.pop(seq.seq_id, None)
        if seq.known_to_allocator:
            pending.abort_ids.append(seq.seq_id)
        self.release(seq)
        for queue in (self.running, self.swapped, self.waiting):
            if seq in queue:
                queue.remove(seq)
        seq.reset_for_recompute()
        self.add(seq, front=True)

    def release(self, seq: Sequence) -> None:
        """Drop the sequence's executor state with the next Execute (or Release)."""
        if seq.known_to_executor:
            self.pending.release_ids.append(seq.seq_id)
            seq.known_to_executor = False

    def fork(self, parent: Sequence, children: list[Sequence], tables: list[TableDelta]) -> None:
        """Replace a computed prefill parent by its children, which share its blocks."""
        assert len(children) == len(tables), "one table per child"
        for child, table in zip(children, tables, strict=True):
            child.status = SeqStatus.RUNNING
            child.known_to_allocator = True
            child.num_allocator_tokens = parent.num_tokens
            child.num_computed_tokens = parent.num_computed_tokens
            table.apply(child.block_table)
        position = self.running.index(parent)
        self.running[position + 1 : position + 1] = children
        self.finish(parent)

    def evict_all(self) -> list[Sequence]:
        """The allocator forgot our requests, or the executor is gone: every unfinished
        sequence, reset for recompute. Releases stay queued (and every sequence the executor
        held joins them): executor state is dropped whatever happened at the allocator."""
        seqs = [s for s in self.sequences() if not s.is_finished]
        releases = self.pending.release_ids
        releases.extend(s.seq_id for s in seqs if s.known_to_executor)
        for seq in seqs:
            seq.reset_for_recompute()
            seq.known_to_executor = False
        self.waiting.clear()
        self.running.clear()
        self.swapped.clear()
        self.pending = Pending(release_ids=releases)
        return seqs

    def _compact(self) -> None:
        if any(s.is_finished for s in self.running):
            self.running = [s for s in self.running if not s.is_finished]
        if any(s.is_finished for s in self.waiting):
            self.waiting = deque(s for s in self.waiting if not s.is_finished)
        if any(s.is_finished for s in self.swapped):
            self.swapped = [s for s in self.swapped if not s.is_finished]
