"""The event log: a cursor never misses an event silently."""

import gc
import random

from allocator_svc.core.events import EventKind, EventLog


def test_events_after_cursor_in_pages():
    # Five events; read two at a time from cursor 0.
    log = EventLog(16)
    for i in range(5):
        log.stored_blocks([bytes([i])], [i], [None], [i])
    first = log.after(0, 2)
    assert [e.seq for e in first.events] == [1, 2] and not first.truncated
    rest = log.after(2, 10)
    assert [e.seq for e in rest.events] == [3, 4, 5] and rest.last_seq == 5
    assert log.after(5, 10).events == []


def test_events_truncated_when_cursor_fell_off():
    # Capacity 3: events 1 and 2 are gone, so a cursor at 0 is told to take a snapshot.
    log = EventLog(3)
    for i in range(5):
        log.removed_run([bytes([i])], [i])
    page = log.after(0, 10)
    assert page.truncated and [e.seq for e in page.events] == [3, 4, 5]
    assert not log.after(2, 10).truncated


def test_a_run_reads_as_one_event_per_block_chained_by_parent():
    # One run of three blocks (block size 2): each event's parent is the previous block.
    log = EventLog(16)
    log.stored_blocks([b"a", b"b", b"c"], [7, 8, 9], [b"root", b"a", b"b"], [1, 2, 3, 4, 5, 6])
    log.removed_run([b"x", b"y"], [3, 4])
    events = log.after(0, 10).events
    assert [(e.seq, e.block_hash, e.block_id, e.parent_hash, e.token_ids) for e in events[:3]] == [
        (1, b"a", 7, b"root", [1, 2]),
        (2, b"b", 8, b"a", [3, 4]),
        (3, b"c", 9, b"b", [5, 6]),
    ]
    assert [(e.seq, e.kind, e.block_id) for e in events[3:]] == [
        (4, EventKind.REMOVED, 3),
        (5, EventKind.REMOVED, 4),
    ]
    # A cursor inside a run, and pages that end inside a run.
    assert [e.seq for e in log.after(1, 2).events] == [2, 3]
    assert [e.seq for e in log.after(2, 2).events] == [3, 4]


def test_overflow_trims_a_run_to_exactly_capacity_events():
    # Capacity 4 and a run of 6: the first two events are gone, the rest keep their chain.
    log = EventLog(4)
    hashes = [b"a", b"b", b"c", b"d", b"e", b"f"]
    log.stored_blocks(hashes, list(range(6)), [None, *hashes[:-1]], list(range(12)))
    page = log.after(0, 10)
    assert page.truncated and page.last_seq == 6
    assert [(e.seq, e.parent_hash, e.token_ids) for e in page.events] == [
        (3, b"b", [4, 5]),
        (4, b"c", [6, 7]),
        (5, b"d", [8, 9]),
        (6, b"e", [10, 11]),
    ]
    assert not log.after(2, 10).truncated


def test_runs_are_untracked_by_the_garbage_collector():
    # A full log is long-lived; if the collector had to scan it, every full collection in the
    # allocator would take tens of milliseconds (a step's p99).
    log = EventLog(16)
    log.stored_blocks([b"a", b"b"], [1, 2], [None, b"a"], [1, 2, 3, 4])
    log.removed_run([b"a"], [1])
    gc.collect()  # untracks the inner tuples; the next pass sees the outer one holds atoms only
    gc.collect()
    assert not any(gc.is_tracked(run) for run in log._runs)


def test_the_log_reads_like_a_list_of_its_last_capacity_events():
    # Random runs of both kinds against a plain list of events: every cursor and page size
    # reads exactly the list's tail after the cursor, flagged truncated exactly when events
    # after the cursor were dropped.
    for seed in range(100):
        rng = random.Random(seed)
        capacity = rng.randint(1, 20)
        log, reference = EventLog(capacity), []
        for _ in range(rng.randint(1, 30)):
            n = rng.randint(1, 6)
            hashes, ids = [bytes([rng.randrange(256)]) for _ in range(n)], list(range(n))
            if rng.random() < 0.5:
                parents = [rng.choice([None, b"p"]) for _ in range(n)]
                log.stored_blocks(hashes, ids, parents, list(range(2 * n)))
                reference += [
                    (EventKind.STORED, hashes[i], i, parents[i], [2 * i, 2 * i + 1])
                    for i in range(n)
                ]
            else:
                log.removed_run(hashes, ids)
                reference += [(EventKind.REMOVED, hashes[i], i, None, None) for i in range(n)]
        kept = reference[-capacity:]
        first = len(reference) - len(kept) + 1
        for cursor in range(len(reference) + 2):
            for page_size in (1, 3, 100):
                page = log.after(cursor, page_size)
                expected = [(first + i, *e) for i, e in enumerate(kept) if first + i > cursor]
                assert [
                    (e.seq, e.kind, e.block_hash, e.block_id, e.parent_hash, e.token_ids)
                    for e in page.events
                ] == expected[:page_size]
                assert page.truncated == (cursor + 1 < first and cursor < len(reference))
