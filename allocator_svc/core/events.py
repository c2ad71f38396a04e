"""Prefix-cache events (BlockStored / BlockRemoved, and BlockPinned / BlockUnpinned) with a
per-pool sequence number.

An observer follows the cache from a cursor; when its cursor has fallen off the bounded log it
is told so (truncated) and takes a snapshot, whose seq says where to resume: no gaps.

NOTE: the log records runs, not events. A commit caches a whole chain of blocks and an
allocation may evict several; each becomes one record with consecutive sequence numbers,
expanded into CacheEvents only when an observer reads them. Building one record per block on
the hot path cost about a third of a request lifecycle. A run holds only tuples, bytes and
ints, so the garbage collector untracks it: a full log of 65,536 events otherwise made every
full collection in the allocator take 15-30 ms.

NOTE: pin events (a cached block held for a pin, and let go) are read only by an observer
that asks for them (`include_pins`): one that predates them would read an unknown kind as a
removal. The others see their sequence numbers skipped, never a block event missing.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass
from enum import Enum
from typing import Any, NamedTuple


class EventKind(Enum):
    STORED = "stored"
    REMOVED = "removed"
    PINNED = "pinned"  # a cached block is held for a pin: never evicted until UNPINNED
    UNPINNED = "unpinned"  # no pin holds it any more: it is free once no request holds it


# A run's kind as an int (an enum member would make the run tracked by the collector).
_REMOVED, _STORED, _PINNED, _UNPINNED = range(4)
_KINDS = (EventKind.REMOVED, EventKind.STORED, EventKind.PINNED, EventKind.UNPINNED)


class CacheEvent(NamedTuple):
    """One event as an observer sees it."""

    seq: int
    kind: EventKind
    block_hash: bytes
    block_id: int
    parent_hash: bytes | None = None  # STORED only; None for a chain's first block
    token_ids: list[int] | None = None  # STORED only


class _Run(NamedTuple):
    """Events first_seq, first_seq + 1, ... of one kind (a commit's chain, a step's commits,
    an allocation's evictions, the blocks a pin took or let go)."""

    first_seq: int
    kind: int  # _STORED, _REMOVED, _PINNED or _UNPINNED; an int, not the enum: untracked
    block_hashes: tuple[bytes, ...]
    block_ids: tuple[int, ...]
    parent_hashes: tuple[bytes | None, ...]  # stored: each block's parent (None: a root)
    token_ids: tuple[int, ...]  # stored: the blocks' tokens, block after block

    @property
    def last_seq(self) -> int:
        return self.first_seq + len(self.block_ids) - 1

    @property
    def is_pin(self) -> bool:
        return self.kind >= _PINNED

    def events(self, start: int, stop: int) -> list[CacheEvent]:
        """The run's events with index in [start, stop)."""
        if self.kind != _STORED:
            kind = _KINDS[self.kind]
            return [
                CacheEvent(self.first_seq + i, kind, self.block_hashes[i], self.block_ids[i])
                for i in range(start, stop)
            ]
        block_size = len(self.token_ids) // len(self.block_ids)
        return [
            CacheEvent(
                self.first_seq + i,
                EventKind.STORED,
                self.block_hashes[i],
                self.block_ids[i],
                self.parent_hashes[i],
                list(self.token_ids[i * block_size : (i + 1) * block_size]),
            )
            for i in range(start, stop)
        ]

    def without_first(self, count: int) -> _Run:
        block_size = len(self.token_ids) // len(self.block_ids) if self.kind == _STORED else 0
        return _Run(
            self.first_seq + count,
            self.kind,
            self.block_hashes[count:],
            self.block_ids[count:],
            self.parent_hashes[count:],
            self.token_ids[count * block_size :],
        )


@dataclass(frozen=True, slots=True)
class EventPage:
    events: list[CacheEvent]
    last_seq: int
    truncated: bool  # events after the cursor were dropped: take a snapshot


class EventLog:
    """The latest `capacity` events, exactly."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.last_seq = 0
        # Plain tuples: the collector untracks a tuple of atoms, but never a NamedTuple.
        self._runs: deque[tuple[Any, ...]] = deque()
        self._first_seqs: deque[int] = deque()  # each run's first_seq, for bisection
        self._num_events = 0

    def stored_blocks(
        self,
        block_hashes: list[bytes],
        block_ids: list[int],
        parent_hashes: list[bytes | None],
        token_ids: list[int],
    ) -> None:
        """Blocks cached (a commit's chain, a decode step's commits), in event order."""
        self._append(
            _Run(
                self.last_seq + 1,
                _STORED,
                tuple(block_hashes),
                tuple(block_ids),
                tuple(parent_hashes),
                tuple(token_ids),
            )
        )

    def removed_run(self, block_hashes: list[bytes], block_ids: list[int]) -> None:
        self._append(
            _Run(self.last_seq + 1, _REMOVED, tuple(block_hashes), tuple(block_ids), (), ())
        )

    def pin_run(self, pinned: bool, block_hashes: list[bytes], block_ids: list[int]) -> None:
        """Cached blocks a pin took a reference on (`pinned`), or that no pin holds any more."""
        kind = _PINNED if pinned else _UNPINNED
        self._append(_Run(self.last_seq + 1, kind, tuple(block_hashes), tuple(block_ids), (), ()))

    def _run(self, index: int) -> _Run:
        return _Run._make(self._runs[index])

    def _append(self, run: _Run) -> None:
        count = len(run.block_ids)
        if count == 0:
            return
        self._runs.append(tuple(run))
        self._first_seqs.append(run.first_seq)
        self.last_seq += count
        self._num_events += count
        while self._num_events > self.capacity:
            oldest = self._run(0)
            excess = self._num_events - self.capacity
            if len(oldest.block_ids) <= excess:
                self._runs.popleft()
                self._first_seqs.popleft()
                self._num_events -= len(oldest.block_ids)
            else:
                self._runs[0] = tuple(oldest.without_first(excess))
                self._first_seqs[0] += excess
                self._num_events -= excess

    def after(self, cursor: int, max_events: int, include_pins: bool = False) -> EventPage:
        """Events with seq > cursor, oldest first, at most max_events of them; pin events
        only with `include_pins` (else their numbers are skipped)."""
        oldest = self._run(0).first_seq if self._runs else self.last_seq + 1
        truncated = cursor + 1 < oldest and cursor < self.last_seq
        # The run holding seq cursor + 1 (or the oldest, when the cursor fell off the log).
        first = max(0, bisect.bisect_right(self._first_seqs, cursor + 1) - 1)
        page: list[CacheEvent] = []
        for index in range(first, len(self._runs)):
            if len(page) >= max_events:
                break
            run = self._run(index)
            if run.is_pin and not include_pins:
                continue
            start = max(0, cursor + 1 - run.first_seq)
            stop = min(len(run.block_ids), start + max_events - len(page))
            page.extend(run.events(start, stop))
        return EventPage(page, self.last_seq, truncated)
