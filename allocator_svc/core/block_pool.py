"""The block pool: the only code that changes ref counts, the free queue or the hash map.

NOTE: eviction is lazy. "Free" (ref_count 0) and "cached" (has a hash) are independent: a
freed block keeps its hash and contents until it is popped for reuse, so a later request can
revive it. Unhashed freed blocks go to the head of the free queue (reused first), hashed ones
to the tail (evicted last).

NOTE: a pinned hash (pins.py) holds one reference on the block that caches it, for as long as
any pin names it: taken when the pin is made if the hash is cached then, else the moment a
commit caches it. So a pinned block never enters the free queue and is never evicted; when
the last pin naming it goes, the reference is dropped like a request's and the block goes to
the LRU tail, still cached and revivable.

NOTE: with a CPU tier (cpu_blocks.py), evicting a cached block first offers its KV to the
tier, which plans a device -> CPU copy of it; the block is then reused as without one.
"""

from __future__ import annotations

from collections.abc import Iterable

from allocator_svc.core.cpu_blocks import CpuBlocks
from allocator_svc.core.events import EventLog
from allocator_svc.core.free_queue import Block, FreeQueue


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool, events: EventLog) -> None:
        self.blocks: list[Block] = [Block(block_id) for block_id in range(num_blocks)]
        self.free_queue = FreeQueue(self.blocks)
        self.cached: dict[bytes, Block] = {}  # block_hash -> the block holding it
        # The same entries by hash input (parent hash + packed tokens): a prefix lookup finds
        # a cached block without hashing it (SHA-256 was half of an admission).
        self.by_key: dict[bytes, Block] = {}
        self.enable_caching = enable_caching
        self.events = events
        self.num_evictions = 0
        # Hashes some pin names; each one cached holds one reference for the pins (num_pinned
        # of them: the rest are pending, attached when a commit caches them).
        self.pinned: set[bytes] = set()
        self.num_pinned = 0
        self.cpu_tier: CpuBlocks | None = None  # where evicted cached blocks go (None: nowhere)

    @property
    def num_free(self) -> int:
        return self.free_queue.num_blocks

    def allocate(self, num_blocks: int, to_tier: bool = True) -> list[Block] | None:
        """Take `num_blocks` fresh blocks (ref_count 1), evicting cached ones; None if short.
        `to_tier` False: the evicted blocks are not offered to the CPU tier (a call with no
        step to carry the copy, as a hand-off's reservation)."""
        if num_blocks > self.free_queue.num_blocks:
            return None
        taken = self.free_queue.popleft_n(num_blocks)
        evicted = [block for block in taken if block.block_hash is not None]
        if evicted:
            self._evict(evicted, self.cpu_tier if to_tier else None)
        for block in taken:
            block.ref_count = 1
        return taken

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take one more reference on each block, reviving it from the free queue if free."""
        for block in blocks:
            if block.ref_count == 0:
                self.free_queue.remove(block)
            block.ref_count += 1

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop one reference from each block, in the given order (callers pass last first)."""
        for block in blocks:
            assert block.ref_count > 0, f"block {block.block_id} freed with ref_count 0"
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    def cache(
        self,
        block: Block,
        block_hash: bytes,
        key: bytes,
        parent_hash: bytes | None,
        token_ids: list[int],
    ) -> bool:
        """Make `block` the prefix-cache entry for `block_hash` (whose hash input is `key`);
        False if another block has it."""
        if not self.enable_caching or block.block_hash is not None:
            return False
        if block_hash in self.cached:
            return False  # computed twice concurrently: keep the first, this one stays private
        block.block_hash, block.chain_key = block_hash, key
        self.cached[block_hash] = self.by_key[key] = block
        self.events.stored_blocks([block_hash], [block.block_id], [parent_hash], token_ids)
        if self.pinned and block_hash in self.pinned:
            self._hold_for_pins([block], [block_hash])
        return True

    def cache_run(
        self,
        blocks: list[Block],
        hashes: list[bytes],
        keys: list[bytes],
        parent: bytes | None,
        token_ids: list[int],
    ) -> None:
        """`cache` for consecutive full blocks of one chain (a commit): each block's parent is
        the block before it, the first one's is `parent`."""
        if blocks:
            self.cache_blocks(blocks, hashes, keys, [parent, *hashes[:-1]], token_ids)

    def cache_blocks(
        self,
        blocks: list[Block],
        hashes: list[bytes],
        keys: list[bytes],
        parents: list[bytes | None],
        token_ids: list[int],
    ) -> None:
        """`cache` for full blocks with their parents (a decode step's commits: one block per
        request), recorded as one event run; `token_ids` holds their tokens, block after
        block. A block whose hash is cached already stays private and records no event."""
        if not self.enable_caching or not blocks:
            return
        cached, by_key = self.cached, self.by_key
        block_size = len(token_ids) // len(blocks)
        keep = []
        for index, (block, block_hash, key) in enumerate(zip(blocks, hashes, keys, strict=True)):
            if block.block_hash is None and block_hash not in cached:
                block.block_hash, block.chain_key = block_hash, key
                cached[block_hash] = by_key[key] = block
                keep.append(index)
        if len(keep) < len(blocks):  # some were cached already: record only the new entries
            token_ids = [t for i in keep for t in token_ids[i * block_size : (i + 1) * block_size]]
            blocks, hashes, parents = (
                [blocks[i] for i in keep],
                [hashes[i] for i in keep],
                [parents[i] for i in keep],
            )
        if blocks:
            self.events.stored_blocks(hashes, [b.block_id for b in blocks], parents, token_ids)
            if self.pinned and not self.pinned.isdisjoint(hashes):
                pinned = [i for i, h in enumerate(hashes) if h in self.pinned]
                self._hold_for_pins([blocks[i] for i in pinned], [hashes[i] for i in pinned])

    # Pins: hashes whose cached block is held out of the free queue.

    def pin(self, hashes: list[bytes]) -> int:
        """Pin hashes no pin names yet: the cached ones are held (revived if free) now, the
        others once cached. Returns how many were cached."""
        assert self.enable_caching, "pins need prefix caching"
        assert self.pinned.isdisjoint(hashes), "a hash pinned twice"
        self.pinned.update(hashes)
        cached = [h for h in hashes if h in self.cached]
        if cached:
            self._hold_for_pins([self.cached[h] for h in cached], cached)
        return len(cached)

    def unpin(self, hashes: list[bytes]) -> int:
        """No pin names these hashes any more (a chain, in order): their cached blocks lose
        the pins' reference, last first as a request's (the prefix outlives its suffix in the
        LRU). Returns how many were cached."""
        assert self.pinned.issuperset(hashes), "unpinning a hash no pin names"
        self.pinned.difference_update(hashes)
        cached = [h for h in reversed(hashes) if h in self.cached]
        if cached:
            blocks = [self.cached[h] for h in cached]
            self.free(blocks)
            self.num_pinned -= len(blocks)
            self.events.pin_run(False, cached, [b.block_id for b in blocks])
        return len(cached)

    def _hold_for_pins(self, blocks: list[Block], hashes: list[bytes]) -> None:
        """The cached blocks of pinned hashes: one reference each, for the pins (revived from
        the free queue if free)."""
        self.touch(blocks)
        self.num_pinned += len(blocks)
        self.events.pin_run(True, hashes, [b.block_id for b in blocks])

    def _evict(self, blocks: list[Block], tier: CpuBlocks | None) -> None:
        cached, by_key = self.cached, self.by_key
        hashes = []
        for block in blocks:
            block_hash, key = block.block_hash, block.chain_key
            assert block_hash is not None and key is not None and cached.get(block_hash) is block
            if tier is not None:
                tier.keep(block.block_id, block_hash, key)
            del cached[block_hash]
            del by_key[key]
            block.block_hash = block.chain_key = None
            hashes.append(block_hash)
        self.num_evictions += len(blocks)
        self.events.removed_run(hashes, [block.block_id for block in blocks])

    @property
    def num_cached_free(self) -> int:
        return sum(1 for block in self.free_queue if block.block_hash is not None)

    def check_invariants(self, tables: Iterable[list[Block]]) -> None:
        """The whole contract; `tables` are every block table that holds blocks of this pool.
        The pins hold one more reference on each cached block of a pinned hash."""
        refs = [0] * len(self.blocks)
        for table in tables:
            for block in table:
                assert self.blocks[block.block_id] is block, f"foreign block {block.block_id}"
                refs[block.block_id] += 1
        held = [self.cached[h] for h in self.pinned if h in self.cached]
        for block in held:
            refs[block.block_id] += 1
        assert len(held) == self.num_pinned, f"{self.num_pinned} pinned blocks counted, {len(held)}"
        assert not self.pinned or self.enable_caching, "pins without prefix caching"
        queued = 0
        for block in self.free_queue:
            assert block.in_free_queue and block.ref_count == 0, f"bad free {block.block_id}"
            queued += 1
        assert queued == self.free_queue.num_blocks, "free queue length out of sync"
        for block in self.blocks:
            assert block.ref_count == refs[block.block_id], (
                f"block {block.block_id}: ref_count {block.ref_count} != {refs[block.block_id]}"
                " tables (and pins) holding it"
            )
            assert block.in_free_queue == (block.ref_count == 0), (
                f"block {block.block_id}: free iff ref_count is 0"
            )
            assert (block.chain_key is None) == (block.block_hash is None), (
                f"block {block.block_id}: a hash input without a hash, or the reverse"
            )
            if block.block_hash is not None:
                assert self.cached.get(block.block_hash) is block, (
                    f"block {block.block_id} carries a hash the map does not point at it for"
                )
        for block_hash, block in self.cached.items():
            assert block.block_hash == block_hash, f"hash map entry for block {block.block_id}"
            assert block.chain_key is not None and self.by_key.get(block.chain_key) is block, (
                f"cached block {block.block_id} is not indexed by its hash input"
            )
        assert len(self.by_key) == len(self.cached), "the two prefix-cache indexes differ"
