"""Routing across executors: a new request goes to the pool with the longest cached prefix
for it, then to the least loaded one, both as the allocator knows them (its exact prefix index
and each pool's running requests, every gateway's included: several gateways over the same
pools decide alike). Sequences of a lost executor are re-queued on a healthy one (recompute),
or fail with UNAVAILABLE."""

from __future__ import annotations

from dataclasses import dataclass

import structlog

from common.errors import ResourceExhausted, Unavailable
from gateway.clients.allocator_client import AllocatorClient
from gateway.clients.call_failures import CallFailed
from gateway.core.request_state import CompletionDelta, Request, Sequence
from gateway.core.seq_ids import child_seq_id, prefill_parent_id, wire_id
from gateway.engine.loop import Engine

log = structlog.get_logger(__name__)


def initial_sequences(request: Request) -> list[Sequence]:
    """n == 1: one sequence. n > 1: a prefill parent that is forked once the prompt (but
    its last token) is computed; a one-token prompt has nothing to share, so n plain ones."""
    rid = wire_id(request.id_namespace, request.request_id)
    n = request.sampling.n
    if n == 1:
        return [Sequence(seq_id=rid, request=request, index=0)]
    if len(request.prompt_token_ids) >= 2:
        return [Sequence(seq_id=prefill_parent_id(rid), request=request, index=0,
                         is_prefill_parent=True)]
    return [Sequence(seq_id=child_seq_id(rid, i), request=request, index=i, seed_offset=i)
            for i in range(n)]


@dataclass(slots=True)
class Router:
    engines: list[Engine]
    allocator: AllocatorClient
    max_waiting: int

    def healthy(self) -> list[Engine]:
        """The engines new requests may go to: healthy, and not leaving."""
        return [e for e in self.engines if e.healthy and not e.draining]

    def add(self, engine: Engine) -> None:
        # A new list, never one changed in place: the API's thread reads it (health, info).
        self.engines = [*self.engines, engine]

    def remove(self, engine: Engine) -> None:
        self.engines = [e for e in self.engines if e is not engine]

    @property
    def num_waiting(self) -> int:
        return sum(len(e.scheduler.waiting) for e in self.engines)

    async def submit(self, request: Request) -> Engine:
        if self.num_waiting >= self.max_waiting:
            raise ResourceExhausted(
                f"the waiting queue is full ({self.max_waiting} requests): retry later"
            )
        engine = await self.route(request)
        seqs = initial_sequences(request)
        request.num_open_completions = request.sampling.n
        for seq in seqs:
            engine.submit(seq)
        return engine

    async def route(self, request: Request) -> Engine:
        engines = self.healthy()
        if len(engines) <= 1:
            return self._pick(engines, {})
        cached: dict[str, int] = {}
        running: dict[str, int] = {}
        try:
            matches = await self.allocator.match_prefix(
                request.prompt_token_ids, request.cache_salt, [e.pool_id for e in engines],
                request.request_id,
            )
            cached = {m.pool_id: m.num_cached_tokens for m in matches}
            running = {m.pool_id: m.num_running_requests for m in matches}
        except CallFailed as exc:
            log.info("match_prefix_failed", code=exc.status)  # this gateway's view alone
        # NOTE: an executor may have been lost while MatchPrefix was in flight; its engine
        # already evicted its sequences, so one submitted there now would wait forever.
        return self._pick(self.healthy(), cached, running)

    @staticmethod
    def _pick(engines: list[Engine], cached: dict[str, int],
              running: dict[str, int] | None = None) -> Engine:
        """Longest cached prefix, then the least load: this gateway's own (its queue too, as
        it is now) plus the other gateways' running requests (the allocator's count less
        ours there; the allocator's alone would lag a burst: each request of it would see
        the same counts and go to the same pool)."""
        if not engines:
            raise Unavailable("no executor is available: check the executors' health")
        running = running or {}

        def load(e: Engine) -> int:
            return e.load + max(running.get(e.pool_id, 0) - e.num_admitted, 0)

        return max(engines, key=lambda e: (cached.get(e.pool_id, 0), -load(e)))

    def requeue(self, seqs: list[Sequence]) -> None:
        """Sequences of a lost executor: recompute them on the least loaded healthy one."""
        engines = self.healthy()
        for seq in seqs:
            if not engines:
                seq.request.emit(CompletionDelta(
                    index=seq.index,
                    error=Unavailable("the executor running this request went away and no "
                                      "other executor is available"),
                ))
                continue
            target = min(engines, key=lambda e: e.load)
            target.submit(seq, front=True)
        if seqs:
            log.warning("requests_requeued", num=len(seqs), num_engines=len(engines))

    def cancel(self, request: Request) -> None:
        request.cancelled = True
        for engine in self.engines:
            engine.cancel()
