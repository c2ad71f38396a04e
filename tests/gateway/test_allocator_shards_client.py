"""The gateway's allocator shards against two real sharded allocator servers on loopback:
each pool registers with its own shard (the other refuses it), and MatchPrefix asks every
shard about its own pools, leaving out a shard that is down."""

from __future__ import annotations

import asyncio

import pytest

from allocator_svc.__main__ import SERVICE_NAME
from allocator_svc.core.allocator import Allocator, Limits
from allocator_svc.service import AllocatorServicer
from common.credentials import InternalAuth
from common.server import Server, start_server
from common.sharding import shard_of
from gateway.clients.allocator_client import PoolSpec
from gateway.clients.call_failures import Lost, Stale
from gateway.clients.shards import AllocatorShards

pytestmark = pytest.mark.service

NUM_SHARDS = 2
POOLS = [f"pool-{i}" for i in range(6)]  # both shards own some: checked below


def spec(pool_id: str, num_shards: int = NUM_SHARDS) -> PoolSpec:
    return PoolSpec(pool_id=pool_id, num_blocks=32, block_size=4, num_cpu_blocks=0,
                    model_fingerprint="m", executor_instance_id="i", enable_prefix_caching=True,
                    num_shards=num_shards)


async def start_shards() -> list[Server]:
    return [await start_server([(AllocatorServicer(Allocator(Limits()), None, index, NUM_SHARDS),
                                 SERVICE_NAME)], "127.0.0.1", 0)
            for index in range(NUM_SHARDS)]


def test_pools_register_with_their_shard_and_prefix_matches_span_the_shards():
    assert {shard_of(p, NUM_SHARDS) for p in POOLS} == {0, 1}

    async def scenario() -> None:
        servers = await start_shards()
        shards = AllocatorShards.connect([f"127.0.0.1:{s.port}" for s in servers], 5.0,
                                         InternalAuth(), 10_000)
        try:
            for pool_id in POOLS:
                await shards.for_pool(pool_id).client.register_pool(spec(pool_id))
                wrong = shards.shards[1 - shards.for_pool(pool_id).index]
                with pytest.raises(Stale, match="belongs to allocator shard"):
                    await wrong.client.register_pool(spec(pool_id))
                # A gateway that counts the shards otherwise is refused by every shard.
                for shard in shards.shards:
                    with pytest.raises(Stale, match="the caller splits pools across 3 allocator"
                                       r" shard\(s\), this allocator is shard"):
                        await shard.client.register_pool(spec(pool_id, num_shards=3))
            matches = await shards.match_prefix([1, 2, 3, 4, 5], "", POOLS, "r")
            assert sorted(m.pool_id for m in matches) == POOLS
            await servers[0].server.stop(None)  # shard 0 goes away
            matches = await shards.match_prefix([1, 2, 3, 4, 5], "", POOLS, "r")
            assert sorted(m.pool_id for m in matches) == [
                p for p in POOLS if shard_of(p, NUM_SHARDS) == 1]
            await servers[1].server.stop(None)
            with pytest.raises(Lost):
                await shards.match_prefix([1, 2, 3, 4, 5], "", POOLS, "r")
            assert await shards.match_prefix([1, 2], "", [], "r") == []
        finally:
            await shards.close()
            for server in servers:
                await server.server.stop(None)

    asyncio.run(scenario())
