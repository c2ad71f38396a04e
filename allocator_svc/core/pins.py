"""Pins: an operator's prefixes (a system prompt) whose blocks are never evicted.

A pin names a token-id prefix under one cache salt; only its full blocks count. It is keyed by
the prefix's block-hash chain (the pool's root for the salt, then one hash per block), so it
holds exactly the blocks a request with that prompt and salt hits. Every hash some pin names
is pinned in the block pool, which holds its cached block out of the free queue
(block_pool.py); a hash two pins name (a prompt, and a longer one that starts with it) is held
once and counted once against the pool's budget.

NOTE: a pin is configuration, not a cache entry. It names its hashes whether or not they are
cached: a pending one is held the moment a commit caches it, so an operator can pin a system
prompt before traffic arrives. It survives a pool reset: the new pool carries it over, its
chain derived again, every block pending (`PinTable.carry`).
"""

from __future__ import annotations

import secrets
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from allocator_svc.core.block_pool import BlockPool


@dataclass(slots=True)
class Pin:
    pin_id: str
    name: str  # the operator's label ("" for none)
    cache_salt: str
    token_ids: list[int]  # its full blocks' tokens: a reset derives the chain from them again
    block_hashes: list[bytes]  # the chain, one hash per block


@dataclass(frozen=True, slots=True)
class PinStatus:
    pin_id: str
    name: str
    pool_id: str
    num_blocks: int  # full blocks of the prefix
    num_pinned_blocks: int  # of which cached now, and held
    num_tokens: int  # num_blocks * block_size

    @property
    def num_pending_blocks(self) -> int:
        """Blocks not cached yet: held as soon as a request's commit caches them."""
        return self.num_blocks - self.num_pinned_blocks


def pin_budget(num_blocks: int, fraction: float) -> int:
    """Most blocks one pool's pins may name: `fraction` of the pool, rounded down, and never
    the whole pool (a request must have a block to run in)."""
    return max(0, min(int(num_blocks * fraction + 1e-9), num_blocks - 1))


class PinTable:
    """One pool's pins. Only the block pool changes references: this table says which hashes
    it must pin or unpin."""

    def __init__(self, blocks: BlockPool, budget: int) -> None:
        self.blocks = blocks
        self.budget = budget  # most distinct hashes pinned at once (pinned + pending)
        self.pins: dict[str, Pin] = {}  # by pin_id, in the order they were made
        self._by_chain: dict[bytes, Pin] = {}  # by the chain's last hash, which names it all
        self._num_pins: dict[bytes, int] = {}  # block hash -> how many pins name it

    @property
    def num_blocks(self) -> int:
        """Blocks counted against the budget: every hash some pin names, cached or not."""
        return len(self._num_pins)

    def find(self, block_hashes: list[bytes]) -> Pin | None:
        """The pin of exactly this chain, if there is one."""
        return self._by_chain.get(block_hashes[-1])

    def num_new(self, block_hashes: list[bytes]) -> int:
        """Hashes of the chain no pin names yet: what pinning it adds to the budget's count."""
        return len(set(block_hashes) - self._num_pins.keys())

    def new_id(self) -> str:
        """Random, so that an id from an earlier allocator process never names another pin."""
        while True:
            pin_id = f"pin-{secrets.token_hex(6)}"
            if pin_id not in self.pins:
                return pin_id

    def add(self, pin: Pin) -> None:
        """Callers checked it: a new chain, within the budget."""
        assert pin.block_hashes and pin.pin_id not in self.pins, f"pin {pin.pin_id} exists"
        assert self.find(pin.block_hashes) is None, "the chain is pinned already"
        assert self.num_blocks + self.num_new(pin.block_hashes) <= self.budget, "over budget"
        counts = self._num_pins
        new = [h for h in pin.block_hashes if h not in counts]
        for block_hash in pin.block_hashes:
            counts[block_hash] = counts.get(block_hash, 0) + 1
        self.pins[pin.pin_id] = self._by_chain[pin.block_hashes[-1]] = pin
        self.blocks.pin(new)

    def remove(self, pin_id: str) -> int:
        """Drop a pin; the hashes no other pin names are unpinned. Returns how many cached
        blocks lost the pins' reference."""
        pin = self.pins.pop(pin_id)
        del self._by_chain[pin.block_hashes[-1]]
        counts, gone = self._num_pins, []
        for block_hash in pin.block_hashes:
            if counts[block_hash] == 1:
                del counts[block_hash]
                gone.append(block_hash)
            else:
                counts[block_hash] -= 1
        return self.blocks.unpin(gone)

    def carry(self, pins: Iterable[Pin], block_size: int,
              chain: Callable[[str, list[int]], list[bytes]]) -> None:
        """A reset pool's pins, each under its id with its chain derived again for this pool
        (`chain`: its hashing), every block pending. One this pool cannot hold (no prefix
        caching, shorter than a block, over the budget, the same chain as an earlier one under
        a new block size) is left out: the servicer logs it."""
        if not self.blocks.enable_caching:
            return
        for pin in pins:
            tokens = pin.token_ids[: len(pin.token_ids) // block_size * block_size]
            if not tokens:
                continue
            hashes = chain(pin.cache_salt, tokens)
            if self.find(hashes) is None and self.num_blocks + self.num_new(hashes) <= self.budget:
                self.add(Pin(pin.pin_id, pin.name, pin.cache_salt, tokens, hashes))

    def status(self, pin: Pin, pool_id: str, block_size: int) -> PinStatus:
        cached = self.blocks.cached
        num_pinned = sum(1 for h in pin.block_hashes if h in cached)
        return PinStatus(pin.pin_id, pin.name, pool_id, len(pin.block_hashes), num_pinned,
                         len(pin.block_hashes) * block_size)

    def check_invariants(self) -> None:
        counts = Counter(h for pin in self.pins.values() for h in pin.block_hashes)
        assert counts == Counter(self._num_pins), "per-hash pin counts out of sync"
        assert self._num_pins.keys() == self.blocks.pinned, "pinned hashes and pins differ"
        assert self.num_blocks <= self.budget, f"{self.num_blocks} pinned, budget {self.budget}"
        assert {p.block_hashes[-1]: p for p in self.pins.values()} == self._by_chain, (
            "the chain index is out of sync"
        )
