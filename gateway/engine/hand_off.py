"""KV hand-off: a sequence computed on one executor goes on decoding on another.

What it is for:
- disaggregated prefill and decode (the executors' --role): a prefill executor's sequences
  move to a decode executor once their prompt is computed and their first token sampled;
- draining: the sequences of an executor that is leaving move to the others instead of
  finishing there;
- rebalancing (--rebalance-min-gap): an engine running many more sequences than another of
  the same role gives it some of its own, the newest first (each at most once).

A move, all on the engine loop (engine/host.py), for one sequence that the source's scheduler
has parked (computed and idle: scheduler.py):
1. the target's allocator reserves it (ReserveHandOff): its computed tokens, the target's
   cached prefix of them shared, fresh blocks for the rest;
2. the target executor pulls the KV of those fresh blocks from the source executor, block by
   block with a checksum (ImportKV, which calls the source's ExportKV);
3. the source frees it, committed (its blocks stay in the source's prefix cache), and releases
   it; the target adopts it: its next Step commits the moved blocks, its next Execute
   introduces it to the executor as a forked child is introduced (its whole table).
If anything fails on the way, the reservation is aborted and the sequence runs on where it is
(and is never parked again). One cancelled, stopped or evicted meanwhile is not adopted.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import structlog

from gateway.clients.call_failures import CallFailed, Lost
from gateway.clients.executor_client import ExecutorDescription
from gateway.core.request_state import SeqStatus, Sequence
from gateway.engine.state import EngineState

log = structlog.get_logger(__name__)

EVERY = 1 << 30  # a move quota: every sequence that becomes idle


@dataclass(slots=True)
class HandOffs:
    engines: Callable[[], Seq[EngineState]]  # the router's engines of the moment
    # Rebalancing: an engine moves sequences to another of its role when it holds at least
    # this many more than that one (0: off).
    rebalance_min_gap: int = 0
    import_timeout_s: float = 60.0
    max_concurrent: int = 8  # moves under way at once (each streams KV between executors)
    # Called once per finished attempt: (outcome, seconds) for the metrics.
    observe: Callable[[str, float], None] = lambda outcome, seconds: None
    # Moves under way, by source and by target: a rebalance counts them as done.
    leaving: dict[str, int] = field(default_factory=dict)
    arriving: dict[str, int] = field(default_factory=dict)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    slots: asyncio.Semaphore | None = None

    # Which sequences leave an engine.

    def quota(self, engine: EngineState) -> int:
        """How many more of `engine`'s idle sequences to park this step (0: none)."""
        targets = self.targets(engine)
        if not targets:
            return 0
        if engine.draining or engine.description.role == "prefill":
            return EVERY
        if not self.rebalance_min_gap:
            return 0
        peers = [t for t in targets if t.description.role == engine.description.role]
        if not peers:
            return 0
        gap = self._count(engine) - min(self._count(t) for t in peers)
        return gap // 2 if gap >= self.rebalance_min_gap else 0

    def _count(self, engine: EngineState) -> int:
        """Sequences held there, counting moves under way as done."""
        held = engine.num_admitted - self.leaving.get(engine.pool_id, 0)
        return held + self.arriving.get(engine.pool_id, 0)

    def targets(self, source: EngineState) -> list[EngineState]:
        """Engines that can take `source`'s sequences, the best first: up and staying, the
        same KV (block size and model), never a prefill one; decode ones first, then the
        least loaded."""
        mine = source.description
        found = [
            e for e in self.engines()
            if e is not source and e.healthy and not e.draining
            and e.description.role != "prefill" and _same_kv(e.description, mine)
        ]
        found.sort(key=lambda e: (e.description.role != "decode", self._count(e)))
        return found

    # Moving them.

    def start(self, source: EngineState, seqs: list[Sequence]) -> None:
        loop = asyncio.get_running_loop()
        for seq in seqs:
            self.leaving[source.pool_id] = self.leaving.get(source.pool_id, 0) + 1
            task = loop.create_task(self._move(source, seq))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _move(self, source: EngineState, seq: Sequence) -> None:
        started = time.perf_counter()
        outcome = "failed"
        try:
            outcome = await self._try(source, seq)
        except Exception:  # noqa: BLE001 - a bug must not strand the sequence
            log.exception("hand_off_failed", seq_id=seq.seq_id, pool_id=source.pool_id)
        finally:
            self.leaving[source.pool_id] -= 1
            if outcome != "moved" and _still_parked(source, seq):
                source.scheduler.unpark(seq)
                source.wakeup.set()
            self.observe(outcome, time.perf_counter() - started)

    async def _try(self, source: EngineState, seq: Sequence) -> str:
        """One attempt; its outcome: moved, refused (the target said no), failed, or gone
        (the sequence ended or moved on meanwhile)."""
        targets = self.targets(source)
        if not targets:
            return "refused"
        target = targets[0]
        if self.slots is None:
            self.slots = asyncio.Semaphore(self.max_concurrent)
        self.arriving[target.pool_id] = self.arriving.get(target.pool_id, 0) + 1
        try:
            async with self.slots:
                return await self._to(source, target, seq)
        finally:
            self.arriving[target.pool_id] -= 1

    async def _to(self, source: EngineState, target: EngineState, seq: Sequence) -> str:
        link, mine = target.link, source.description
        num_tokens = seq.num_computed_tokens
        request = seq.request
        generation = link.lease_generation
        bound = {"seq_id": seq.seq_id, "source": source.pool_id, "target": target.pool_id}
        try:
            reserved = await link.reserve_hand_off(
                seq.seq_id, seq.token_slice(0, num_tokens), len(request.prompt_token_ids),
                request.cache_salt, request.tenant, mine.model_fingerprint, mine.block_size,
                source.pool_id, request.request_id,
            )
        except CallFailed as exc:
            if isinstance(exc, Lost):  # it may have landed: the target aborts it
                target.orphan_ids.add(seq.seq_id)
                target.wakeup.set()
            log.info("hand_off_refused", code=exc.status, detail=exc.details, **bound)
            return "refused"
        if not _still_parked(source, seq):
            await _undo(target, seq)
            return "gone"
        first = reserved.num_cached_tokens // mine.block_size
        try:
            moved = await link.import_kv(source.link, seq.seq_id, first,
                                         reserved.block_ids[first:], num_tokens,
                                         self.import_timeout_s)
        except CallFailed as exc:
            await _undo(target, seq)
            if not _still_parked(source, seq):  # released at the source meanwhile
                return "gone"
            log.warning("hand_off_import_failed", code=exc.status, detail=exc.details, **bound)
            return "failed"
        if (not _still_parked(source, seq) or not target.healthy
                or link.lease_generation != generation):
            await _undo(target, seq)
            return "gone"
        rebalanced = not source.draining and source.description.role != "prefill"
        source.scheduler.detach(seq)
        source.wakeup.set()
        target.scheduler.adopt(seq, tuple(reserved.block_ids))
        # A rebalanced sequence moves once: when the other engine empties first, its own
        # sequences must not come straight back.
        seq.stays = rebalanced
        target.wakeup.set()
        log.info("hand_off_done", num_tokens=num_tokens,
                 num_cached_tokens=reserved.num_cached_tokens, num_blocks=moved.num_blocks,
                 num_bytes=moved.num_bytes, import_ms=round(moved.elapsed_ms, 2), **bound)
        return "moved"


def _same_kv(a: ExecutorDescription, b: ExecutorDescription) -> bool:
    """Their KV blocks are alike, byte for byte, as far as their descriptions say."""
    if a.kv_layout is not None and b.kv_layout is not None:
        return a.kv_layout == b.kv_layout
    return a.block_size == b.block_size and a.model_fingerprint == b.model_fingerprint


def _still_parked(source: EngineState, seq: Sequence) -> bool:
    """Not cancelled, stopped, evicted or finished since it was parked."""
    return seq.status is SeqStatus.PARKED and seq in source.scheduler.parked


async def _undo(target: EngineState, seq: Sequence) -> None:
    """Abort the reservation; if the allocator cannot be told now, the target's engine
    aborts it before its next Step (an orphan)."""
    try:
        await target.link.abort([seq.seq_id])
    except CallFailed:
        target.orphan_ids.add(seq.seq_id)
        target.wakeup.set()
