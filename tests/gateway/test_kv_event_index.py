"""The gateway's approximate prefix index (--routing approx) against the allocator's own
MatchPrefix, on a real allocator server on loopback: equal once caught up, stale before."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from dataclasses import replace
from types import SimpleNamespace

import pytest

from gateway.clients.allocator_client import AllocatorClient, CacheEvent
from gateway.engine.kv_event_index import KvEventIndex, PoolBlocks
from tests.gateway.loopback_allocator import LoopbackAllocator, cache

pytestmark = pytest.mark.service

P = list(range(100, 113))  # 13 tokens: 3 full blocks of 4
Q = P[:8] + list(range(500, 508))  # P's first 2 blocks, then its own 2
R = list(range(300, 306))  # 1 full block


def unused_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run(scenario: Callable[[LoopbackAllocator], Awaitable[None]], event_capacity: int = 65536
        ) -> None:
    async def main() -> None:
        allocator = await LoopbackAllocator.start(event_capacity)
        try:
            await scenario(allocator)
        finally:
            await allocator.close()

    asyncio.run(main())


async def agrees(index: KvEventIndex, allocator: LoopbackAllocator, prompt: list[int],
                 pool_ids: list[str], salt: str = "") -> dict[str, int]:
    """The index's answer, asserted equal to the allocator's (pools with none left out)."""
    mine = index.cached_tokens(prompt, salt, pool_ids)
    reference = {p: n for p, n in (await allocator.match(prompt, pool_ids, salt)).items() if n}
    assert mine == reference, (prompt, salt)
    return mine


def test_kv_index_equals_match_prefix_once_caught_up():
    # Prefixes, a branch and a salted copy over two pools, read in pages of 3 events: every
    # prompt's cached tokens per pool are the allocator's.
    async def scenario(allocator: LoopbackAllocator) -> None:
        a, b = await allocator.link("a", num_blocks=32), await allocator.link("b", num_blocks=32)
        index = KvEventIndex(lag_s=1.0, max_events=3)
        await index.poll([a, b])  # both new: empty snapshots
        await cache(a, "r1", P)
        await cache(a, "r2", R)
        await cache(b, "r3", Q)
        await cache(b, "r4", P, salt="tenant-x")
        await index.poll([a, b])
        assert allocator.calls("GetSnapshot") == 2 and allocator.calls("GetEvents") >= 4
        assert await agrees(index, allocator, P, ["a", "b"]) == {"a": 12, "b": 8}
        assert await agrees(index, allocator, P + [1, 2, 3], ["a", "b"]) == {"a": 12, "b": 8}
        assert await agrees(index, allocator, Q + [9], ["a", "b"]) == {"a": 8, "b": 16}
        assert await agrees(index, allocator, Q, ["a", "b"]) == {"a": 8, "b": 12}  # last token
        assert await agrees(index, allocator, P, ["a", "b"], salt="tenant-x") == {"b": 12}
        assert await agrees(index, allocator, R, ["a", "b"]) == {"a": 4}
        for prompt in (P[:4], P[:5], [1, 2, 3, 4, 5], []):
            await agrees(index, allocator, prompt, ["a", "b"])
        await agrees(index, allocator, P, ["a", "b"], salt="tenant-y")
        assert index.cached_tokens(P, "", ["b"]) == {"b": 8}  # only the pools asked about

    run(scenario)


def test_kv_index_is_stale_until_its_next_poll():
    # A prefix cached after the last poll is unknown to the index, known after the next one.
    async def scenario(allocator: LoopbackAllocator) -> None:
        a = await allocator.link("a")
        index = KvEventIndex(lag_s=1.0)
        await index.poll([a])
        await cache(a, "r1", P)
        assert (await allocator.match(P, ["a"]))["a"] == 12
        assert index.cached_tokens(P, "", ["a"]) == {}
        await index.poll([a])
        assert index.cached_tokens(P, "", ["a"]) == {"a": 12}

    run(scenario)


def test_kv_index_drops_evicted_blocks_and_takes_a_hash_stored_again():
    # 8 blocks: Q (4 blocks cached) then a 32-token prompt evicts all of Q; P cached again
    # evicts 3 of the big one's blocks and stores hashes... each step agrees with MatchPrefix.
    async def scenario(allocator: LoopbackAllocator) -> None:
        a = await allocator.link("a", num_blocks=8)
        index = KvEventIndex(lag_s=1.0)
        await index.poll([a])
        big = list(range(700, 732))
        await cache(a, "r1", Q)
        await index.poll([a])
        assert await agrees(index, allocator, Q + [1], ["a"]) == {"a": 16}
        await cache(a, "r2", big)
        await index.poll([a])
        assert await agrees(index, allocator, Q + [1], ["a"]) == {}
        assert await agrees(index, allocator, big, ["a"]) == {"a": 28}
        await cache(a, "r3", Q)  # Q's hashes stored again, in other blocks
        await index.poll([a])
        assert await agrees(index, allocator, Q + [1], ["a"]) == {"a": 16}
        await agrees(index, allocator, big, ["a"])
        assert sum(len(ids) for ids in index.pools["a"].blocks.values()) == 8

    run(scenario)


def test_kv_index_a_removal_names_its_block():
    # Two blocks holding one hash (the allocator keeps one, but a removal and a store may
    # cross): removing block 1 keeps the hash, held by block 2.
    pool = PoolBlocks(block_size=4, model_fingerprint="fp", epoch=1, allocator=None)  # type: ignore[arg-type]
    pool.apply([CacheEvent(1, True, b"h", 1), CacheEvent(2, True, b"h", 2),
                CacheEvent(3, False, b"h", 1)])
    assert pool.blocks == {b"h": {2}} and pool.seq == 3
    pool.apply([CacheEvent(4, False, b"h", 2), CacheEvent(5, False, b"unknown", 9)])
    assert pool.blocks == {} and pool.seq == 5


def test_kv_index_takes_a_snapshot_when_its_cursor_fell_off_the_log():
    # The allocator keeps 4 events; 5 happen between two polls: the index is told it lost
    # some (truncated) and reads a snapshot instead, then agrees again.
    async def scenario(allocator: LoopbackAllocator) -> None:
        a = await allocator.link("a", num_blocks=32)
        index = KvEventIndex(lag_s=1.0)
        await cache(a, "r1", R)
        await index.poll([a])
        assert index.pools["a"].seq == 1 and allocator.calls("GetSnapshot") == 1
        await cache(a, "r2", P)
        await cache(a, "r3", Q)
        await index.poll([a])
        assert allocator.calls("GetSnapshot") == 2
        assert index.pools["a"].seq == 6  # R 1, P 3, Q 2 (its first 2 are P's)
        assert await agrees(index, allocator, P, ["a"]) == {"a": 12}
        assert await agrees(index, allocator, Q + [1], ["a"]) == {"a": 16}
        assert await agrees(index, allocator, R, ["a"]) == {"a": 4}

    run(scenario, event_capacity=4)


def test_kv_index_forgets_the_blocks_of_a_reset_pool():
    # Reset by our own gateway (a new epoch on our link) and by another one (our link's epoch
    # unchanged, the pool's event log restarted): stale hashes go, new ones are read.
    async def scenario(allocator: LoopbackAllocator) -> None:
        a = await allocator.link("a", num_blocks=32)
        index = KvEventIndex(lag_s=1.0)
        await index.poll([a])
        await cache(a, "r1", P)
        await index.poll([a])
        assert index.cached_tokens(P, "", ["a"]) == {"a": 12}
        epoch = a.epoch
        a.description = replace(a.description, instance_id="instance-1")
        await a.register()  # the executor restarted: the pool is reset
        assert a.epoch != epoch
        x = list(range(800, 820))
        await cache(a, "r2", x)  # 5 events at the new pool: its log is past our cursor (3)
        await index.poll([a])
        assert await agrees(index, allocator, P, ["a"]) == {}
        assert await agrees(index, allocator, x + [1], ["a"]) == {"a": 20}
        other = await allocator.link("a", num_blocks=32, instance_id="instance-2")
        await cache(other, "r3", R)  # the new pool's log is at 1: ours was at 5
        await index.poll([a])
        assert await agrees(index, allocator, x + [1], ["a"]) == {}
        assert await agrees(index, allocator, R, ["a"]) == {"a": 4}

    run(scenario)


def test_kv_index_a_failing_poll_changes_nothing_and_an_unknown_pool_is_forgotten():
    # The allocator becomes unreachable: the index keeps what it knew. Another allocator
    # where the pool is not registered (a restart): the pool's blocks are forgotten.
    async def scenario(allocator: LoopbackAllocator) -> None:
        a = await allocator.link("a")
        ghost = await allocator.link("ghost", register=False)
        index = KvEventIndex(lag_s=1.0)
        await cache(a, "r1", P)
        await index.poll([a, ghost])
        assert set(index.pools) == {"a"} and index.failing == {"ghost"}
        unreachable = AllocatorClient(f"127.0.0.1:{unused_port()}", timeout_s=1)
        restarted = await LoopbackAllocator.start()
        try:
            a.allocator = unreachable
            await index.poll([a])
            assert index.cached_tokens(P, "", ["a"]) == {"a": 12}
            assert index.failing == {"a", "ghost"}
            a.allocator = restarted.client  # answers, without pool "a"
            await index.poll([a])
            assert index.pools == {} and index.cached_tokens(P, "", ["a"]) == {}
        finally:
            await unreachable.close()
            await restarted.close()

    run(scenario)


def test_kv_index_follower_polls_every_lag_and_follows_membership():
    # The follower task reads the engines' events every 50 ms: a new prefix is known within a
    # few polls; an engine that left the router is forgotten.
    async def scenario(allocator: LoopbackAllocator) -> None:
        a, b = await allocator.link("a"), await allocator.link("b")
        engines = [SimpleNamespace(link=a), SimpleNamespace(link=b)]
        index = KvEventIndex(lag_s=0.05)
        follower = asyncio.create_task(index.follow(lambda: engines))  # type: ignore[arg-type, return-value]
        try:
            await asyncio.sleep(0.2)
            await cache(b, "r1", P)
            for _ in range(100):
                if index.cached_tokens(P, "", ["a", "b"]):
                    break
                await asyncio.sleep(0.02)
            assert index.cached_tokens(P, "", ["a", "b"]) == {"b": 12}
            engines.pop()
            await asyncio.sleep(0.2)
            assert set(index.pools) == {"a"}
        finally:
            follower.cancel()
            await asyncio.gather(follower, return_exceptions=True)

    run(scenario)
