"""Admission by fair share (gateway/core/fair_share.py): the waiting queue's order within each
priority level, least served tenant first, each charged its prompt as it is taken."""

from __future__ import annotations

from gateway.core.fair_share import fair_order, waiting_tenants
from gateway.core.request_state import Request, SamplingOptions, Sequence


def waiting(*rows: tuple[str, str, int, int]) -> list[Sequence]:
    """(request id, tenant, prompt length, priority), in the queue's order."""
    seqs = []
    for index, (rid, tenant, length, level) in enumerate(rows):
        request = Request(request_id=rid, prompt_token_ids=[1] * length, cache_salt="",
                          sampling=SamplingOptions(max_tokens=4, priority=level), tenant=tenant)
        seqs.append(Sequence(seq_id=rid, request=request, index=index))
    return seqs


def order(queue: list[Sequence], service: dict[str, float], weight: float = 1.0) -> list[str]:
    return [s.seq_id for s in fair_order(queue, service, weight)]


def test_the_least_served_tenant_goes_first_and_each_admission_is_charged():
    queue = waiting(("h1", "heavy", 10, 0), ("h2", "heavy", 10, 0), ("h3", "heavy", 10, 0),
                    ("l1", "light", 10, 0), ("l2", "light", 10, 0))
    assert order(queue, {}) == ["h1", "l1", "h2", "l2", "h3"]  # nobody served yet: turns
    # Light 15 behind: its first goes and is charged 10 (still 5 behind), then its second;
    # then heavy's.
    assert order(queue, {"heavy": 15.0, "light": 0.0}) == ["l1", "l2", "h1", "h2", "h3"]
    # Light 5 behind: its first goes and is charged 10 (5 ahead); heavy's first goes and is
    # charged 10 (5 ahead again); light's second, then heavy's rest.
    assert order(queue, {"heavy": 5.0, "light": 0.0}) == ["l1", "h1", "l2", "h2", "h3"]
    # The charge is the prompt at the prefill weight: at 0.1 light stays behind after both.
    assert order(queue, {"heavy": 5.0, "light": 0.0}, weight=0.1) == [
        "l1", "l2", "h1", "h2", "h3"]


def test_priority_levels_and_preempted_requests_keep_their_places():
    queue = waiting(("u", "heavy", 4, 0), ("h", "heavy", 4, 1), ("l", "light", 4, 1),
                    ("back", "heavy", 4, 1), ("z", "light", 4, 2))
    queue[3].num_preemptions = 1
    queue.insert(1, queue.pop(3))  # a preempted request goes in front of its level
    assert [s.seq_id for s in queue] == ["u", "back", "h", "l", "z"]
    assert order(queue, {"heavy": 100.0, "light": 0.0}) == ["u", "back", "l", "h", "z"]


def test_a_tenant_not_reported_yet_counts_as_the_least_served_so_far():
    queue = waiting(("a", "old", 4, 0), ("b", "new", 4, 0))
    assert order(queue, {"old": 3.0}) == ["a", "b"]  # tie at 3: the earlier arrival
    assert order(queue, {"old": 3.0, "other": 1.0}) == ["b", "a"]  # new at 1, below old


def test_the_step_names_each_waiting_tenant_once_in_queue_order():
    queue = waiting(("a", "x", 1, 0), ("b", "", 1, 0), ("c", "y", 1, 0), ("d", "x", 1, 0))
    assert waiting_tenants(queue) == ["x", "y"]
