"""Routing: longest cached prefix first, then least loaded; backpressure; lost executors."""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from common.errors import ResourceExhausted, Unavailable
from gateway.api.sampling import SamplingOptions
from gateway.clients.allocator_client import PrefixMatch
from gateway.core.parking import Parking
from gateway.core.request_state import Request, Sequence
from gateway.engine.router import Router, initial_sequences


@dataclass
class FakeScheduler:
    waiting: deque[Sequence] = field(default_factory=deque)
    running: list[Sequence] = field(default_factory=list)
    swapped: list[Sequence] = field(default_factory=list)
    parking: Parking = field(default_factory=Parking)


@dataclass(eq=False)
class FakeEngine:
    pool_id: str
    load: int = 0
    healthy: bool = True
    draining: bool = False
    num_admitted: int = 0  # its sequences the allocator holds
    allocator_down_since: float | None = None  # its last Step did not reach the allocator
    scheduler: FakeScheduler = field(default_factory=FakeScheduler)
    cancelled: int = 0
    description: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(role="both"))

    def submit(self, seq: Sequence, front: bool = False) -> None:
        self.scheduler.waiting.append(seq)
        self.load += 1

    def cancel(self) -> None:
        self.cancelled += 1


@dataclass
class FakeAllocator:
    cached: dict[str, int]
    running: dict[str, int] = field(default_factory=dict)  # every gateway's, per pool

    async def match_prefix(self, token_ids, cache_salt, pool_ids, request_id):  # noqa: ANN001
        return [PrefixMatch(p, self.cached.get(p, 0), 0, self.running.get(p, 0))
                for p in pool_ids]


@dataclass
class LosingAllocator:
    """Loses executor `lost` while MatchPrefix is in flight (the engine's loop runs then)."""

    engines: list[FakeEngine]
    lost: set[str]
    cached: dict[str, int]

    async def match_prefix(self, token_ids, cache_salt, pool_ids, request_id):  # noqa: ANN001
        await asyncio.sleep(0)
        for engine in self.engines:
            if engine.pool_id in self.lost:
                engine.healthy = False
        return [PrefixMatch(p, self.cached.get(p, 0), 0, 0) for p in pool_ids]


def request(rid: str = "r", prompt: list[int] | None = None, n: int = 1) -> Request:
    return Request(request_id=rid, prompt_token_ids=prompt or [1, 2, 3],
                   sampling=SamplingOptions(max_tokens=4, n=n), cache_salt="")


def router(engines: list[FakeEngine], cached: dict[str, int] | None = None,
           max_waiting: int = 8) -> Router:
    return Router(engines=engines, allocator=FakeAllocator(cached or {}),  # type: ignore[arg-type]
                  max_waiting=max_waiting)


def test_router_prefers_longest_cached_prefix_over_load():
    # Pool b holds 32 cached tokens of the prompt although it is busier.
    a, b = FakeEngine("a", load=0), FakeEngine("b", load=5)
    chosen = asyncio.run(router([a, b], {"b": 32}).route(request()))
    assert chosen is b


def test_router_breaks_cache_ties_by_least_load():
    # No cached prefix anywhere: the least loaded pool wins.
    a, b = FakeEngine("a", load=3), FakeEngine("b", load=1)
    assert asyncio.run(router([a, b]).route(request())) is b


def test_router_skips_unhealthy_executors():
    # The cached pool is down: the healthy one gets the request.
    a, b = FakeEngine("a", healthy=False), FakeEngine("b")
    assert asyncio.run(router([a, b], {"a": 64}).route(request())) is b


def test_router_full_waiting_queue_is_resource_exhausted():
    # Two waiting requests and max_waiting 2: the third is refused.
    a = FakeEngine("a")
    r = router([a], max_waiting=2)
    asyncio.run(r.submit(request("r1")))
    asyncio.run(r.submit(request("r2")))
    with pytest.raises(ResourceExhausted, match="waiting queue is full"):
        asyncio.run(r.submit(request("r3")))


def test_router_without_healthy_executor_is_unavailable():
    # Every executor is down: new requests fail fast with UNAVAILABLE.
    with pytest.raises(Unavailable):
        asyncio.run(router([FakeEngine("a", healthy=False)]).route(request()))


def test_router_requeues_lost_sequences_or_fails_them():
    # Sequences of a lost executor go to the healthy one; with none left they get an error.
    a, b = FakeEngine("a", healthy=False), FakeEngine("b")
    req = request()
    seq = initial_sequences(req)[0]
    router([a, b]).requeue([seq])
    assert list(b.scheduler.waiting) == [seq]
    router([a]).requeue([seq])
    delta = req.outputs.get_nowait()
    assert isinstance(delta.error, Unavailable)


def test_initial_sequences_for_n():
    # n=1: the request id; n>1: one prefill parent; n>1 with a 1-token prompt: n plain ones.
    assert [s.seq_id for s in initial_sequences(request("x"))] == ["x"]
    (parent,) = initial_sequences(request("x", n=3))
    assert parent.is_prefill_parent and parent.seq_id == "x-prefill"
    seqs = initial_sequences(request("x", prompt=[1], n=2))
    assert [(s.seq_id, s.seed_offset) for s in seqs] == [("x-0", 0), ("x-1", 1)]


def test_router_skips_executor_lost_during_match_prefix():
    # Pool a holds the whole prefix but is lost while MatchPrefix is awaited: b gets it.
    a, b = FakeEngine("a"), FakeEngine("b")
    allocator = LosingAllocator([a, b], lost={"a"}, cached={"a": 64})
    r = Router(engines=[a, b], allocator=allocator, max_waiting=8)  # type: ignore[arg-type]
    assert asyncio.run(r.submit(request())) is b
    assert not a.scheduler.waiting and len(b.scheduler.waiting) == 1


def test_router_every_executor_lost_during_match_prefix_is_unavailable():
    # Both pools are lost while MatchPrefix is awaited: UNAVAILABLE, nothing queued.
    a, b = FakeEngine("a"), FakeEngine("b")
    allocator = LosingAllocator([a, b], lost={"a", "b"}, cached={})
    r = Router(engines=[a, b], allocator=allocator, max_waiting=8)  # type: ignore[arg-type]
    with pytest.raises(Unavailable):
        asyncio.run(r.submit(request()))
    assert not a.scheduler.waiting and not b.scheduler.waiting


def test_router_sends_nothing_new_to_a_draining_engine():
    # An executor that left discovery finishes its own requests and gets no new ones, nor
    # requeued ones.
    leaving, staying = FakeEngine("a", load=0, draining=True), FakeEngine("b", load=9)
    routing = router([leaving, staying], cached={"a": 3})  # even with its prefix cached
    assert routing.healthy() == [staying]  # type: ignore[comparison-overlap]
    engine = asyncio.run(routing.submit(request("r1", [1, 2, 3])))
    assert engine is staying and not leaving.scheduler.waiting


def test_router_balances_by_every_gateways_running_requests():
    # Two gateways over the same pools: this one's own load says "a", but the allocator
    # counts the other gateway's requests too (9 on "a", 3 on "b", 2 of them this
    # gateway's): "a" carries 9, "b" 3. With the cache equal, all gateways pick alike.
    a, b = FakeEngine("a", load=0), FakeEngine("b", load=2, num_admitted=2)
    routing = Router(engines=[a, b], max_waiting=8,  # type: ignore[list-item]
                     allocator=FakeAllocator({}, running={"a": 9, "b": 3}))  # type: ignore[arg-type]
    assert asyncio.run(routing.submit(request("r1"))) is b
    cached = Router(engines=[a, b], max_waiting=8,  # type: ignore[list-item]
                    allocator=FakeAllocator({"a": 16}, running={"a": 9, "b": 3}))  # type: ignore[arg-type]
    assert asyncio.run(cached.submit(request("r2"))) is a  # its prefix first


def test_a_burst_spreads_although_the_allocators_counts_lag():
    # The allocator still counts a request of "a" that this gateway has finished (its Free
    # rides on the next Step): a burst of six, each seeing those same counts, must not all go
    # to "b" (this gateway's own queue grows with each one it sends).
    a, b = FakeEngine("a"), FakeEngine("b")
    routing = Router(engines=[a, b], max_waiting=64,  # type: ignore[list-item]
                     allocator=FakeAllocator({}, running={"a": 1}))  # type: ignore[arg-type]
    picked = [asyncio.run(routing.submit(request(f"r{i}"))).pool_id for i in range(6)]
    assert picked.count("a") >= 2 and picked.count("b") >= 2, picked


@dataclass
class ShardDownAllocator(FakeAllocator):
    """Sharded, with the shard of the pools in `down` away: it answers for the others only."""

    down: set[str] = field(default_factory=set)

    async def match_prefix(self, token_ids, cache_salt, pool_ids, request_id):  # noqa: ANN001
        return [PrefixMatch(p, self.cached.get(p, 0), 0, 0) for p in pool_ids
                if p not in self.down]


def test_a_pool_whose_allocator_shard_is_away_gets_new_requests_last():
    # Its shard did not answer MatchPrefix: though it is idle and holds the longest prefix
    # (the last answer it gave), new requests go to the pool whose shard answered.
    a, b = FakeEngine("a", load=0), FakeEngine("b", load=5)
    r = Router(engines=[a, b], max_waiting=64,  # type: ignore[list-item]
               allocator=ShardDownAllocator(cached={"a": 64}, down={"a"}))  # type: ignore[arg-type]
    assert asyncio.run(r.route(request())) is b
    # Its engine's last Step failed to reach the allocator: the same, whatever MatchPrefix said.
    a.allocator_down_since = 1.0
    r = router([a, b], cached={"a": 64})
    assert asyncio.run(r.route(request())) is b
    # Every pool's shard away: still routed (the engine waits for its allocator, then fails).
    b.allocator_down_since = 2.0
    assert asyncio.run(r.route(request())) is a


def test_a_lost_executors_sequences_move_with_their_request():
    # A request's sequences (n > 1 children, a search's beams) go to one engine together, so
    # they can fork there; different requests still spread by load.
    b, c = FakeEngine("b"), FakeEngine("c")
    first, second = request("r1", n=3), request("r2", n=3)
    seqs = [Sequence(seq_id=f"{req.request_id}-{i}", request=req, index=i)
            for req in (first, second) for i in range(3)]
    router([b, c]).requeue(seqs)
    by_request = {req.request_id: {e.pool_id for e in (b, c)
                                   for s in e.scheduler.waiting if s.request is req}
                  for req in (first, second)}
    assert by_request == {"r1": {"b"}, "r2": {"c"}}


def role(name: str, role_name: str, **kwargs: object) -> FakeEngine:
    engine = FakeEngine(name, **kwargs)  # type: ignore[arg-type]
    engine.description = SimpleNamespace(role=role_name)
    return engine


def test_new_requests_go_to_prefill_executors_not_decode_ones():
    # A decode executor (--role decode) gets requests only by hand-off, however idle it is
    # and whatever it has cached; with round-robin too.
    prefill, decode = role("p", "prefill", load=9), role("d", "decode")
    assert asyncio.run(router([decode, prefill], {"d": 64}).route(request())) is prefill
    turns = Router(engines=[decode, prefill], allocator=FakeAllocator({}),  # type: ignore[arg-type]
                   max_waiting=8, policy="round-robin")
    assert [asyncio.run(turns.route(request())) for _ in range(3)] == [prefill] * 3


def test_decode_executors_take_new_requests_when_nothing_else_is_up():
    prefill, decode = role("p", "prefill", healthy=False), role("d", "decode")
    assert asyncio.run(router([prefill, decode]).route(request())) is decode


def test_a_leaving_engines_waiting_requests_move_unless_they_hold_blocks_there():
    # Request r1 waits with nothing admitted: it moves, to the least loaded engine. Request
    # r2 has a sequence running there (n = 2): its waiting one stays with it.
    leaving = FakeEngine("a", draining=True)
    busy, idle = FakeEngine("b", load=4), FakeEngine("c", load=1)
    r1, r2 = request("r1"), request("r2", n=2)
    lone = initial_sequences(r1)[0]
    running, waiting = Sequence("r2-0", r2, 0), Sequence("r2-1", r2, 1)
    leaving.scheduler.waiting.extend([lone, waiting])
    leaving.scheduler.running.append(running)
    routing = router([leaving, busy, idle])
    assert routing.move_waiting(leaving) == 1  # type: ignore[arg-type]
    assert list(leaving.scheduler.waiting) == [waiting]
    assert list(idle.scheduler.waiting) == [lone] and not busy.scheduler.waiting
