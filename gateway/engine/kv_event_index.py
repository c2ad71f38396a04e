"""The gateway's own picture of which pool caches which blocks, for `--routing approx`.

Fed by each pool's cache events (BlockStored / BlockRemoved, the allocator's GetEvents), read
every `lag_s` seconds through that pool's own allocator client (`link.allocator`: pools may
live on different allocators), the way the KV-aware routers of NVIDIA Dynamo and llm-d follow
their engines' KV events. Between two polls it is stale. A prompt is matched here without any
allocator call: the gateway hashes its full blocks itself (common/block_hash.py, the profile
the allocator keys its cache by) and, per pool, counts the leading blocks the pool holds.

A pool is (re)read from a snapshot when it is new here, when the follower fell off its event
log (truncated), and when it was reset: a new epoch on our link, or an event log that went
backwards (another gateway reset it). A pool the allocator does not know is forgotten.

Single writer: polls and lookups run on the engine loop; a page of events is applied between
two awaits, so a lookup never sees half of one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import structlog

from common.block_hash import hash_block, root_hash
from gateway.clients.allocator_client import AllocatorClient, CacheEvent
from gateway.clients.call_failures import CallFailed, Unknown
from gateway.clients.pool_link import PoolLink
from gateway.engine.loop import Engine

log = structlog.get_logger(__name__)
MAX_EVENTS = 1024  # per GetEvents page
MAX_PAGES_PER_POLL = 64  # a pool that produces faster than this is read on at the next poll


@dataclass(slots=True)
class PoolBlocks:
    """One pool's cached blocks as its events say, up to event `seq`."""

    block_size: int
    model_fingerprint: str
    epoch: int  # our link's epoch when the snapshot was taken
    allocator: AllocatorClient  # the client it is followed through
    seq: int = 0
    # block_hash -> the blocks holding it. The allocator caches one block per hash, but a
    # hash can be removed from one block and stored in another: a REMOVED names its block.
    blocks: dict[bytes, set[int]] = field(default_factory=dict)

    def follows(self, link: PoolLink) -> bool:
        """Still the pool `link` talks to (not reset by our gateway, not moved)."""
        d = link.description
        return (self.epoch == link.epoch and self.allocator is link.allocator
                and (self.block_size, self.model_fingerprint)
                == (d.block_size, d.model_fingerprint))

    def apply(self, events: Sequence[CacheEvent]) -> None:
        for event in events:
            if event.stored:
                self.blocks.setdefault(event.block_hash, set()).add(event.block_id)
            else:
                holders = self.blocks.get(event.block_hash)
                if holders is not None:
                    holders.discard(event.block_id)
                    if not holders:
                        del self.blocks[event.block_hash]
            self.seq = event.seq


@dataclass(slots=True)
class KvEventIndex:
    lag_s: float  # seconds between two polls: how stale the index may be
    max_events: int = MAX_EVENTS
    pools: dict[str, PoolBlocks] = field(default_factory=dict)  # by pool_id
    failing: set[str] = field(default_factory=set)  # pools whose last poll failed (logged once)

    def cached_tokens(
        self, token_ids: Sequence[int], cache_salt: str, pool_ids: Iterable[str]
    ) -> dict[str, int]:
        """Per pool, the tokens of the longest run of the prompt's leading full blocks it
        holds, capped as the allocator's MatchPrefix is: the last token is always computed.
        Hashing stops at the first block no pool holds."""
        groups: dict[tuple[str, int], list[str]] = {}  # pools that hash alike
        for pool_id in pool_ids:
            pool = self.pools.get(pool_id)
            if pool is not None and pool.blocks:
                groups.setdefault((pool.model_fingerprint, pool.block_size), []).append(pool_id)
        tokens = list(token_ids)
        cached: dict[str, int] = {}
        for (fingerprint, block_size), holding in groups.items():
            parent = root_hash(fingerprint, cache_salt)
            for index in range((len(tokens) - 1) // block_size):
                parent = hash_block(parent, tokens[index * block_size : (index + 1) * block_size])
                holding = [p for p in holding if parent in self.pools[p].blocks]
                if not holding:
                    break
                for pool_id in holding:
                    cached[pool_id] = (index + 1) * block_size
        return cached

    async def follow(self, engines: Callable[[], Iterable[Engine]]) -> None:
        """Poll every `lag_s` seconds, the engines of the moment (they join and leave)."""
        while True:
            try:
                await self.poll([e.link for e in engines()])
            except Exception:  # noqa: BLE001 - a bug must not freeze the index for good
                log.exception("kv_events_follow_failed")
            await asyncio.sleep(self.lag_s)

    async def poll(self, links: Iterable[PoolLink]) -> None:
        """Catch up with each pool's events; forget the pools no longer listed."""
        links = list(links)
        for gone in self.pools.keys() - {link.pool_id for link in links}:
            del self.pools[gone]
        for link in links:
            try:
                await self._catch_up(link)
            except CallFailed as exc:
                if isinstance(exc, Unknown):  # not (or no longer) registered there
                    self.pools.pop(link.pool_id, None)
                if link.pool_id not in self.failing:
                    self.failing.add(link.pool_id)
                    log.warning("kv_events_poll_failed", pool_id=link.pool_id, code=exc.status,
                                detail=exc.details)
            else:
                if link.pool_id in self.failing:
                    self.failing.discard(link.pool_id)
                    log.info("kv_events_poll_recovered", pool_id=link.pool_id)

    async def _catch_up(self, link: PoolLink) -> None:
        pool = self.pools.get(link.pool_id)
        if pool is None or not pool.follows(link):
            await self._snapshot(link)
            return
        for _ in range(MAX_PAGES_PER_POLL):
            page = await link.allocator.get_events(link.pool_id, pool.seq, self.max_events)
            if page.truncated or page.last_seq < pool.seq:
                # Fell off the log, or the log restarted: the pool was reset under us.
                await self._snapshot(link)
                return
            pool.apply(page.events)
            if not page.events or pool.seq >= page.last_seq:
                return

    async def _snapshot(self, link: PoolLink) -> None:
        epoch, description = link.epoch, link.description  # as they were when asked
        snapshot = await link.allocator.get_snapshot(link.pool_id)
        blocks: dict[bytes, set[int]] = {}
        for block in snapshot.blocks:
            blocks.setdefault(block.block_hash, set()).add(block.block_id)
        self.pools[link.pool_id] = PoolBlocks(
            block_size=description.block_size, model_fingerprint=description.model_fingerprint,
            epoch=epoch, allocator=link.allocator, seq=snapshot.seq, blocks=blocks,
        )
        log.info("kv_events_snapshot", pool_id=link.pool_id, seq=snapshot.seq,
                 num_blocks=len(snapshot.blocks))
