"""Stateful property test: the allocator's random operation sequences (test_allocator_properties'
machine, with its gateway/executor reference) with pins and unpins among them.

The reference model of the pins: per pin, its salt and full-block tokens; from them the chain
hashes, the set of pinned hashes and the budget's count. Each pin call's outcome (made, the
same pin, refused and why) is predicted from the model alone, and a refused call changes
nothing. After every operation: the pool pins exactly the model's hashes; a pinned hash once
cached stays cached in the same block until unpinned, whatever the eviction pressure; an
observer following the pin events too knows exactly which blocks are held. At the end, every
pin unpinned and every request freed, the pool holds nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule
from test_allocator_properties import (
    BLOCK_SIZE,
    NUM_BLOCKS,
    NUM_CPU_BLOCKS,
    SALTS,
    AllocatorMachine,
)

from allocator_svc.core.allocator import Allocator, Limits
from allocator_svc.core.events import EventKind
from allocator_svc.core.hashing import hash_chain
from allocator_svc.core.pool import PoolConfig
from common.errors import AlreadyExists, InvalidArgument, ResourceExhausted
from tests.budget import examples

FRACTION = 0.34  # 4 of the machine's 12 blocks
BUDGET = 4
NAMES = ("a", "b")


@dataclass(frozen=True)
class ModelPin:
    name: str
    hashes: tuple[bytes, ...]


class PinnedAllocatorMachine(AllocatorMachine):
    def __init__(self) -> None:
        super().__init__()
        # The same pool as the base machine's, with a pin budget.
        self.allocator = Allocator(Limits(max_batch_items=64, event_capacity=8,
                                          max_pinned_fraction=FRACTION))
        self.pool, _ = self.allocator.register_pool(
            PoolConfig("p", NUM_BLOCKS, BLOCK_SIZE, NUM_CPU_BLOCKS, "fp", "i", True))
        assert self.pool.pins.budget == BUDGET
        self.pins: dict[str, ModelPin] = {}
        self.held: dict[bytes, int] = {}  # pinned hash -> the block it was first seen cached in
        self.observed_pins: set[bytes] = set()

    def _model_hashes(self) -> set[bytes]:
        return {h for pin in self.pins.values() for h in pin.hashes}

    def _snapshot(self) -> tuple[object, ...]:
        blocks = self.pool.blocks
        return (set(blocks.pinned), blocks.num_pinned, [b.ref_count for b in blocks.blocks],
                [b.block_id for b in blocks.free_queue], self.pool.events.last_seq,
                list(self.pool.pins.pins))

    @rule(tokens=st.lists(st.integers(0, 2), max_size=9), salt=st.sampled_from(SALTS),
          name=st.sampled_from(NAMES))
    def pin(self, tokens, salt, name) -> None:
        num_blocks = len(tokens) // BLOCK_SIZE
        hashes = tuple(hash_chain(self.pool.root(salt), tokens[: num_blocks * BLOCK_SIZE],
                                  BLOCK_SIZE))
        same = next((i for i, p in self.pins.items() if p.hashes and hashes
                     and p.hashes[-1] == hashes[-1]), None)
        new = set(hashes) - self._model_hashes()
        if num_blocks == 0:
            expected: type[Exception] | None = InvalidArgument
        elif num_blocks > BUDGET:
            expected = ResourceExhausted
        elif same is not None:
            expected = None if self.pins[same].name == name else AlreadyExists
        else:
            expected = ResourceExhausted if len(self._model_hashes() | new) > BUDGET else None
        before = self._snapshot()
        try:
            status, created = self.allocator.pin_prefix("p", tokens, salt, name)
        except (InvalidArgument, ResourceExhausted, AlreadyExists) as exc:
            assert type(exc) is expected, f"{type(exc).__name__}: {exc}, expected {expected}"
            assert self._snapshot() == before, "a refused pin changed the pool"
            return
        assert expected is None, f"pin accepted, expected {expected}"
        assert created == (same is None)
        if same is not None:
            assert status.pin_id == same
        self.pins[status.pin_id] = ModelPin(name, hashes)
        assert status.num_blocks == num_blocks

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data) -> None:
        pin_id = data.draw(st.sampled_from(list(self.pins)))  # made first first: ids are random
        gone = set(self.pins.pop(pin_id).hashes) - self._model_hashes()
        cached = self.pool.blocks.cached
        held_before = {cached[h] for h in gone if h in cached}
        _, released = self.allocator.unpin_prefix("p", pin_id)
        assert released == len(held_before)
        for block in held_before:  # let go, still cached: revivable until reused
            assert cached.get(block.block_hash) is block  # type: ignore[arg-type]
        for block_hash in gone:
            self.held.pop(block_hash, None)

    @invariant()
    def pins_match_the_model(self) -> None:
        model = self._model_hashes()
        assert self.pool.blocks.pinned == model
        assert self.pool.pins.num_blocks == len(model) <= BUDGET
        cached = self.pool.blocks.cached
        for block_hash, block_id in self.held.items():
            block = cached.get(block_hash)
            assert block is not None and block.block_id == block_id, (
                "a pinned block was evicted or moved"
            )
        for block_hash in model & cached.keys():
            self.held.setdefault(block_hash, cached[block_hash].block_id)
            assert not cached[block_hash].in_free_queue

    @invariant()
    def observer_follows_the_cache(self) -> None:
        """The base observer's, reading pin events too: it knows which blocks are held."""
        blocks = self.pool.blocks
        while True:
            page = self.pool.events.after(self.cursor, 3, include_pins=True)
            if page.truncated:
                self.observed = {h: b.block_id for h, b in blocks.cached.items()}
                self.observed_pins = blocks.pinned & blocks.cached.keys()
                self.cursor = page.last_seq
                continue
            for event in page.events:
                assert event.seq == self.cursor + 1, "events arrive without gaps"
                self.cursor = event.seq
                if event.kind is EventKind.STORED:
                    assert event.block_hash not in self.observed
                    self.observed[event.block_hash] = event.block_id
                elif event.kind is EventKind.REMOVED:
                    assert event.block_hash not in self.observed_pins, "a pinned block evicted"
                    assert self.observed.pop(event.block_hash) == event.block_id
                elif event.kind is EventKind.PINNED:
                    assert self.observed[event.block_hash] == event.block_id
                    self.observed_pins.add(event.block_hash)
                else:
                    self.observed_pins.remove(event.block_hash)
            if not page.events:
                break
        assert self.observed == {h: b.block_id for h, b in blocks.cached.items()}
        assert self.observed_pins == blocks.pinned & blocks.cached.keys()

    def teardown(self) -> None:
        for pin_id in list(self.pins):
            self.allocator.unpin_prefix("p", pin_id)
        assert self.pool.blocks.num_pinned == 0 and not self.pool.blocks.pinned
        super().teardown()  # every request freed: every block free, GPU and CPU


PinnedAllocatorMachine.TestCase.settings = settings(
    max_examples=examples(300), stateful_step_count=30, deadline=None
)
test_pinned_allocator_random_operation_sequences = PinnedAllocatorMachine.TestCase
