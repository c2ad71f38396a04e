"""Routing across executors, by one of three policies (--routing):

    exact        the pool with the longest cached prefix for the request, then the least
                 loaded one, both as the allocator knows them (its exact prefix index and each
                 pool's running requests, every gateway's included: several gateways over the
                 same pools decide alike). One MatchPrefix call per request.
    approx       the same choice from the gateway's own prefix index, fed by the pools' cache
                 events with a lag (kv_event_index.py), and this gateway's own load: no
                 allocator call on the request path.
    round-robin  the next healthy engine in turn; prefixes ignored.

Sequences of a lost executor are re-queued on a healthy one (recompute), or fail with
UNAVAILABLE."""

from __future__ import annotations

from dataclasses import dataclass, field

import structlog

from common.errors import ResourceExhausted, Unavailable
from common.executor_description import serves
from gateway.clients.call_failures import CallFailed
from gateway.clients.shards import AllocatorShards
from gateway.core.beam_search import BeamSearch
from gateway.core.request_state import CompletionDelta, Request, Sequence
from gateway.core.seq_ids import beam_seq_id, child_seq_id, prefill_parent_id, wire_id
from gateway.engine.kv_event_index import KvEventIndex
from gateway.engine.loop import Engine
from gateway.settings import ROUTING_POLICIES

log = structlog.get_logger(__name__)
NO_EXECUTOR = "no executor is available: check the executors' health"


def _adapter_note(seq: Sequence) -> str:
    lora = seq.request.lora
    return "" if lora is None else f" with LoRA adapter {lora.name!r} loaded"


def initial_sequences(request: Request) -> list[Sequence]:
    """n == 1: one sequence. n > 1: a prefill parent that is forked once the prompt (but
    its last token) is computed; a one-token prompt has nothing to share, so n plain ones.
    Beam search: its first beam, which computes the prompt (the search forks it)."""
    rid = wire_id(request.id_namespace, request.request_id)
    n = request.sampling.n
    if request.sampling.beam is not None:
        beam = Sequence(seq_id=beam_seq_id(rid, 0), request=request, index=0, is_beam=True)
        request.beam_search = BeamSearch.start(request.sampling.beam, beam)
        return [beam]
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
    allocator: AllocatorShards  # MatchPrefix, each shard asked about its own pools
    max_waiting: int
    policy: str = "exact"  # one of ROUTING_POLICIES
    kv_events_lag_s: float = 1.0  # approx: how often its index reads the pools' events
    kv_index: KvEventIndex | None = field(init=False, default=None)  # approx only
    turn: int = 0  # round-robin: where the next scan of `engines` starts

    def __post_init__(self) -> None:
        assert self.policy in ROUTING_POLICIES, f"unknown routing policy {self.policy!r}"
        if self.policy == "approx":
            self.kv_index = KvEventIndex(self.kv_events_lag_s)

    def healthy(self, request: Request | None = None) -> list[Engine]:
        """The engines new requests may go to: healthy, not leaving, and not decode ones
        (--role) while a prefill or both one is up; with `request`, those that serve its
        LoRA adapter."""
        up = [e for e in self.engines if e.healthy and not e.draining]
        if request is not None and request.lora is not None:
            up = [e for e in up if serves(e.description, request.lora)]
        return [e for e in up if e.description.role != "decode"] or up

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
        for seq in seqs:
            engine.submit(seq)
        return engine

    async def follow_cache_events(self) -> None:
        """approx: keep the index fed with the events of the engines of the moment (a task on
        the engine loop, until cancelled)."""
        assert self.kv_index is not None, "only --routing approx follows cache events"
        await self.kv_index.follow(lambda: self.engines)

    async def route(self, request: Request) -> Engine:
        if request.lora is not None and not self.healthy(request):
            raise Unavailable(f"no healthy executor has LoRA adapter {request.lora.name!r} "
                              "loaded")
        if self.policy == "round-robin":
            return self._next_in_turn(request)
        if self.kv_index is not None:
            engines = self.healthy(request)
            cached = self.kv_index.cached_tokens(request.prompt_token_ids, request.cache_salt,
                                                 [e.pool_id for e in engines])
            return self._pick(engines, cached)  # no counts of others: our own load alone
        return await self._route_exact(request)

    async def _route_exact(self, request: Request) -> Engine:
        engines = self.healthy(request)
        if len(engines) <= 1:
            return self._pick(engines, {})
        cached: dict[str, int] = {}
        running: dict[str, int] = {}
        reachable: set[str] | None = None  # the pools whose allocator shard answered
        try:
            matches = await self.allocator.match_prefix(
                request.prompt_token_ids, request.cache_salt, [e.pool_id for e in engines],
                request.request_id,
            )
            cached = {m.pool_id: m.num_cached_tokens for m in matches}
            running = {m.pool_id: m.num_running_requests for m in matches}
            reachable = set(cached)
        except CallFailed as exc:
            log.info("match_prefix_failed", code=exc.status)  # this gateway's view alone
        # NOTE: an executor may have been lost while MatchPrefix was in flight; its engine
        # already evicted its sequences, so one submitted there now would wait forever.
        return self._pick(self.healthy(request), cached, running, reachable)

    @staticmethod
    def _pick(engines: list[Engine], cached: dict[str, int],
              running: dict[str, int] | None = None,
              reachable: set[str] | None = None) -> Engine:
        """A pool whose allocator shard is up first (it answered this request's MatchPrefix,
        when `reachable` says, and its engine's last Step reached it): a shard that is away
        fails its pools' requests. Then the longest cached prefix, then the least load: this
        gateway's own (its queue too, as it is now) plus the other gateways' running
        requests (the allocator's count less ours there; the allocator's alone would lag a
        burst: each request of it would see the same counts and go to the same pool)."""
        if not engines:
            raise Unavailable(NO_EXECUTOR)
        running = running or {}

        def load(e: Engine) -> int:
            return e.load + max(running.get(e.pool_id, 0) - e.num_admitted, 0)

        def allocator_up(e: Engine) -> bool:
            answered = reachable is None or e.pool_id in reachable
            return answered and e.allocator_down_since is None

        return max(engines, key=lambda e: (allocator_up(e), cached.get(e.pool_id, 0), -load(e)))

    def _next_in_turn(self, request: Request) -> Engine:
        """The first engine new requests may go to, from where the last pick left off."""
        engines, allowed = self.engines, set(self.healthy(request))
        for step in range(len(engines)):
            index = (self.turn + step) % len(engines)
            if engines[index] in allowed:
                self.turn = index + 1
                return engines[index]
        raise Unavailable(NO_EXECUTOR)

    def move_waiting(self, source: Engine) -> int:
        """A leaving engine's requests that hold nothing there yet (every sequence waiting,
        none admitted) join the others' queues; returns how many sequences moved."""
        engines = [e for e in self.healthy() if e is not source]
        if not engines:
            return 0
        scheduler = source.scheduler
        holding = {s.request for s in (*scheduler.running, *scheduler.swapped,
                                       *scheduler.parking.parked)}
        movable = [s for s in scheduler.waiting
                   if s.request not in holding and not s.known_to_allocator
                   and any(e is not source for e in self.healthy(s.request))]
        targets: dict[Request, Engine] = {}
        for seq in movable:
            scheduler.waiting.remove(seq)
            serving = [e for e in self.healthy(seq.request) if e is not source]
            target = targets.get(seq.request) or min(serving, key=lambda e: e.load)
            targets[seq.request] = target
            target.submit(seq, front=True)
        return len(movable)

    def requeue(self, seqs: list[Sequence]) -> None:
        """Sequences of a lost executor: recompute them on the least loaded healthy one, a
        request's together (a beam search forks its beams in one pool)."""
        targets: dict[Request, Engine] = {}
        for seq in seqs:
            serving = self.healthy(seq.request)
            if not serving:
                seq.request.emit(CompletionDelta(
                    index=seq.index,
                    error=Unavailable("the executor running this request went away and no "
                                      "other executor is available" + _adapter_note(seq)),
                ))
                continue
            target = targets.get(seq.request) or min(serving, key=lambda e: e.load)
            targets[seq.request] = target
            target.submit(seq, front=True)
        if seqs:
            log.warning("requests_requeued", num=len(seqs), num_engines=len(self.healthy()))

    def cancel(self, request: Request) -> None:
        request.cancelled = True
        for engine in self.engines:
            engine.cancel()

