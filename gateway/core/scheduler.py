"""The scheduler of one executor's pool: its queues, and which sequences run in the next step.
Plain Python: no gRPC, no tokenizer; a clock only to stamp first admissions (queue time).

One step is three calls, made by the engine in this order:

    plan = scheduler.schedule()               # -> StepCall for the allocator (None: idle)
    batch = scheduler.apply_outcome(plan, o)  # allocator's answer -> ExecuteCall
    sampled = scheduler.apply_result(batch, r)  # executor's answer -> (sequence, token) pairs

At depth 2 the calls interleave: schedule(k+1), advance(k), apply_outcome(k+1), launch(k+1),
fill(k) (core/overlap.py, one of the scheduler's two base classes).

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

Hand-off (engine/hand_off.py): planning parks the sequences to move (core/parking.py).

The queues it plans from, and each sequence's way in and out of them (add, finish, abort,
fork, evict, hand-off, beams waiting for room), are its base class's (core/queues.py).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Iterator
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from common.step_records import Commit, PreemptionMode, StepCall, StepItem
from gateway.core.batch import Batch, Budget, ScheduledStep
from gateway.core.drafts import NgramDrafts, may_draft, pack
from gateway.core.execute_call import ExecuteCallBuilder, is_plain_decode
from gateway.core.fair_share import fair_order, waiting_tenants
from gateway.core.overlap import BatchLanding
from gateway.core.queues import SequenceQueues, priority_level
from gateway.core.request_state import SeqStatus, Sequence, priority
from gateway.core.step import Grant, StepOutcome, TableDelta


@dataclass(slots=True)
class Scheduler(SequenceQueues, BatchLanding):
    budget: Budget
    block_size: int
    swap: bool = False
    num_preemptions: int = 0
    num_advanced: int = 0  # batches advanced and not landed (overlap.py)
    # The Steps' numbers. The allocator wants them increasing per lease and pool, and an
    # executor that leaves and joins again gets a new engine on the same pool and lease, so
    # the gateway passes its lease's one counter (gaps are harmless).
    step_ids: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    # Admission by fair share (fair_share.py): the waiting tenants' service, as the
    # allocator last reported it, and its service per prompt token.
    fair_share: bool = False
    tenant_service: dict[str, float] = field(default_factory=dict)
    prefill_weight: float = 1.0
    # Speculative decoding (drafts.py; None: off). Drafts are proposed only for a sequence
    # with nothing in flight, whose step lands before the next is planned (depth 1).
    drafts: NgramDrafts | None = None
    max_drafts: int = 16  # the executor's Describe.max_draft_tokens (0: it verifies none)
    max_model_len: int = 1 << 30  # the gateway's: no draft reaches past it
    num_drafts: int = 0  # rows drafted for, their draft tokens, and the accepted ones
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    clock: Callable[[], float] = time.monotonic

    # One step.
    def schedule(self, in_flight: bool = False) -> ScheduledStep | None:
        """The step's items under the budgets; None when there is nothing to send.
        `in_flight`: planned while the previous batch executes (depth 2)."""
        assert not self.num_advanced, "planning with placeholders out: the allocator needs values"
        self.compact()
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
        drafts = self.drafts
        for seq in [*self.running, *self.swapped]:
            if seq.known_to_allocator:
                if seq.accepted_drafts is not None:  # with the values appended below
                    plan.accepts.append((seq, seq.accepted_drafts))
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
                # (None while sequences are to be moved: a drafted one waits for its
                # accept, and drafting again each step would keep it from ever leaving.)
                proposed = (self._draft(seq, tokens_left)
                            if drafts and not ahead and not self.parking.move_quota else ())
                if proposed:
                    items.append(StepItem(seq.seq_id, 1, num_lookahead=len(proposed)))
                    plan.drafts[seq.seq_id] = proposed
                    tokens_left -= len(proposed)
                else:
                    decode_ids.append(seq.seq_id)
            else:
                items.append(StepItem(seq.seq_id, num))
            seqs[seq.seq_id] = seq
            tokens_left -= num
            seqs_left -= 1
        plan.tokens_left, plan.seqs_left = tokens_left, seqs_left

    def _draft(self, seq: Sequence, tokens_left: int) -> tuple[int, ...]:
        """Draft tokens for a decode (drafts.py): within the step's token budget, the
        sequence's max_tokens (the step emits up to one more than it drafts) and the model's
        length."""
        assert self.drafts is not None
        if seq.is_beam or seq.is_prefill_parent or not may_draft(seq.request):
            return ()
        limit = min(tokens_left - 1, self.max_drafts,
                    seq.request.sampling.max_tokens - len(seq.output_token_ids) - 1,
                    self.max_model_len - seq.num_tokens)
        if limit <= 0:
            return ()
        packed = pack(seq.packed_tokens, seq.request.prompt_token_ids, seq.output_token_ids)
        return self.drafts.propose_packed(packed, limit)

    def _plan_waiting(self, plan: _Plan) -> None:
        """Waiting sequences their tenants let start, in order: admission (the prompt, or
        prompt and outputs after a recompute), chunked when the token budget is short."""
        admission = self.tenants.admission(
            itertools.chain(self.running, self.swapped, self.parking.parked))
        queue = (fair_order(self.waiting, self.tenant_service, self.prefill_weight)
                 if self.fair_share else self.waiting)
        for seq in queue:
            if plan.seqs_left == 0 or plan.tokens_left == 0:
                break
            request = seq.request
            if not admission.admits(request):
                continue
            num = min(seq.num_tokens, plan.tokens_left)
            plan.items.append(
                StepItem(
                    seq.seq_id, num, prompt_token_ids=tuple(seq.token_ids),
                    cache_salt=request.cache_salt, tenant=request.tenant,
                    resumed=seq.num_preemptions > 0,
                    # Its prompt's logprobs need every row: a cached prefix has none.
                    skip_prefix_lookup=request.needs_prompt_logprobs,
                    priority=request.sampling.priority,
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
            step_id = next(self.step_ids)
        appends = plan.appends
        call = StepCall(
            commits=tuple(Commit(k, v) for k, v in pending.commits.items()),
            free_request_ids=tuple(pending.free_request_ids),
            abort_request_ids=tuple(pending.abort_request_ids),
            items=tuple(plan.items),
            mode=PreemptionMode.SWAP if self.swap else PreemptionMode.RECOMPUTE,
            decode_request_ids=tuple(plan.decode_ids),
            # (Only a Step carries values: an idle engine's housekeeping goes as Free.)
            append_request_ids=tuple(appends.request_ids) if has_items else (),
            append_token_ids=tuple(appends.token_ids) if has_items else (),
            step_id=step_id,
            commit_through_step_id=pending.executed_through,
            waiting_tenants=waiting_tenants(self.waiting) if self.fair_share else (),
            accept_request_ids=tuple(s.seq_id for s, _ in plan.accepts) if has_items else (),
            accept_counts=tuple(n for _, n in plan.accepts) if has_items else (),
        )
        pending.sent_through = pending.executed_through
        pending.commits.clear()
        pending.free_request_ids.clear()
        pending.abort_request_ids.clear()
        return ScheduledStep(call=call, seqs=plan.seqs, appends=appends.rows if has_items else [],
                             drafts=plan.drafts,
                             accepts=[s for s, _ in plan.accepts] if has_items else [])

    def apply_outcome(self, step: ScheduledStep, outcome: StepOutcome) -> Batch:
        """Apply the allocator's grants, preemptions and deferrals; build the Execute call."""
        for seq, num in step.appends:  # the allocator now holds these values
            if seq.known_to_allocator:
                seq.num_allocator_tokens += num
        for seq in step.accepts:  # and counts the accepted drafts computed
            seq.accepted_drafts = None
        if outcome.tenant_service:
            self.tenant_service = outcome.tenant_service
            self.prefill_weight = outcome.prefill_weight
        swapped_out = self._apply_preemptions(step, outcome)
        skipped = outcome.deferred_request_ids | {p.request_id for p in outcome.preempted}
        if outcome.deferred_request_ids:
            self.tenants.note_deferrals(
                [(i.request_id, step.seqs[i.request_id].request.tenant)
                 for i in step.call.items if i.is_new],
                outcome.deferred_request_ids,
                {s.request.tenant for s in (*self.running, *self.swapped)})
            self.beams_wait_for_room([step.seqs[i.request_id] for i in step.call.items
                                      if i.is_new and i.request_id in outcome.deferred_request_ids])
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
            grant = grants.get(request_id)
            drafts = step.drafts.get(request_id, ()) if step.drafts else ()
            if drafts:  # as many as the allocator granted slots for (none without a grant)
                drafts = drafts[:grant.num_lookahead] if grant is not None else ()
            moved |= self._grant(seq, item, grant, appended_blocks.get(request_id), execute,
                                 admitted, drafts)
        if admitted:
            self.waiting = deque(s for s in self.waiting if s not in admitted)
        if moved:
            # Stable: among equal priorities the order stays as it was (FCFS).
            self.running.sort(key=priority_level)
        call = execute.build(self.pending.release_ids, outcome.swap_out, outcome.swap_in,
                             outcome.copies)
        self.pending.release_ids.clear()
        return Batch(call=call, scheduled=execute.rows, step_id=step.call.step_id,
                     num_decodes=len(execute.decoded), swapped_out=swapped_out)

    def _grant(self, seq: Sequence, item: StepItem | None, grant: Grant | None,
               appended: int | None, execute: ExecuteCallBuilder,
               admitted: set[Sequence], drafts: tuple[int, ...] = ()) -> bool:
        """A granted row the general way (an admission, a swap-in, a table change, a chunk)
        into the Execute call; whether the sequence joined the running queue."""
        moved = False
        if item is not None and item.prompt_token_ids is not None:  # new to the allocator
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
            execute.add(seq, start, num, delta, drafts)
            if drafts:
                self.num_drafts += 1
                self.num_draft_tokens += len(drafts)
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
                # Started over since the plan (SequenceQueues.recompute): queued already, its abort
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
        self.beams_wait_for_room([*recomputed, *swapped_out])
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
    drafts: dict[str, tuple[int, ...]] = field(default_factory=dict)  # by sequence id
    accepts: list[tuple[Sequence, int]] = field(default_factory=list)


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
