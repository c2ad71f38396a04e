"""Each tenant's service across the fleet: virtual token counters ("Fairness in Serving Large
Language Models", OSDI 2024), kept by the allocator because it sees every gateway's steps on
every pool it holds.

A tenant's counter grows by what its requests compute: prompt tokens (prefill) at
`prefill_weight` each, generated ones (decode) at `decode_weight`; never a token found cached,
a forked child's share of its parent, a handed-off request's tokens (computed elsewhere) or a
request recomputed after a preemption (the allocator's choice, not the tenant's). A step is
charged when it is granted. A gateway that orders admission by fair share names the tenants
waiting in its queue on each Step and gets their counters back; it admits the tenant with the
least service first.

A tenant is backlogged while it computes or waits (named on a Step) at least once every
IDLE_S. One that comes back after longer starts no lower than the least counter of the
backlogged tenants: service not asked for while away is not banked (the paper's lift, made
once, when it joins the queue). Nothing is charged until a Step first names waiting tenants,
so a deployment that does not use fair share pays nothing on its hot path.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from allocator_svc.core.request import Request

# A tenant neither computing nor named waiting for longer than this has left the queue.
IDLE_S = 1.0
MAX_WEIGHT = 1000.0


@dataclass(slots=True)
class TenantService:
    prefill_weight: float = 1.0
    decode_weight: float = 2.0
    clock: Callable[[], float] = time.monotonic
    # A Step named waiting tenants: from then on every step is charged.
    in_use: bool = False
    counters: dict[str, float] = field(default_factory=dict)
    last_seen: dict[str, float] = field(default_factory=dict)  # when each computed or waited

    def charge(self, requests: Iterable[Request]) -> None:
        """Charge each tenant's request what it computed since it was last charged."""
        now = None
        for request in requests:
            tenant = request.tenant
            start, end = request.num_charged, request.num_computed
            if not tenant or end <= start:
                continue
            prefill = max(0, min(end, request.num_prompt_tokens) - start)
            cost = prefill * self.prefill_weight + (end - start - prefill) * self.decode_weight
            self.counters[tenant] = self.counters.get(tenant, 0.0) + cost
            request.num_charged = end
            if now is None:
                now = self.clock()
            self.last_seen[tenant] = now

    def service(self, tenants: Iterable[str]) -> dict[str, float]:
        """The counters of these waiting tenants; one back after IDLE_S is lifted first."""
        now = self.clock()
        backlogged = [c for t, c in self.counters.items()
                      if now - self.last_seen.get(t, -math.inf) <= IDLE_S]
        floor = min(backlogged, default=0.0)
        found = {}
        for tenant in tenants:
            counter = self.counters.get(tenant, 0.0)
            if now - self.last_seen.get(tenant, -math.inf) > IDLE_S and counter < floor:
                counter = floor
            self.counters[tenant] = found[tenant] = counter
            self.last_seen[tenant] = now
        return found
