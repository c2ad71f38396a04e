"""A pool's CPU blocks: swap space for preempted requests and, with a capacity, the prefix
cache's CPU tier.

A CPU block is free, held by a swapped-out request, or a CPU-tier entry: a block hash whose KV
was copied here when its device block was evicted, so that a later prefix hit copies it back
instead of computing it again. The tier holds at most `capacity` entries in LRU order (the
first is evicted first), indexed by hash and by hash input as the device cache is.

NOTE: swap-outs of preempted requests come first: they take free CPU blocks, then evict the
tier's entries, LRU first. The tier takes a free block only while under its capacity; at it,
a new entry reuses the tier's own LRU entry's block.

NOTE: the commit rule holds for the tier too. An entry is made when a step's allocation evicts
a cached device block; its KV reaches the CPU when that step's batch runs (the executor applies
swap-outs before anything else). Until the caller confirms that step (commit_through_step_id,
scheduled_steps.py) the entry is *pending*: it holds its CPU block, no lookup finds it and
nothing evicts it. Once the step is confirmed it is written; if one of the step's requests was
aborted before, the executor may have refused the step, and the entry is dropped instead. An
unnumbered step (step_id 0) is never confirmed by id: its entries count as written at once.

NOTE: steps of one lease run at the executor in the order the allocator planned them, but two
leases (gateways) stepping one pool are not ordered against each other. So an entry a step
copies back (a hit) stays *loading* until that step is confirmed: nothing evicts it, and no
later step of any lease may write over it before the copy has run. Likewise a pending entry's
CPU block is not reused before its step is confirmed.

NOTE: within one step the executor applies every swap-out before any swap-in. So a CPU block
that the step being built reads (a swap-in's source) or writes (a swap-out's destination) is
*busy* until the step ends: nothing else in the step may write it. A swapped-in request's CPU
blocks become free only when the step ends.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice

from common.step_records import BlockCopy


@dataclass(slots=True, eq=False)
class CpuEntry:
    """One block of the CPU tier."""

    cpu_block_id: int
    block_hash: bytes
    chain_key: bytes  # the hash's input (parent hash + packed tokens): lookups use it
    written: bool = False  # the step that copied it here was confirmed: lookups find it
    num_loads: int = 0  # steps copying it back that are not confirmed yet

    @property
    def evictable(self) -> bool:
        return self.written and not self.num_loads


@dataclass(slots=True)
class TierOps:
    """What one step did to the CPU tier, settled when the step is confirmed."""

    stored: list[CpuEntry]  # entries its swap-outs write (pending)
    loaded: list[CpuEntry]  # entries its swap-ins read (loading)
    tainted: bool = False  # a request of it was aborted first: it may not have run


class CpuBlocks:
    """One pool's CPU blocks: free, a swapped-out request's, or a tier entry."""

    def __init__(self, num_blocks: int, capacity: int) -> None:
        assert 0 <= capacity <= num_blocks, f"CPU tier of {capacity} in {num_blocks} CPU blocks"
        self.num_blocks = num_blocks
        self.capacity = capacity  # most tier entries at once (0: no tier)
        self.free_ids: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() takes the lowest
        self.entries: OrderedDict[bytes, CpuEntry] = OrderedDict()  # by hash, LRU first
        self.by_key: dict[bytes, CpuEntry] = {}  # the same entries by hash input
        # The step being built (empty between steps).
        self.busy: set[int] = set()  # CPU blocks it reads or writes
        self.returning: list[int] = []  # swapped-in requests' blocks: free once it ends
        self.copies: list[BlockCopy] = []  # device -> CPU copies of the blocks it evicted
        self.kept: list[CpuEntry] = []  # the entries those copies make (pending)
        self.loaded: list[CpuEntry] = []  # the entries it copies back
        self.num_kept = 0  # evicted device blocks the tier took
        self.num_loaded = 0  # entries copied back to the device on a prefix hit
        self.num_evicted = 0  # entries dropped: for a swap-out, a newer entry, a failed step

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    # The tier.

    def lookup(self, key: bytes) -> CpuEntry | None:
        """The written entry with this hash input, if any."""
        entry = self.by_key.get(key)
        return entry if entry is not None and entry.written else None

    def load(self, entry: CpuEntry) -> None:
        """A prefix hit copies `entry` back this step: busy, loading until the step is
        confirmed, and most recently used."""
        self.busy.add(entry.cpu_block_id)
        self.entries.move_to_end(entry.block_hash)
        entry.num_loads += 1
        self.loaded.append(entry)
        self.num_loaded += 1

    def keep(self, block_id: int, block_hash: bytes, key: bytes) -> None:
        """A cached device block is evicted: copy its KV into the tier if a CPU block is
        free for it (or an entry may go), pending until the step is confirmed."""
        if not self.capacity:
            return
        if block_hash in self.entries:  # a copy is here already (it was loaded from here)
            self.entries.move_to_end(block_hash)
            return
        if len(self.entries) < self.capacity and self.free_ids:
            cpu_block_id = self.free_ids.pop()
        else:
            victim = next(self._evictable(), None)
            if victim is None:
                return  # no entry may go (pending, loading or busy): dropped, as without a tier
            self._drop(victim)
            cpu_block_id = victim.cpu_block_id
        entry = CpuEntry(cpu_block_id, block_hash, key)
        self.entries[block_hash] = self.by_key[key] = entry
        self.busy.add(cpu_block_id)
        self.copies.append(BlockCopy(block_id, cpu_block_id))
        self.kept.append(entry)
        self.num_kept += 1

    def settle(self, ops: TierOps, ran: bool) -> None:
        """The step that did `ops` is confirmed (`ran`), or will never be (its entries may
        not have been written: dropped). Its loads are done either way."""
        for entry in ops.stored:
            assert self.entries.get(entry.block_hash) is entry, "a pending entry was evicted"
            if ran:
                entry.written = True
            else:
                self._drop(entry)
                self.free_ids.append(entry.cpu_block_id)
        for entry in ops.loaded:
            assert entry.num_loads > 0, f"CPU entry {entry.cpu_block_id} unloaded twice"
            entry.num_loads -= 1

    def _evictable(self) -> Iterator[CpuEntry]:
        """Entries a write may take, LRU first."""
        busy = self.busy
        return (e for e in self.entries.values() if e.evictable and e.cpu_block_id not in busy)

    def _drop(self, entry: CpuEntry) -> None:
        del self.entries[entry.block_hash]
        del self.by_key[entry.chain_key]
        self.num_evicted += 1

    # Swap space.

    def can_take(self, count: int) -> bool:
        """Whether `take(count)` would succeed (nothing changes)."""
        short = count - len(self.free_ids)
        return short <= 0 or sum(1 for _ in islice(self._evictable(), short)) == short

    def take(self, count: int) -> list[int] | None:
        """`count` CPU blocks for a swap-out: free ones first, then the tier's entries, LRU
        first; None (nothing changed) if even every entry that may go would not do."""
        short = count - len(self.free_ids)
        victims: list[CpuEntry] = []
        if short > 0:
            victims = list(islice(self._evictable(), short))
            if len(victims) < short:
                return None
        ids = [self.free_ids.pop() for _ in range(count - len(victims))]
        for victim in victims:
            self._drop(victim)
            ids.append(victim.cpu_block_id)
        self.busy.update(ids)
        return ids

    def release(self, cpu_block_ids: list[int]) -> None:
        """A swapped-out request was freed: its blocks are free (nothing reads them)."""
        self.free_ids.extend(cpu_block_ids)

    def release_after_step(self, cpu_block_ids: list[int]) -> None:
        """A swapped-out request comes back: this step reads its blocks, free after it."""
        self.busy.update(cpu_block_ids)
        self.returning.extend(cpu_block_ids)

    def take_returning(self) -> list[int]:
        """The swapped-in requests' blocks this step reads: the caller frees or holds them."""
        returning, self.returning = self.returning, []
        return returning

    def end_step(self) -> tuple[list[BlockCopy], TierOps | None] | None:
        """The step is built: its eviction copies and what it did to the tier, to settle when
        it is confirmed (None: it used no CPU block, as most steps); nothing is busy now."""
        if not self.busy:  # every copy, load, take and return marked its block busy
            return None
        copies = self.copies
        ops = TierOps(self.kept, self.loaded) if self.kept or self.loaded else None
        self.free_ids.extend(self.returning)
        self.copies, self.kept, self.loaded, self.returning = [], [], [], []
        self.busy.clear()
        return copies, ops

    def check_invariants(self, held: list[int], unsettled: list[TierOps]) -> None:
        """`held`: the CPU blocks of swapped-out requests; `unsettled`: the tier work of the
        steps not confirmed yet. Checked between steps."""
        assert not (self.busy or self.returning or self.copies or self.kept or self.loaded), (
            "a step left over"
        )
        pending = {id(e) for ops in unsettled for e in ops.stored}
        loads = Counter(id(e) for ops in unsettled for e in ops.loaded)
        for entry in self.entries.values():
            assert entry.written != (id(entry) in pending), (
                f"CPU entry {entry.cpu_block_id}: pending exactly while its step is unsettled"
            )
            assert entry.num_loads == loads[id(entry)], (
                f"CPU entry {entry.cpu_block_id}: {entry.num_loads} loads counted, "
                f"{loads[id(entry)]} steps loading it"
            )
        tier = [e.cpu_block_id for e in self.entries.values()]
        assert sorted(held + self.free_ids + tier) == list(range(self.num_blocks)), (
            "CPU blocks lost or doubled"
        )
        assert len(self.entries) <= self.capacity, f"{len(self.entries)} > {self.capacity}"
        assert {e.chain_key: e for e in self.entries.values()} == self.by_key, (
            "the CPU tier's two indexes differ"
        )
        for block_hash, entry in self.entries.items():
            assert entry.block_hash == block_hash, f"CPU entry {entry.cpu_block_id} misfiled"
