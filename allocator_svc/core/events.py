"""Prefix-cache events (BlockStored / BlockRemoved) with a per-pool sequence number.

An observer follows the cache from a cursor; when its cursor has fallen off the bounded log it
is told so (truncated) and takes a snapshot, whose seq says where to resume: no gaps.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple


class EventKind(Enum):
    STORED = "stored"
    REMOVED = "removed"


class CacheEvent(NamedTuple):
    """An immutable record; a NamedTuple because one is built per cached block (hot path)."""

    seq: int
    kind: EventKind
    block_hash: bytes
    block_id: int
    parent_hash: bytes | None = None  # STORED only; None for a chain's first block
    token_ids: list[int] | None = None  # STORED only (the caller's slice, never mutated)


@dataclass(frozen=True, slots=True)
class EventPage:
    events: list[CacheEvent]
    last_seq: int
    truncated: bool  # events after the cursor were dropped: take a snapshot


class EventLog:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.last_seq = 0
        self._events: deque[CacheEvent] = deque(maxlen=capacity)

    def stored(
        self, block_hash: bytes, block_id: int, parent_hash: bytes | None, token_ids: list[int]
    ) -> None:
        self.last_seq += 1
        self._events.append(
            CacheEvent(
                self.last_seq, EventKind.STORED, block_hash, block_id, parent_hash, token_ids
            )
        )

    def removed(self, block_hash: bytes, block_id: int) -> None:
        self.last_seq += 1
        self._events.append(CacheEvent(self.last_seq, EventKind.REMOVED, block_hash, block_id))

    def after(self, cursor: int, max_events: int) -> EventPage:
        """Events with seq > cursor, oldest first, at most max_events of them."""
        oldest = self._events[0].seq if self._events else self.last_seq + 1
        truncated = cursor + 1 < oldest and cursor < self.last_seq
        skip = max(0, cursor + 1 - oldest)
        page = [self._events[i] for i in range(skip, min(len(self._events), skip + max_events))]
        return EventPage(page, self.last_seq, truncated)
