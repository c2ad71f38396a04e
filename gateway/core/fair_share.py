"""Admission by fair share (`--admission-order fair-share`): the waiting queue's order within
each priority level, least served tenant first.

The allocator keeps each tenant's service across every gateway and pool (allocator_svc/core/
tenant_service.py) and answers, on each Step, for the tenants waiting here. Within a priority
level, sequences coming back from a preemption keep their place at the front (they were
admitted once); the others are taken one at a time from the tenant with the least service,
each charged its prompt at the allocator's prefill weight as it is taken, so that one step
does not admit a whole backlog of the tenant that was behind. A tenant's own go in arrival
order; ties go to the earlier arrival. A tenant the allocator has not reported yet counts as
the least served so far.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator, Mapping
from collections.abc import Sequence as Rows
from itertools import groupby

from common.step_records import MAX_WAITING_TENANTS
from gateway.core.request_state import Sequence


def waiting_tenants(waiting: Rows[Sequence]) -> list[str]:
    """The distinct tenants of the waiting queue, in its order, to ask the allocator about."""
    return list(dict.fromkeys(s.request.tenant for s in waiting if s.request.tenant))[
        :MAX_WAITING_TENANTS]


def fair_order(waiting: Rows[Sequence], service: Mapping[str, float],
               prefill_weight: float) -> Iterator[Sequence]:
    """The waiting queue (priority order, FCFS within a level) in fair-share order."""
    for _, level in groupby(waiting, key=lambda s: s.request.sampling.priority):
        queued = list(level)
        yield from (s for s in queued if s.num_preemptions)
        fresh = [s for s in queued if not s.num_preemptions]
        by_tenant: dict[str, deque[tuple[int, Sequence]]] = {}
        for arrival, seq in enumerate(fresh):
            by_tenant.setdefault(seq.request.tenant, deque()).append((arrival, seq))
        floor = min(service.values(), default=0.0)
        heap = [(service.get(tenant, floor), rows[0][0], tenant)
                for tenant, rows in by_tenant.items()]
        heapq.heapify(heap)
        while heap:
            served, _, tenant = heapq.heappop(heap)
            rows = by_tenant[tenant]
            _, seq = rows.popleft()
            yield seq
            if rows:
                served += len(seq.request.prompt_token_ids) * prefill_weight
                heapq.heappush(heap, (served, rows[0][0], tenant))
