"""The scheduler of one executor's pool: its queues, and which sequences run in the next step.
Plain Python: no gRPC, no tokenizer; a clock only to stamp first admissions (queue time).

One step is three calls, made by the engine in this order:

    plan = scheduler.schedule()               # -> StepCall for the allocator (None: idle)
    batch = scheduler.apply_outcome(plan, o)  # allocator's answer -> ExecuteCall
    sampled = scheduler.apply_result(batch, r)  # executor's answer -> (sequence, token) pairs

At depth 2 the calls interleave: schedule(k+1), advance(k), apply_outcome(k+1), launch(k+1),
fill(k) (core/overlap.py, the scheduler's base class).

Planning (`schedule`) is in priority order under the budgets (`max_num_seqs`,
`max_num_batched_tokens`): running sequences first (one decode token each, or their next
prefill chunk), then swapped ones (swap-in), then waiting ones (prefill, chunked when the token
budget is short). Each queue is ordered by the requests' `priority` (lower first), FCFS among
equals; the allocator preempts from the tail of the step's order, so the running request of
the lowest priority (the highest value) goes first, as in vLLM.

Applying the allocator's answer (`apply_outcome`): grants, preemptions and deferrals move
sequences between the queues, and what was granted becomes the Execute call
(core/execute_call.py). The allocator preempts from the tail of the step's order when its
pool is short and never admits new requests in a step that preempted; a recompute preemption
sends the sequence back to the queue front (prompt + generated tokens), a swap keeps it aside
for swap-in. Tenants gate admissions (core/tenants.py).

Hand-off (engine/hand_off.py): planning parks the sequences to move (core/parking.py); they
leave (`detach`), arrive (`adopt`) or stay (`unpark`) here.

The scheduler also owns the lifecycle of sequences (add, finish, abort, fork, evict).
Commits, frees, aborts and executor releases accumulate in `pending` and ride on the next
calls.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from itertools import chain

from gateway.core.batch import Batch, Budget, Pending, ScheduledStep
from gateway.core.execute_call import ExecuteCallBuilder, is_plain_decode
from gateway.core.overlap import BatchLanding
from gateway.core.parking import Parking
from gateway.core.request_state import Request, SeqStatus, Sequence, priority
from gateway.core.step import (
    Commit,
    Grant,
    StepCall,
    StepItem,
    StepOutcome,
    TableDelta,
)
from gateway.core.tenants import TenantGate


@dataclass(slots=True)
class Scheduler(BatchLanding):
    budget: Budget
    block_size: int
    swap: bool = False
    waiting: deque[Sequence] = field(default_factory=deque)
    running: list[Sequence] = field(default_factory=list)
    swapped: list[Sequence] = field(default_factory=list)
    # Sequences set aside for their hand-off (core/parking.py).
    parking: Parking = field(default_factory=Parking)
    pending: Pending = field(default_factory=Pending)
    num_preemptions: int = 0
    num_advanced: int = 0  # batches advanced and not landed (overlap.py)
    # The next Step's number. Per engine, so per pool and lease at the allocator, which wants
    # them increasing: it never starts over (a new lease takes any increasing numbers).
    next_step_id: int = 1
    # Which waiting requests their tenants let start (core/tenants.py).
    tenants: TenantGate = field(default_factory=TenantGate)
    clock: Callable[[], float] = time.monotonic

    def add(self, seq: Sequence, front: bool = False) -> None:
        """Queue a sequence among the waiting ones of its priority: behind them (a new
        request), or in front of them (`front`: one preempted or moved, older than they)."""
        seq.status = SeqStatus.WAITING
        waiting, level = self.waiting, seq.request.sampling.priority
        if front:
            if not waiting or waiting[0].request.sampling.priority >= level:
                waiting.appendleft(seq)
                return
            at = next((i for i, s in enumerate(waiting) if s.request.sampling.priority >= level),
                      len(waiting))
        else:
            if not waiting or waiting[-1].request.sampling.priority <= level:
                waiting.append(seq)
                return
            at = next(i for i, s in enumerate(waiting) if s.request.sampling.priority > level)
        waiting.insert(at, seq)

    @property
    def num_unfinished(self) -> int:
        return sum(
            1 for q in (self.waiting, self.running, self.swapped, self.parking.parked) for s in q
            if not s.is_finished
        )

    def has_work(self) -> bool:
        """Something to schedule (parked sequences wait for their hand-off, not a step)."""
        return bool(self.waiting or self.running or self.swapped)

    def sequences(self) -> list[Sequence]:
        queues = (self.running, self.swapped, self.parking.parked, self.waiting)
        return [s for q in queues for s in q]

    # One step.
    def schedule(self, in_flight: bool = False) -> ScheduledStep | None:
        """The step's items under the budgets; None when there is nothing to send.
        `in_flight`: planned while the previous batch executes (depth 2)."""
        assert not self.num_advanced, "planning with placeholders out: the allocator needs values"
        self._compact()
        return self._plan(in_flight)

    def _plan(self, in_flight: bool) -> ScheduledStep | None:
        """Choose the step's items under the budgets; None when there is nothing to send.

        `in_flight`: the previous step's batch is still executing (depth 2). Each of its
        sequences that samples decodes the token being sampled (the allocator needs the
        count, not the value), unless that token is its last by length; the others plan on top
        of what the batch computes. Token values go to the allocator once each, when known
        (`appends`), whether or not the sequence is scheduled.

        NOTE: running decodes go first, then running prefill chunks, swapped and new
        requests: decodes travel in the allocator's decode column, which comes before the
        items. Under pressure, an old request still prefilling in chunks can therefore be
        preempted before a newer decoding one (vLLM V1 orders purely by arrival).
        """
        plan = _Plan(self.budget.max_num_batched_tokens, self.budget.max_num_seqs)
        leaving: AbstractSet[Sequence] = frozenset()
        if self.parking.move_quota:
            self.running, leaving = self.parking.park_leavers(self.running)
        self._plan_running(plan, leaving)
        if not self.swapped:  # swapped sequences are older than any waiting one: first
            self._plan_waiting(plan)
        return self._step_call(plan)

    def _plan_running(self, plan: _Plan, leaving: AbstractSet[Sequence]) -> None:
        """Running and swapped sequences: each sends the values the allocator lacks, and
        decodes (one more token), continues its prefill or comes back (swap-in)."""
        tokens_left, seqs_left = plan.tokens_left, plan.seqs_left
        decode_ids, items, seqs, appends = plan.decode_ids, plan.items, plan.seqs, plan.appends
        append_ids, append_values, appended = appends.request_ids, appends.token_ids, appends.rows
        for seq in [*self.running, *self.swapped]:
            if seq.known_to_allocator:
                sent = seq.num_allocator_tokens
                unsent = seq.num_tokens - seq.num_placeholders - sent
                if unsent == 1:  # most steps: the token the step before sampled (inlined)
                    append_ids.append(seq.seq_id)
                    append_values.append(seq.token_at(sent))
                    appended.append((seq, 1))
                elif unsent > 0:
                    appends.add(seq, sent)
            if seqs_left == 0 or tokens_left == 0:
                continue
            ahead = seq.num_in_flight
            if leaving and seq in leaving:
                continue  # parked once it lands: no decode planned on top of it
            if ahead and seq.samples_in_flight:
                # A beam's next token is its search's pick, once the batch lands (depth 1).
                if not _samples_its_last(seq) and not seq.is_beam:
                    decode_ids.append(seq.seq_id)
                    seqs[seq.seq_id] = seq
                    tokens_left -= 1
                    seqs_left -= 1
                continue
            num = min(seq.num_uncomputed_tokens - ahead, tokens_left)
            if num <= 0:
                continue
            if num == 1 and seq.status is SeqStatus.RUNNING:
                decode_ids.append(seq.seq_id)
            else:
                items.append(StepItem(seq.seq_id, num))
            seqs[seq.seq_id] = seq
            tokens_left -= num
            seqs_left -= 1
        plan.tokens_left, plan.seqs_left = tokens_left, seqs_left

    def _plan_waiting(self, plan: _Plan) -> None:
        """Waiting sequences their tenants let start, in order: admission (the prompt, or
        prompt and outputs after a recompute), chunked when the token budget is short."""
        admission = self.tenants.admission(chain(self.running, self.swapped, self.parking.parked))
        for seq in self.waiting:
            if plan.seqs_left == 0 or plan.tokens_left == 0:
                break
            request = seq.request
            if not admission.admits(request):
                continue
            num = min(seq.num_tokens, plan.tokens_left)
            plan.items.append(
                StepItem(
                    seq.seq_id, num, prompt_token_ids=tuple(seq.token_ids),
                    cache_salt=request.cache_salt, is_new=True, tenant=request.tenant,
                    resumed=seq.num_preemptions > 0,
                )
            )
            plan.seqs[seq.seq_id] = seq
            plan.tokens_left -= num
            plan.seqs_left -= 1

    def _step_call(self, plan: _Plan) -> ScheduledStep | None:
        """The Step of the plan with what rides on it (commits, frees, aborts); None when
        there is nothing to send."""
        pending = self.pending
        has_items = bool(plan.decode_ids or plan.items)
        if not has_items and not pending.has_allocator_work():
            return None
        step_id = 0
        if has_items:
            step_id = self.next_step_id
            self.next_step_id += 1
        appends = plan.appends
        call = StepCall(
            commits=tuple(Commit(k, v) for k, v in pending.commits.items()),
            free_request_ids=tuple(pending.free_ids),
            abort_request_ids=tuple(pending.abort_ids),
            items=tuple(plan.items),
            swap=self.swap,
            decode_request_ids=tuple(plan.decode_ids),
            # (Only a Step carries values: an idle engine's housekeeping goes as Free.)
            append_request_ids=tuple(appends.request_ids) if has_items else (),
            append_token_ids=tuple(appends.token_ids) if has_items else (),
            step_id=step_id,
            commit_through_step_id=pending.executed_through,
        )
        pending.sent_through = pending.executed_through
        pending.commits.clear()
        pending.free_ids.clear()
        pending.abort_ids.clear()
        return ScheduledStep(call=call, seqs=plan.seqs, appends=appends.rows if has_items else [])

    def apply_outcome(self, step: ScheduledStep, outcome: StepOutcome) -> Batch:
        """Apply the allocator's grants, preemptions and deferrals; build the Execute call."""
        for seq, num in step.appends:  # the allocator now holds these values
            if seq.known_to_allocator:
                seq.num_allocator_tokens += num
        swapped_out = self._apply_preemptions(step, outcome)
        skipped = outcome.deferred_request_ids | {p.request_id for p in outcome.preempted}
        if outcome.deferred_request_ids:
            self.tenants.note_deferrals(
                [(i.request_id, step.seqs[i.request_id].request.tenant)
                 for i in step.call.items if i.is_new],
                outcome.deferred_request_ids,
                {s.request.tenant for s in (*self.running, *self.swapped)})
            self._note_beams_deferred(step, outcome.deferred_request_ids)
        execute = ExecuteCallBuilder()
        admitted: set[Sequence] = set()
        moved = False  # admitted or swapped in: the running queue is sorted again
        grants, appended_blocks = outcome.grants, outcome.appended
        for request_id, item in _rows(step.call):
            seq = step.seqs[request_id]
            if request_id in skipped or seq.status is SeqStatus.FINISHED:
                continue
            if (item is None or not item.is_new) and not seq.known_to_allocator:
                continue  # started over since the plan (its batch was lost): readmitted later
            if (
                item is None and seq.status is SeqStatus.RUNNING
                and request_id not in grants and request_id not in appended_blocks
                and is_plain_decode(seq, seq.num_computed_tokens, 1, None)
            ):
                # Most rows of a busy step: a decode row with nothing granted or appended, and
                # plain, skips the general path below (bench.scheduler_phases: apply_outcome at
                # 256 running decodes, 0.36 -> 0.2 ms in process).
                execute.add_decode(seq, seq.num_computed_tokens)
                continue
            moved |= self._grant(seq, item, grants.get(request_id),
                                 appended_blocks.get(request_id), execute, admitted)
        if admitted:
            self.waiting = deque(s for s in self.waiting if s not in admitted)
        if moved:
            # Stable: among equal priorities the order stays as it was (FCFS).
            self.running.sort(key=_priority_level)
        call = execute.build(self.pending.release_ids, outcome.swap_out, outcome.swap_in,
                             outcome.copies)
        self.pending.release_ids.clear()
        return Batch(call=call, scheduled=execute.rows, step_id=step.call.step_id,
                     num_decodes=len(execute.decoded), swapped_out=swapped_out)

    def _grant(self, seq: Sequence, item: StepItem | None, grant: Grant | None,
               appended: int | None, execute: ExecuteCallBuilder,
               admitted: set[Sequence]) -> bool:
        """A granted row the general way (an admission, a swap-in, a table change, a chunk)
        into the Execute call; whether the sequence joined the running queue."""
        moved = False
        if item is not None and item.is_new:
            assert grant is not None, f"new request {seq.seq_id} granted without a grant"
            seq.known_to_allocator = True
            seq.waits_for_room = False
            seq.num_allocator_tokens = len(item.prompt_token_ids)
            seq.num_computed_tokens = grant.start_position
            if seq.request.num_cached_tokens is None:
                seq.request.num_cached_tokens = grant.num_cached_tokens
                seq.request.first_scheduled_time = self.clock()
            admitted.add(seq)
            self.running.append(seq)
            moved = True
        elif seq.status is SeqStatus.SWAPPED:
            self.swapped.remove(seq)
            self.running.append(seq)
            seq.waits_for_room = False
            moved = True
        seq.status = SeqStatus.RUNNING
        delta = grant.delta if grant is not None else None
        if appended is not None:
            # The allocator appends at a block boundary: its table covers exactly the
            # computed tokens.
            assert seq.num_computed_tokens % self.block_size == 0, (
                f"{seq.seq_id}: a block appended to a table that does not end at a boundary"
            )
            delta = TableDelta(seq.num_computed_tokens // self.block_size, (appended,))
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
        if num:
            execute.add(seq, start, num, delta)
        return moved

    def _apply_preemptions(self, step: ScheduledStep, outcome: StepOutcome) -> list[Sequence]:
        """Move the preempted sequences; returns the ones swapped out."""
        if not outcome.preempted:
            return []
        by_id = {s.seq_id: s for s in self.running}
        recomputed: list[Sequence] = []
        swapped_out: list[Sequence] = []
        for preemption in outcome.preempted:
            seq = by_id.get(preemption.request_id) or step.seqs.get(preemption.request_id)
            assert seq is not None, f"allocator preempted unknown {preemption.request_id}"
            self.num_preemptions += 1
            self.tenants.unblock(seq.request.tenant)  # its blocks came back
            if seq.is_finished:
                # It ended while its batch executed, after this Step was planned (depth 2).
                if not preemption.swapped:
                    self.forget_freed(seq)  # the allocator freed it already
                continue
            if seq.status is SeqStatus.WAITING and not seq.known_to_allocator:
                # Started over since the plan (Scheduler.recompute): queued already, its abort
                # pending; a recompute preemption has freed it at the allocator instead.
                if not preemption.swapped:
                    self.forget_freed(seq)
                continue
            if seq in self.running:
                self.running.remove(seq)
            if preemption.swapped:
                seq.status = SeqStatus.SWAPPED
                seq.fork_table = None  # its swap-in grant carries the whole table
                self.swapped.append(seq)
                swapped_out.append(seq)
                continue
            if seq in self.swapped:
                self.swapped.remove(seq)
            self.forget_freed(seq)  # e.g. the count its batch in flight executed (depth 2)
            seq.reset_for_recompute()
            self.release(seq)
            recomputed.append(seq)
        self.swapped.sort(key=priority)
        pushed_out = [s for s in [*recomputed, *swapped_out] if s.is_beam]
        for seq in pushed_out:
            seq.waits_for_room = True
        for request in dict.fromkeys(s.request for s in pushed_out):
            self.set_aside_landed_beams(request)
        # The earliest preempted sequence goes first: the queue front keeps FCFS order.
        for seq in sorted(recomputed, key=priority, reverse=True):
            self.add(seq, front=True)
        return swapped_out

    def ready_to_fork(self, batch: Batch) -> list[Sequence]:
        """Prefill parents (n > 1) whose shared prompt is now computed."""
        return [
            s for s, _ in batch.scheduled
            if s.is_prefill_parent and s.num_uncomputed_tokens == 0 and not s.is_finished
        ]

    # Hand-off.

    def unpark(self, seq: Sequence) -> None:
        """Its move did not happen: it runs here again, and stays (never parked again)."""
        seq.stays = True
        if self.parking.leave(seq):
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            self.running.sort(key=_priority_level)

    def detach(self, seq: Sequence) -> None:
        """Its KV now lives on another executor: free it at this allocator, committed (its
        blocks stay in this pool's prefix cache), and release it at this executor."""
        self.parking.leave(seq)
        self._free_committed(seq)

    def adopt(self, seq: Sequence, block_ids: tuple[int, ...]) -> None:
        """A sequence moved here: the allocator holds it with its computed tokens in
        `block_ids` (ReserveHandOff), whose KV has just been written (ImportKV), so its next
        Step commits them; the executor learns it, as a forked child, from its first Execute
        (sampling params, its whole table)."""
        seq.status = SeqStatus.RUNNING
        seq.known_to_allocator = True
        seq.known_to_executor = False
        seq.num_allocator_tokens = seq.num_computed_tokens
        seq.fork_table = block_ids
        self.pending.commits[seq.seq_id] = seq.num_computed_tokens
        self.running.append(seq)
        self.running.sort(key=_priority_level)

    # Lifecycle.
    def finish(self, seq: Sequence) -> None:
        """The sequence is done: free it at the allocator and release it at the executor."""
        if seq.is_finished:
            return
        self.tenants.unblock(seq.request.tenant)
        seq.status = SeqStatus.FINISHED
        self._free_committed(seq)

    def _free_committed(self, seq: Sequence) -> None:
        """Free it at the allocator, committed at what it computed (its full blocks enter
        the prefix cache), and release it at the executor."""
        if seq.known_to_allocator:
            self.pending.commits[seq.seq_id] = seq.num_computed_tokens
            self.pending.free_ids.append(seq.seq_id)
            seq.known_to_allocator = False
        self.release(seq)

    def abort(self, seq: Sequence) -> None:
        """Cancelled: abort at the allocator, release at the executor; nothing is committed."""
        if seq.is_finished:
            return
        self.tenants.unblock(seq.request.tenant)
        seq.status = SeqStatus.FINISHED
        self.pending.commits.pop(seq.seq_id, None)
        if seq.known_to_allocator:
            self.pending.abort_ids.append(seq.seq_id)
            seq.known_to_allocator = False
        self.release(seq)

    def forget_freed(self, seq: Sequence) -> None:
        """The allocator has freed the sequence on its own (a recompute preemption): nothing
        queued for it may reach the allocator (it would name an unknown request)."""
        pending = self.pending
        pending.commits.pop(seq.seq_id, None)
        for ids in (pending.free_ids, pending.abort_ids):
            if seq.seq_id in ids:
                ids.remove(seq.seq_id)

    def set_aside_landed_beams(self, request: Request) -> None:
        """A beam of this search waits for room (pushed out, or its admission deferred): its
        siblings that computed their step (waiting for the search's selection) give their
        blocks back, committed (their KV is written: readmitted, they find it cached), and
        wait right behind it. Otherwise a search would hold blocks while its beam waits for
        room that another search holds, and two searches could stall each other."""
        search = request.beam_search
        assert search is not None, f"{request.request_id} is not a beam search"
        beams = [b.handle for b in search.running]
        anchor = next((s for s in beams if s.waits_for_room and s in self.waiting), None)
        landed = [s for s in beams
                  if s.status is SeqStatus.RUNNING and s.beam_candidates is not None]
        for seq in landed:
            self._free_committed(seq)
            self.running.remove(seq)
            seq.reset_for_recompute()
        if anchor is None:  # (it joins the queue front next, or waits swapped out)
            for seq in reversed(landed):
                self.add(seq, front=True)
            return
        at = self.waiting.index(anchor) + 1
        for seq in landed:
            self.waiting.insert(at, seq)
            at += 1

    def _note_beams_deferred(self, step: ScheduledStep, deferred: AbstractSet[str]) -> None:
        """New beams the allocator did not admit for room: their landed siblings step aside."""
        waiting = [step.seqs[i.request_id] for i in step.call.items
                   if i.is_new and i.request_id in deferred and step.seqs[i.request_id].is_beam]
        for seq in waiting:
            seq.waits_for_room = True
        for request in dict.fromkeys(s.request for s in waiting):
            self.set_aside_landed_beams(request)

    def recompute(self, seq: Sequence) -> None:
        """Start the sequence over at the queue front (its step was lost): the allocator aborts
        what it holds (nothing is committed), the executor releases it."""
        pending = self.pending
        pending.commits.pop(seq.seq_id, None)
        if seq.known_to_allocator:
            pending.abort_ids.append(seq.seq_id)
        self.release(seq)
        for queue in (self.running, self.swapped, self.parking.parked, self.waiting):
            if seq in queue:
                queue.remove(seq)
        seq.reset_for_recompute()
        self.add(seq, front=True)

    def release(self, seq: Sequence) -> None:
        """Drop the sequence's executor state with the next Execute (or Release)."""
        if seq.known_to_executor:
            self.pending.release_ids.append(seq.seq_id)
            seq.known_to_executor = False

    def fork(self, parent: Sequence, children: list[Sequence], tables: list[TableDelta],
             keep_parent: bool = False) -> None:
        """Children that share the parent's blocks run after it: a computed prefill parent is
        replaced by them; a beam (`keep_parent`) goes on beside them, its tokens theirs too."""
        assert len(children) == len(tables), "one table per child"
        for child, table in zip(children, tables, strict=True):
            child.status = SeqStatus.RUNNING
            child.known_to_allocator = True
            # The allocator's child copies the values the parent's holds; the rest follow.
            child.num_allocator_tokens = parent.num_allocator_tokens
            child.num_computed_tokens = parent.num_computed_tokens
            if keep_parent:
                child.output_token_ids = list(parent.output_token_ids)
            assert table.start_index == 0, f"{child.seq_id}: a Fork table not from index 0"
            child.fork_table = table.block_ids
        position = self.running.index(parent)
        self.running[position + 1 : position + 1] = children
        if not keep_parent:
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
        self.parking.clear()
        self.pending = Pending(release_ids=releases)
        return seqs

    def _compact(self) -> None:
        if any(s.is_finished for s in self.running):
            self.running = [s for s in self.running if not s.is_finished]
        if any(s.is_finished for s in self.waiting):
            self.waiting = deque(s for s in self.waiting if not s.is_finished)
        if any(s.is_finished for s in self.swapped):
            self.swapped = [s for s in self.swapped if not s.is_finished]
        self.parking.drop_finished()


def _priority_level(seq: Sequence) -> int:
    return seq.request.sampling.priority


def _samples_its_last(seq: Sequence) -> bool:
    """The token the batch in flight samples for `seq` is its last (max_tokens): nothing to
    plan. (A sequence that ends otherwise frees the slot it was granted.)"""
    return len(seq.output_token_ids) + 1 >= seq.request.sampling.max_tokens


def _rows(call: StepCall) -> Iterator[tuple[str, StepItem | None]]:
    """The step's requests in priority order with their item; None for a decode (one
    token scheduled)."""
    for request_id in call.decode_request_ids:
        yield request_id, None
    for item in call.items:
        yield item.request_id, item


@dataclass(slots=True)
class _Plan:
    """One step's choices as they are made, and what is left of its budgets."""

    tokens_left: int
    seqs_left: int
    decode_ids: list[str] = field(default_factory=list)
    items: list[StepItem] = field(default_factory=list)
    seqs: dict[str, Sequence] = field(default_factory=dict)
    appends: _Appends = field(default_factory=lambda: _Appends())


@dataclass(slots=True)
class _Appends:
    """The values the allocator lacks, as its columns, and how many each sequence sends."""

    request_ids: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    rows: list[tuple[Sequence, int]] = field(default_factory=list)

    def add(self, seq: Sequence, sent: int) -> None:
        """Every known value from position `sent` on."""
        values = seq.token_slice(sent)
        self.request_ids.extend([seq.seq_id] * len(values))
        self.token_ids.extend(values)
        self.rows.append((seq, len(values)))
