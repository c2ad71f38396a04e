"""The intrusive free queue: O(1) head/tail operations and removal from the middle."""

import pytest

from allocator_svc.core.free_queue import Block, FreeQueue


def ids(queue: FreeQueue) -> list[int]:
    return [b.block_id for b in queue]


def test_free_queue_pops_in_order_and_appends_at_both_ends():
    # Blocks 0..3 queued; pop 0, push it back at the head, pop 1 and append it at the tail.
    blocks = [Block(i) for i in range(4)]
    queue = FreeQueue(blocks)
    assert queue.popleft() is blocks[0]
    queue.appendleft(blocks[0])
    assert ids(queue) == [0, 1, 2, 3]
    queue.remove(blocks[1])
    queue.append(blocks[1])
    assert ids(queue) == [0, 2, 3, 1]
    assert len(queue) == 4


def test_free_queue_remove_from_middle_head_and_tail():
    # Reviving cached blocks anywhere in the queue keeps the links consistent.
    blocks = [Block(i) for i in range(5)]
    queue = FreeQueue(blocks)
    queue.remove(blocks[2])
    queue.remove(blocks[0])
    queue.remove(blocks[4])
    assert ids(queue) == [1, 3]
    assert queue.head is blocks[1] and queue.tail is blocks[3]
    assert not blocks[2].in_free_queue and blocks[2].prev is None and blocks[2].next is None
    queue.remove(blocks[1])
    queue.remove(blocks[3])
    assert ids(queue) == [] and queue.head is None and queue.tail is None


def test_free_queue_rejects_double_insert():
    # A bug (freeing a free block) is caught at the mutation point.
    block = Block(0)
    queue = FreeQueue([block])
    with pytest.raises(AssertionError):
        queue.append(block)
