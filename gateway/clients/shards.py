"""The allocator as shards: each pool belongs to one allocator process (common/sharding.py
says which), and the gateway holds one client and one lease per shard.

An engine talks only to its own pool's shard (its PoolLink carries that shard's client and
lease), so a shard that goes away touches only the engines of its pools: their requests are
readmitted while it is away and fail with UNAVAILABLE past the engine's retry window
(engine/recovery.py), and the pools are registered again when it returns. Routing asks every
shard about its own pools at once; a shard that does not answer leaves its pools out of that
one decision.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import structlog

from common.credentials import InternalAuth
from common.sharding import shard_of
from gateway.clients.allocator_client import AllocatorClient, PrefixMatch
from gateway.clients.call_failures import CallFailed
from gateway.clients.lease import Lease

log = structlog.get_logger(__name__)


@dataclass(slots=True, eq=False)
class AllocatorShard:
    index: int
    client: AllocatorClient
    lease: Lease

    @property
    def address(self) -> str:
        return self.client.address


@dataclass(slots=True)
class AllocatorShards:
    shards: list[AllocatorShard]

    @classmethod
    def connect(cls, addresses: Sequence[str], timeout_s: float, auth: InternalAuth,
                lease_ttl_ms: int) -> AllocatorShards:
        """Clients and (not yet acquired) leases; `addresses` in shard order."""
        shards = []
        for index, address in enumerate(addresses):
            client = AllocatorClient(address, timeout_s=timeout_s, auth=auth)
            shards.append(AllocatorShard(index, client, Lease(allocator=client,
                                                               ttl_ms=lease_ttl_ms)))
        return cls(shards)

    def for_pool(self, pool_id: str) -> AllocatorShard:
        return self.shards[shard_of(pool_id, len(self.shards))]

    @property
    def num_lease_acquisitions(self) -> int:
        return sum(shard.lease.generation for shard in self.shards)

    async def match_prefix(
        self, token_ids: Sequence[int], cache_salt: str, pool_ids: Sequence[str],
        request_id: str,
    ) -> list[PrefixMatch]:
        """Every shard's answer for its own pools. A shard that fails is left out (logged);
        only when every shard asked failed does the call fail."""
        by_shard: dict[int, list[str]] = {}
        for pool_id in pool_ids:
            by_shard.setdefault(shard_of(pool_id, len(self.shards)), []).append(pool_id)
        if not by_shard:
            return []
        if len(by_shard) == 1:  # the common case: no gather, failures raise as they are
            ((index, pools),) = by_shard.items()
            return await self.shards[index].client.match_prefix(token_ids, cache_salt, pools,
                                                               request_id)
        answers = await asyncio.gather(
            *(self.shards[index].client.match_prefix(token_ids, cache_salt, pools, request_id)
              for index, pools in by_shard.items()),
            return_exceptions=True,
        )
        matches: list[PrefixMatch] = []
        failures: list[CallFailed] = []
        for index, answer in zip(by_shard, answers, strict=True):
            if isinstance(answer, CallFailed):
                failures.append(answer)
                log.info("match_prefix_shard_failed", shard=index, code=answer.status)
            elif isinstance(answer, BaseException):
                raise answer
            else:
                matches.extend(answer)
        if len(failures) == len(by_shard):
            raise failures[0]
        return matches

    async def close(self) -> None:
        for shard in self.shards:
            await shard.client.close()
