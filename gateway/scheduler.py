"""The scheduler of one executor's pool: which sequences run in the next step, and how many
tokens each computes. Plain Python: no gRPC, no tokenizer, no clock.

One step is three calls, made by the engine in this order:

    plan = scheduler.schedule()               # -> StepCall for the allocator (None: idle)
    batch = scheduler.apply_outcome(plan, o)  # allocator's answer -> ExecuteCall
    sampled = scheduler.apply_result(batch, r)  # executor's answer -> (sequence, token) pairs

Priority is FCFS: running sequences first (one decode token each, or their next prefill
chunk), then swapped ones (swap-in), then waiting ones (prefill, chunked when the token budget
is short). The allocator preempts from the tail of that order when its pool is short and never
admits new requests in a step that preempted. Commits, frees, aborts and executor releases
accumulate in `pending` and ride on the next calls.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from gateway.batch import Batch, Budget, Pending, ScheduledStep
from gateway.request_state import SeqStatus, Sequence
from gateway.step import (
    Commit,
    ExecuteCall,
    ExecuteResult,
    SeqWork,
    StepCall,
    StepItem,
    StepOutcome,
    TableDelta,
)


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

    # ---- queues -------------------------------------------------------------------------

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

    # ---- one step -----------------------------------------------------------------------

    def schedule(self) -> ScheduledStep | None:
        """Choose the step's items under the budgets; None when there is nothing to run.

        NOTE: running decodes go first, then running prefill chunks, swapped and new
        requests: decodes travel in the allocator's compact form, which comes before the
        other items. Under pressure, an old request still prefilling in chunks can therefore
        be preempted before a newer decoding one (vLLM V1 orders purely by arrival).
        """
        self._compact()
        tokens_left = self.budget.max_num_batched_tokens
        seqs_left = self.budget.max_num_seqs
        decodes: list[StepItem] = []
        items: list[StepItem] = []
        seqs: dict[str, Sequence] = {}
        for seq in [*self.running, *self.swapped]:
            if seqs_left == 0 or tokens_left == 0:
                break
            num = min(seq.num_uncomputed_tokens, tokens_left)
            if num == 0:
                continue
            append = tuple(seq.token_slice(seq.num_allocator_tokens))
            item = StepItem(seq.seq_id, num, append_token_ids=append)
            is_decode = num == 1 and len(append) == 1 and seq.status is SeqStatus.RUNNING
            (decodes if is_decode else items).append(item)
            seqs[seq.seq_id] = seq
            tokens_left -= num
            seqs_left -= 1
        # Swapped sequences are older than any waiting one: admit nothing new before them.
        for seq in self.waiting if not self.swapped else ():
            if seqs_left == 0 or tokens_left == 0:
                break
            num = min(seq.num_tokens, tokens_left)
            items.append(
                StepItem(
                    seq.seq_id, num, prompt_token_ids=tuple(seq.token_ids),
                    cache_salt=seq.request.cache_salt, is_new=True,
                )
            )
            seqs[seq.seq_id] = seq
            tokens_left -= num
            seqs_left -= 1
        pending = self.pending
        if not decodes and not items and not pending.has_allocator_work():
            return None
        commit_previous = bool(decodes or items) and bool(pending.executed)
        if not commit_previous:
            for request_id, num_computed in pending.executed.items():
                pending.commits.setdefault(request_id, num_computed)
        call = StepCall(
            commits=tuple(Commit(k, v) for k, v in pending.commits.items()),
            free_request_ids=tuple(pending.free_ids),
            abort_request_ids=tuple(pending.abort_ids),
            items=(*decodes, *items),
            swap=self.swap,
            commit_previous_step=commit_previous,
            num_decodes=len(decodes),
        )
        executed = dict(pending.executed) if commit_previous else {}
        pending.executed.clear()
        pending.commits.clear()
        pending.free_ids.clear()
        pending.abort_ids.clear()
        return ScheduledStep(call=call, seqs=seqs, executed=executed)

    def apply_outcome(self, step: ScheduledStep, outcome: StepOutcome) -> Batch:
        """Apply the allocator's grants, preemptions and deferrals; build the Execute call."""
        self._apply_preemptions(step, outcome)
        skipped = outcome.deferred_request_ids | {p.request_id for p in outcome.preempted}
        admitted: set[Sequence] = set()
        work: list[SeqWork] = []
        scheduled: list[tuple[Sequence, int]] = []
        for item in step.call.items:
            seq = step.seqs[item.request_id]
            if not item.is_new and seq.known_to_allocator:
                # The allocator applies appends before scheduling: even when the item is then
                # deferred or swapped out, the tokens are recorded there.
                seq.num_allocator_tokens += len(item.append_token_ids)
            if item.request_id in skipped or seq.is_finished:
                continue
            grant = outcome.grants.get(item.request_id)
            if item.is_new:
                assert grant is not None, f"new request {item.request_id} granted without a grant"
                seq.known_to_allocator = True
                seq.num_allocator_tokens = len(item.prompt_token_ids)
                seq.num_computed_tokens = grant.start_position
                if seq.request.num_cached_tokens is None:
                    seq.request.num_cached_tokens = grant.num_cached_tokens
                admitted.add(seq)
                self.running.append(seq)
            elif seq.status is SeqStatus.SWAPPED:
                self.swapped.remove(seq)
                self.running.append(seq)
            seq.status = SeqStatus.RUNNING
            if grant is not None and grant.delta is not None:
                grant.delta.apply(seq.block_table)
            num = (
                grant.num_scheduled_tokens
                if grant is not None
                else min(item.num_tokens, seq.num_uncomputed_tokens)
            )
            start = grant.start_position if grant is not None else seq.num_computed_tokens
            assert start == seq.num_computed_tokens, (
                f"{seq.seq_id}: allocator starts at {start}, gateway holds "
                f"{seq.num_computed_tokens} computed tokens"
            )
            if num == 0:
                continue
            work.append(self._seq_work(seq, start, num, grant.delta if grant else None))
            scheduled.append((seq, num))
        if admitted:
            self.waiting = deque(s for s in self.waiting if s not in admitted)
        call = ExecuteCall(
            release_request_ids=tuple(self.pending.release_ids),
            swap_out=outcome.swap_out,
            swap_in=outcome.swap_in,
            copies=outcome.copies,
            seqs=tuple(work),
        )
        self.pending.release_ids.clear()
        return Batch(call=call, scheduled=scheduled)

    def apply_result(self, batch: Batch, result: ExecuteResult) -> list[tuple[Sequence, int]]:
        """Advance computed counts; return the sampled (sequence, token) pairs in order."""
        tokens = {t.request_id: t.token_id for t in result.tokens}
        sampled: list[tuple[Sequence, int]] = []
        executed = self.pending.executed
        for seq, num in batch.scheduled:
            seq.num_computed_tokens += num
            executed[seq.seq_id] = seq.num_computed_tokens
            token = tokens.get(seq.seq_id)
            if token is not None:
                seq.output_token_ids.append(token)
                sampled.append((seq, token))
        return sampled

    def ready_to_fork(self, batch: Batch) -> list[Sequence]:
        """Prefill parents (n > 1) whose shared prompt is now computed."""
        return [
            s for s, _ in batch.scheduled
            if s.is_prefill_parent and s.num_uncomputed_tokens == 0 and not s.is_finished
        ]

    # ---- lifecycle ----------------------------------------------------------------------

    def finish(self, seq: Sequence) -> None:
        """The sequence is done: free it at the allocator and release it at the executor."""
        if seq.is_finished:
            return
        seq.status = SeqStatus.FINISHED
        if seq.known_to_allocator:
            self.pending.commits[seq.seq_id] = seq.num_computed_tokens
            self.pending.free_ids.append(seq.seq_id)
            seq.known_to_allocator = False
        self._release(seq)

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
        self._release(seq)

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

    # ---- internals ----------------------------------------------------------------------

    def _apply_preemptions(self, step: ScheduledStep, outcome: StepOutcome) -> None:
        if not outcome.preempted:
            return
        by_id = {s.seq_id: s for s in self.running}
        recomputed: list[Sequence] = []
        for preemption in outcome.preempted:
            seq = by_id.get(preemption.request_id) or step.seqs.get(preemption.request_id)
            assert seq is not None, f"allocator preempted unknown {preemption.request_id}"
            self.num_preemptions += 1
            if seq in self.running:
                self.running.remove(seq)
            if preemption.swapped:
                seq.status = SeqStatus.SWAPPED
                seq.block_table.clear()
                self.swapped.append(seq)
                continue
            if seq in self.swapped:
                self.swapped.remove(seq)
            seq.reset_for_recompute()
            self._release(seq)
            recomputed.append(seq)
        self.swapped.sort(key=_priority)
        # The earliest preempted sequence goes first: the queue front keeps FCFS order.
        for seq in sorted(recomputed, key=_priority, reverse=True):
            self.add(seq, front=True)

    def _seq_work(self, seq: Sequence, start: int, num: int, delta: TableDelta | None) -> SeqWork:
        first = not seq.known_to_executor
        seq.known_to_executor = True
        return SeqWork(
            request_id=seq.seq_id,
            token_ids=tuple(seq.token_slice(start, start + num)),
            start_position=start,
            delta=TableDelta(0, tuple(seq.block_table)) if first else delta,
            sample=not seq.is_prefill_parent and start + num == seq.num_tokens,
            sampling=seq.exec_sampling() if first else None,
        )

    def _release(self, seq: Sequence) -> None:
        if seq.known_to_executor:
            self.pending.release_ids.append(seq.seq_id)
            seq.known_to_executor = False

    def _compact(self) -> None:
        if any(s.is_finished for s in self.running):
            self.running = [s for s in self.running if not s.is_finished]
        if any(s.is_finished for s in self.waiting):
            self.waiting = deque(s for s in self.waiting if not s.is_finished)
        if any(s.is_finished for s in self.swapped):
            self.swapped = [s for s in self.swapped if not s.is_finished]


def _priority(seq: Sequence) -> tuple[float, int]:
    return (seq.request.arrival_time, seq.index)
