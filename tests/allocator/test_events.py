"""The event log: a cursor never misses an event silently."""

from allocator_svc.core.events import EventLog


def test_events_after_cursor_in_pages():
    # Five events; read two at a time from cursor 0.
    log = EventLog(16)
    for i in range(5):
        log.stored(bytes([i]), i, None, [i])
    first = log.after(0, 2)
    assert [e.seq for e in first.events] == [1, 2] and not first.truncated
    rest = log.after(2, 10)
    assert [e.seq for e in rest.events] == [3, 4, 5] and rest.last_seq == 5
    assert log.after(5, 10).events == []


def test_events_truncated_when_cursor_fell_off():
    # Capacity 3: events 1 and 2 are gone, so a cursor at 0 is told to take a snapshot.
    log = EventLog(3)
    for i in range(5):
        log.removed(bytes([i]), i)
    page = log.after(0, 10)
    assert page.truncated and [e.seq for e in page.events] == [3, 4, 5]
    assert not log.after(2, 10).truncated
