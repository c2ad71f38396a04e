"""--routing round-robin and approx next to exact, over a real allocator server on loopback
that counts the RPCs it answers: neither of the two calls MatchPrefix on the request path."""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from common.errors import Unavailable
from gateway.api.sampling import SamplingOptions
from gateway.clients.pool_link import PoolLink
from gateway.core.request_state import Request, Sequence
from gateway.engine.router import Router
from tests.gateway.loopback_allocator import LoopbackAllocator, cache

pytestmark = pytest.mark.service

P = list(range(100, 113))  # 3 full blocks of 4, and a last token


@dataclass
class FakeScheduler:
    waiting: deque[Sequence] = field(default_factory=deque)


@dataclass(eq=False)
class FakeEngine:
    """What the router reads of an engine; `link` is a real pool's."""

    pool_id: str
    link: PoolLink | None = None
    load: int = 0
    healthy: bool = True
    draining: bool = False
    num_admitted: int = 0
    allocator_down_since: float | None = None
    scheduler: FakeScheduler = field(default_factory=FakeScheduler)
    description: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(role="both"))

    def submit(self, seq: Sequence, front: bool = False) -> None:
        self.scheduler.waiting.append(seq)
        self.load += 1


def request(prompt: list[int], salt: str = "") -> Request:
    return Request(request_id="r", prompt_token_ids=prompt,
                   sampling=SamplingOptions(max_tokens=4), cache_salt=salt)


def router(engines: list[FakeEngine], allocator: LoopbackAllocator, policy: str) -> Router:
    return Router(engines=engines, allocator=allocator.client,  # type: ignore[arg-type]
                  max_waiting=64, policy=policy, kv_events_lag_s=0.05)


def test_round_robin_cycles_skipping_unhealthy_and_draining_engines():
    # a, b, c in turn whatever their load; b down, then c leaving: the others in turn; none
    # left: UNAVAILABLE. No MatchPrefix at any point.
    async def scenario() -> None:
        allocator = await LoopbackAllocator.start()
        try:
            a, b, c = FakeEngine("a", load=9), FakeEngine("b"), FakeEngine("c")
            routing = router([a, b, c], allocator, "round-robin")

            async def picks(n: int) -> list[str]:
                return [(await routing.route(request(P))).pool_id for _ in range(n)]

            assert await picks(4) == ["a", "b", "c", "a"]
            b.healthy = False
            assert await picks(3) == ["c", "a", "c"]
            c.draining = True
            assert await picks(2) == ["a", "a"]
            b.healthy = True
            assert await picks(3) == ["b", "a", "b"]
            a.healthy = b.healthy = False
            with pytest.raises(Unavailable):
                await routing.route(request(P))
            assert allocator.calls("MatchPrefix") == 0
        finally:
            await allocator.close()

    asyncio.run(scenario())


def test_approx_routes_by_its_own_index_without_calling_match_prefix():
    # P is cached in b: approx sends it there although b is busier, and a prompt cached
    # nowhere to the least loaded pool; the allocator answers no MatchPrefix. exact, as a
    # control, picks b too with one MatchPrefix.
    async def scenario() -> None:
        allocator = await LoopbackAllocator.start()
        a = FakeEngine("a", link=await allocator.link("a"), load=0)
        b = FakeEngine("b", link=await allocator.link("b"), load=5)
        routing = router([a, b], allocator, "approx")
        follower = asyncio.create_task(routing.follow_cache_events())
        try:
            assert b.link is not None
            await cache(b.link, "warm", P)
            for _ in range(100):  # the follower reads the events within a few polls
                if (await routing.route(request(P))) is b:
                    break
                await asyncio.sleep(0.02)
            assert await routing.route(request(P)) is b
            assert await routing.route(request(P, salt="another-tenant")) is a
            assert await routing.route(request(list(range(900, 920)))) is a
            assert allocator.calls("MatchPrefix") == 0 and allocator.calls("GetSnapshot") >= 2
            assert await router([a, b], allocator, "exact").route(request(P)) is b
            assert allocator.calls("MatchPrefix") == 1
        finally:
            follower.cancel()
            await asyncio.gather(follower, return_exceptions=True)
            await allocator.close()

    asyncio.run(scenario())


def test_approx_decides_on_its_lagging_view_until_the_next_poll():
    # b holds 2 blocks of P, then a the whole of P: until the next poll approx still says b
    # (exact already says a); after it, a. An unhealthy a is skipped whatever it caches.
    async def scenario() -> None:
        allocator = await LoopbackAllocator.start()
        try:
            a = FakeEngine("a", link=await allocator.link("a"))
            b = FakeEngine("b", link=await allocator.link("b"))
            assert a.link is not None and b.link is not None
            routing = router([a, b], allocator, "approx")
            assert routing.kv_index is not None
            await cache(b.link, "r1", P[:9])
            await routing.kv_index.poll([a.link, b.link])
            assert await routing.route(request(P)) is b
            await cache(a.link, "r2", P)
            assert await router([a, b], allocator, "exact").route(request(P)) is a
            assert await routing.route(request(P)) is b  # stale
            await routing.kv_index.poll([a.link, b.link])
            assert await routing.route(request(P)) is a
            a.healthy = False
            assert await routing.route(request(P)) is b
            b.draining = True
            with pytest.raises(Unavailable):
                await routing.route(request(P))
        finally:
            await allocator.close()

    asyncio.run(scenario())


def test_only_approx_has_an_index_and_an_unknown_policy_is_a_bug():
    # exact and round-robin keep no index (nothing to follow); a policy the flags would have
    # refused is an assertion.
    assert Router(engines=[], allocator=None, max_waiting=1).kv_index is None  # type: ignore[arg-type]
    assert Router(engines=[], allocator=None, max_waiting=1,  # type: ignore[arg-type]
                  policy="round-robin").kv_index is None
    assert Router(engines=[], allocator=None, max_waiting=1,  # type: ignore[arg-type]
                  policy="approx", kv_events_lag_s=0.5).kv_index is not None
    with pytest.raises(AssertionError, match="routing policy"):
        Router(engines=[], allocator=None, max_waiting=1, policy="bogus")  # type: ignore[arg-type]
