"""One pool's sequences: the queues they wait and run in, and how each enters and leaves them.

The scheduler (scheduler.py) chooses each step from these queues; this module owns what the
queues hold between steps:

- the queues: `waiting` (by priority, FCFS among equals), `running`, `swapped`, and the
  sequences parked for their hand-off (core/parking.py);
- each sequence's lifecycle: queued, finished, aborted, started over (`recompute`), forked,
  evicted, moved to another pool (`detach`) or from one (`adopt`);
- what those changes owe the services, in `pending`: commits, frees and aborts ride on the
  next allocator call, releases on the next Execute;
- beams waiting for room: while a beam of a search waits for blocks, its siblings that have
  computed their step give theirs back (`set_aside_landed_beams`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from gateway.core.batch import Pending
from gateway.core.parking import Parking
from gateway.core.request_state import Request, SeqStatus, Sequence
from gateway.core.step import TableDelta
from gateway.core.tenants import TenantGate


@dataclass(slots=True)
class SequenceQueues:
    # (Keyword-only: the scheduler's own fields come first in its constructor.)
    waiting: deque[Sequence] = field(default_factory=deque, kw_only=True)
    running: list[Sequence] = field(default_factory=list, kw_only=True)
    swapped: list[Sequence] = field(default_factory=list, kw_only=True)
    # Sequences set aside for their hand-off (core/parking.py).
    parking: Parking = field(default_factory=Parking, kw_only=True)
    pending: Pending = field(default_factory=Pending, kw_only=True)
    # Which waiting requests their tenants let start (core/tenants.py); a sequence that ends
    # gives its tenant room.
    tenants: TenantGate = field(default_factory=TenantGate, kw_only=True)

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

    def join_running(self, seq: Sequence) -> None:
        """It runs from now on, in priority order (stable: FCFS among equals)."""
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        self.running.sort(key=priority_level)

    # Hand-off (engine/hand_off.py).

    def unpark(self, seq: Sequence) -> None:
        """Its move did not happen: it runs here again, and stays (never parked again)."""
        seq.stays = True
        if self.parking.leave(seq):
            self.join_running(seq)

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
        seq.known_to_allocator = True
        seq.known_to_executor = False
        seq.accepted_drafts = None  # (never parked with some: parking.py)
        seq.num_allocator_tokens = seq.num_computed_tokens
        seq.fork_table = block_ids
        self.pending.commits[seq.seq_id] = seq.num_computed_tokens
        self.join_running(seq)

    # Lifecycle.

    def _end(self, seq: Sequence) -> bool:
        """Mark it finished, its tenant given room; False when it had ended already."""
        if seq.is_finished:
            return False
        self.tenants.unblock(seq.request.tenant)
        seq.status = SeqStatus.FINISHED
        return True

    def finish(self, seq: Sequence) -> None:
        """The sequence is done: free it at the allocator and release it at the executor."""
        if self._end(seq):
            self._free_committed(seq)

    def _free_committed(self, seq: Sequence) -> None:
        """Free it at the allocator, committed at what it computed (its full blocks enter
        the prefix cache), and release it at the executor."""
        if seq.known_to_allocator:
            # (Drafts accepted since the last Step are not counted there: they stay out.)
            self.pending.commits[seq.seq_id] = seq.num_computed_tokens - (seq.accepted_drafts
                                                                         or 0)
            self.pending.free_request_ids.append(seq.seq_id)
            seq.known_to_allocator = False
        self.release(seq)

    def abort(self, seq: Sequence) -> None:
        """Cancelled: abort at the allocator, release at the executor; nothing is committed."""
        if not self._end(seq):
            return
        self.pending.commits.pop(seq.seq_id, None)
        if seq.known_to_allocator:
            self.pending.abort_request_ids.append(seq.seq_id)
            seq.known_to_allocator = False
        self.release(seq)

    def forget_freed(self, seq: Sequence) -> None:
        """The allocator has freed the sequence on its own (a recompute preemption): nothing
        queued for it may reach the allocator (it would name an unknown request)."""
        pending = self.pending
        pending.commits.pop(seq.seq_id, None)
        for ids in (pending.free_request_ids, pending.abort_request_ids):
            if seq.seq_id in ids:
                ids.remove(seq.seq_id)

    def recompute(self, seq: Sequence) -> None:
        """Start the sequence over at the queue front (its step was lost): the allocator aborts
        what it holds (nothing is committed), the executor releases it."""
        pending = self.pending
        pending.commits.pop(seq.seq_id, None)
        if seq.known_to_allocator:
            pending.abort_request_ids.append(seq.seq_id)
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

    def compact(self) -> None:
        """Drop the finished sequences from every queue."""
        if any(s.is_finished for s in self.running):
            self.running = [s for s in self.running if not s.is_finished]
        if any(s.is_finished for s in self.waiting):
            self.waiting = deque(s for s in self.waiting if not s.is_finished)
        if any(s.is_finished for s in self.swapped):
            self.swapped = [s for s in self.swapped if not s.is_finished]
        self.parking.drop_finished()

    # Beams waiting for room.

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

    def beams_wait_for_room(self, seqs: AbstractSet[Sequence] | list[Sequence]) -> None:
        """These beams wait for blocks (pushed out, or not admitted): their searches' landed
        beams step aside."""
        beams = [s for s in seqs if s.is_beam]
        for seq in beams:
            seq.waits_for_room = True
        for request in dict.fromkeys(s.request for s in beams):
            self.set_aside_landed_beams(request)


def priority_level(seq: Sequence) -> int:
    return seq.request.sampling.priority
