"""KV hand-off: a sequence computed on one executor goes on decoding on another.

What it is for:
- disaggregated prefill and decode (the executors' --role): a prefill executor's sequences
  move to a decode executor once their prompt is computed and their first token sampled;
- draining: the sequences of an executor that is leaving move to the others instead of
  finishing there;
- rebalancing (--rebalance-min-gap): an engine running many more sequences than another of
  the same role gives it some of its own, the newest first (each at most once).

A move, for one sequence that the source's scheduler has parked (computed and idle:
scheduler.py), in three parts, each on the engine loop (engine/host.py):
1. the source's step, right after planning, picks the target and queues the move there;
2. the target's next step, before it plans: its allocator reserves the sequence
   (ReserveHandOff: its computed tokens, the target's cached prefix of them shared, fresh
   blocks for the rest), and the target executor is asked to pull the KV of those fresh
   blocks from the source executor (ImportKV, block by block with a checksum, a task). The
   import names the target's last Execute (previous_step_id): the reserved blocks may have
   been freed by a Step whose Execute still writes or copies them, and the executor writes
   the moved KV after it. The reservation is made between the target's own steps, so every
   Step before it has its Execute out;
3. as soon as the KV is in (the import's callback, between two awaits of the engines' steps):
   the source frees the sequence, committed (its blocks stay in the source's prefix cache),
   and releases it; the target adopts it (its next Step commits the moved blocks, its next
   Execute introduces it to the executor as a forked child is introduced: its whole table).
If anything fails on the way, the reservation is aborted and the sequence runs on where it is
(and is never parked again). One cancelled, evicted or parked afresh meanwhile is not
adopted; nor is one whose target started leaving, restarted or lost its lease.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import structlog

from common.executor_description import ExecutorDescription, serves
from gateway.clients.allocator_client import HandOffReservation
from gateway.clients.call_failures import CallFailed, Lost
from gateway.clients.executor_client import KVImport
from gateway.core.request_state import SeqStatus, Sequence
from gateway.engine.state import EngineState

log = structlog.get_logger(__name__)

EVERY = 1 << 30  # a move quota: every sequence that becomes idle


@dataclass(eq=False, slots=True)
class Move:
    source: EngineState
    target: EngineState
    seq: Sequence
    started: float
    # The sequence as parked: one evicted and parked again since is another move's.
    parked_as: tuple[int, int]
    reserved: HandOffReservation | None = None
    # The target's lease generation and pool epoch the reservation was made under.
    under: tuple[int, int] = (0, 0)
    imported: asyncio.Task[KVImport] | None = None


def _parked_as(seq: Sequence) -> tuple[int, int]:
    return seq.num_preemptions, seq.num_computed_tokens


@dataclass(slots=True)
class HandOffs:
    engines: Callable[[], Seq[EngineState]]  # the router's engines of the moment
    # Rebalancing: an engine moves sequences to another of its role when it holds at least
    # this many more than that one (0: off).
    rebalance_min_gap: int = 0
    import_timeout_s: float = 60.0
    # Called once per move: (outcome, seconds since it was parked) for the metrics.
    observe: Callable[[str, float], None] = lambda outcome, seconds: None
    # Moves queued for their target's next step, and those whose KV is on its way, by target.
    incoming: dict[str, list[Move]] = field(default_factory=dict)
    importing: dict[str, list[Move]] = field(default_factory=dict)
    # Moves under way, by source and by target: a rebalance counts them as done.
    leaving: dict[str, int] = field(default_factory=dict)
    arriving: dict[str, int] = field(default_factory=dict)

    # Which sequences leave an engine.

    def quota(self, engine: EngineState) -> int:
        """How many more of `engine`'s idle sequences to park this step (0: none). Asked
        every step: an engine that neither leaves, prefills only nor rebalances answers
        without looking at the others."""
        leaves = engine.draining or engine.description.role == "prefill"
        if not leaves and not self.rebalance_min_gap:
            return 0
        targets = self.targets(engine)
        if not targets:
            return 0
        if leaves:
            return EVERY
        peers = [t for t in targets if t.description.role == engine.description.role]
        if not peers:
            return 0
        gap = self._count(engine) - min(self._count(t) for t in peers)
        return gap // 2 if gap >= self.rebalance_min_gap else 0

    def adapters_served(self, source: EngineState) -> frozenset[tuple[str, str]]:
        """The LoRA adapters some target of `source` holds: only their sequences may move."""
        return frozenset((a.name, a.digest) for t in self.targets(source)
                         for a in t.description.lora_adapters)

    def _count(self, engine: EngineState) -> int:
        """Sequences held there, counting moves under way as done."""
        held = engine.num_admitted - self.leaving.get(engine.pool_id, 0)
        return held + self.arriving.get(engine.pool_id, 0)

    def targets(self, source: EngineState) -> list[EngineState]:
        """Engines that can take `source`'s sequences, the best first: up and staying, the
        same KV layout, never a prefill one; decode ones first, then the least loaded."""
        mine = source.description
        found = [
            e for e in self.engines()
            if e is not source and e.healthy and not e.draining
            and e.description.role != "prefill" and _same_kv(e.description, mine)
        ]
        found.sort(key=lambda e: (e.description.role != "decode", self._count(e)))
        return found

    # The source's part.

    def start(self, source: EngineState, seqs: list[Sequence]) -> None:
        """Parked by `source`'s plan just now: each goes to the best target's queue."""
        now = time.perf_counter()
        for seq in seqs:
            targets = [t for t in self.targets(source) if serves(t.description, seq.request.lora)]
            if not targets:  # (the targets went away since the quota was given)
                source.scheduler.unpark(seq)
                self.observe("refused", 0.0)
                continue
            target = targets[0]
            self.incoming.setdefault(target.pool_id, []).append(
                Move(source, target, seq, now, _parked_as(seq)))
            _add(self.leaving, source.pool_id, 1)
            _add(self.arriving, target.pool_id, 1)
            target.wakeup.set()

    # The target's part, at the start of each of its steps.

    def has_work(self, target: EngineState) -> bool:
        """Something for the target's next step: moves to reserve."""
        return bool(self.incoming.get(target.pool_id))

    def holds(self, engine: EngineState) -> bool:
        """Moves to `engine` not finished: it must not stop (drain) before they are."""
        return bool(self.incoming.get(engine.pool_id) or self.importing.get(engine.pool_id))

    async def receive(self, target: EngineState) -> None:
        """Reserve the new moves and start their imports. Called between the target's
        steps (no Step of its own is out)."""
        new = self.incoming.pop(target.pool_id, [])
        if new:
            await asyncio.gather(*(self._reserve(move) for move in new))

    async def _reserve(self, move: Move) -> None:
        source, target, seq = move.source, move.target, move.seq
        gone = self._gone(move)
        if gone is not None or target.draining or not target.healthy:
            self._end(move, gone or "refused")
            return
        request, mine = seq.request, source.description
        num_tokens = seq.num_computed_tokens
        link = target.link
        try:
            reserved = await link.reserve_hand_off(
                seq.seq_id, seq.token_slice(0, num_tokens), len(request.prompt_token_ids),
                request.cache_salt, request.tenant, mine.model_fingerprint, mine.block_size,
                source.pool_id, request.request_id, request.sampling.priority,
            )
        except CallFailed as exc:
            if isinstance(exc, Lost):  # it may have landed: the target aborts it
                target.orphans.note([seq.seq_id])
                target.wakeup.set()
            log.info("hand_off_refused", code=exc.status, detail=exc.details, **_names(move))
            self._end(move, "refused")
            return
        move.reserved, move.under = reserved, (link.lease_generation, link.epoch)
        first = reserved.num_cached_tokens // mine.block_size
        # Every Execute sent before this reservation has this one's step id or a lower one.
        previous = target.in_flight[-1].step_id if target.in_flight else 0
        move.imported = asyncio.get_running_loop().create_task(link.import_kv(
            source.link, seq.seq_id, first, reserved.block_ids[first:], num_tokens,
            self.import_timeout_s, previous))
        self.importing.setdefault(target.pool_id, []).append(move)
        move.imported.add_done_callback(lambda _: self._arrived(move))

    def _arrived(self, move: Move) -> None:
        """The import ended (a callback on the engine loop, between any two awaits of the
        engines' steps, so no step is half-applied): adopt or undo at once, rather than at
        the target's next step."""
        self.importing[move.target.pool_id].remove(move)
        self._finish(move)
        move.source.wakeup.set()
        move.target.wakeup.set()

    def _finish(self, move: Move) -> None:
        """Its import has ended: adopt the sequence, or undo the reservation."""
        source, target, seq = move.source, move.target, move.seq
        assert move.imported is not None and move.reserved is not None
        failure: BaseException | None = (
            asyncio.CancelledError() if move.imported.cancelled() else move.imported.exception())
        gone = self._gone(move)
        unfit = (not target.healthy or target.draining
                 or (target.link.lease_generation, target.link.epoch) != move.under)
        if failure is not None or gone is not None or unfit:
            target.orphans.note([seq.seq_id])  # the reservation: aborted before its next Step
            if failure is not None and gone is None:
                log.warning("hand_off_import_failed", error=str(failure), **_names(move))
            self._end(move, gone or ("failed" if failure is not None else "refused"))
            return
        moved = move.imported.result()
        rebalanced = not source.draining and source.description.role != "prefill"
        source.scheduler.detach(seq)
        source.wakeup.set()
        target.scheduler.adopt(seq, move.reserved.block_ids)
        # A rebalanced sequence moves once: when the other engine empties first, its own
        # sequences must not come straight back.
        seq.stays = rebalanced
        log.info("hand_off_done", num_tokens=seq.num_computed_tokens,
                 num_cached_tokens=move.reserved.num_cached_tokens,
                 num_blocks=moved.num_blocks, num_bytes=moved.num_bytes,
                 import_ms=round(moved.elapsed_ms, 2), **_names(move))
        self._end(move, "moved")

    def _gone(self, move: Move) -> str | None:
        """'gone' when the sequence is no longer the one parked for this move: cancelled (the
        source applies that), evicted, finished, or parked afresh since."""
        seq = move.seq
        if (seq.status is not SeqStatus.PARKED or seq not in move.source.scheduler.parking.parked
                or _parked_as(seq) != move.parked_as):
            return "gone"
        if seq.request.cancelled:
            return "gone"
        return None

    def _end(self, move: Move, outcome: str) -> None:
        source, seq = move.source, move.seq
        _add(self.leaving, source.pool_id, -1)
        _add(self.arriving, move.target.pool_id, -1)
        if outcome in ("refused", "failed") and self._gone(move) is None:
            source.scheduler.unpark(seq)  # it runs on where it is
            source.wakeup.set()
        self.observe(outcome, time.perf_counter() - move.started)


def _add(counts: dict[str, int], pool_id: str, n: int) -> None:
    counts[pool_id] = counts.get(pool_id, 0) + n


def _names(move: Move) -> dict[str, str]:
    return {"request_id": move.seq.request.request_id, "seq_id": move.seq.seq_id,
            "source": move.source.pool_id, "target": move.target.pool_id}


def _same_kv(a: ExecutorDescription, b: ExecutorDescription) -> bool:
    """Their KV blocks are alike, byte for byte: both report a layout, and the same one."""
    return a.kv_layout is not None and a.kv_layout == b.kv_layout
