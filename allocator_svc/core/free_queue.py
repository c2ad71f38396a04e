"""The free queue: an intrusive doubly linked list threaded through the blocks themselves.

O(1) pop from the head (the next block to reuse), append to the tail, push to the head, and
removal from the middle (a cached free block revived by a prefix hit). The LRU order of cached
blocks is the queue order: the head is evicted first.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(slots=True, eq=False)
class Block:
    """One physical KV block. Free exactly when ref_count is 0 (then it is in the free queue)."""

    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None  # set while the block is a prefix-cache entry
    chain_key: bytes | None = None  # with it: the hash's input (parent hash + packed tokens)
    prev: Block | None = None  # free-queue links, meaningful only while free
    next: Block | None = None
    in_free_queue: bool = False


class FreeQueue:
    def __init__(self, blocks: list[Block]) -> None:
        self.head: Block | None = None
        self.tail: Block | None = None
        self.num_blocks = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_blocks

    def popleft(self) -> Block:
        return self.popleft_n(1)[0]

    def popleft_n(self, count: int) -> list[Block]:
        """The `count` blocks at the head, in order (allocation's hot loop, inlined)."""
        assert count <= self.num_blocks, f"popleft_n({count}) on {self.num_blocks} free blocks"
        taken = []
        block = self.head
        for _ in range(count):
            assert block is not None
            taken.append(block)
            following = block.next
            block.prev = block.next = None
            block.in_free_queue = False
            block = following
        self.head = block
        if block is None:
            self.tail = None
        else:
            block.prev = None
        self.num_blocks -= count
        return taken

    def append(self, block: Block) -> None:
        """Add at the tail: evicted last."""
        assert not block.in_free_queue, f"block {block.block_id} is already free"
        block.prev, block.next = self.tail, None
        if self.tail is None:
            self.head = block
        else:
            self.tail.next = block
        self.tail = block
        block.in_free_queue = True
        self.num_blocks += 1

    def appendleft(self, block: Block) -> None:
        """Add at the head: reused first."""
        assert not block.in_free_queue, f"block {block.block_id} is already free"
        block.prev, block.next = None, self.head
        if self.head is None:
            self.tail = block
        else:
            self.head.prev = block
        self.head = block
        block.in_free_queue = True
        self.num_blocks += 1

    def remove(self, block: Block) -> None:
        assert block.in_free_queue, f"block {block.block_id} is not in the free queue"
        if block.prev is None:
            self.head = block.next
        else:
            block.prev.next = block.next
        if block.next is None:
            self.tail = block.prev
        else:
            block.next.prev = block.prev
        block.prev = block.next = None
        block.in_free_queue = False
        self.num_blocks -= 1

    def __iter__(self) -> Iterator[Block]:
        block = self.head
        while block is not None:
            yield block
            block = block.next
