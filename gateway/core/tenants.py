"""Tenants at admission: which waiting requests may start, so that one tenant cannot take
an executor from the others.

Two limits, both applied when the scheduler admits waiting requests:
- `max_running_per_tenant` (the gateway's own, per executor): a tenant's running, swapped
  and parked sequences, each request counting its n (or beam width). A request that would
  pass it is passed over and the next tenant's go first; a request wider than the limit runs
  alone (the allocator's block quota does the same), else it would never run.
- the allocator's block quota (`--max-blocks-per-tenant`): the allocator defers what passes
  it. A tenant found at its quota stands aside (`blocked`) until one of its sequences here
  ends, so that it does not fill every step's budget with admissions the allocator defers
  while other tenants wait behind it.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence as Rows
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from gateway.core.request_state import Request, Sequence


@dataclass(slots=True)
class TenantRunning:
    """A tenant's requests running on this pool, and their sequences (Request.num_seqs)."""

    requests: set[Request] = field(default_factory=set)
    num_seqs: int = 0

    def add(self, request: Request) -> None:
        if request not in self.requests:
            self.requests.add(request)
            self.num_seqs += request.num_seqs


@dataclass(slots=True)
class TenantGate:
    max_running_per_tenant: int = 0  # 0: no limit
    # Tenants at the allocator's block quota: their waiting requests stand aside.
    blocked: set[str] = field(default_factory=set)

    def admission(self, holding: Iterable[Sequence]) -> Admission:
        """One step's admissions, given the sequences that hold a place (running, swapped,
        parked)."""
        running: dict[str, TenantRunning] | None = None
        if self.max_running_per_tenant:
            running = {}
            for seq in holding:
                if seq.request.tenant:
                    running.setdefault(seq.request.tenant, TenantRunning()).add(seq.request)
        return Admission(self, running)

    def note_deferrals(self, new: Rows[tuple[str, str]], deferred: AbstractSet[str],
                       holding: AbstractSet[str]) -> None:
        """`new`: the step's new items in order, as (request id, tenant); `deferred`: the ids
        the allocator deferred. One deferred while one after it was admitted was
        deferred by its tenant's block quota: for lack of space the allocator defers every
        admission after the first that does not fit. (None admitted: the pool is full, no
        quota is to blame.) Only a tenant `holding` sequences here stands aside: one of them
        ending clears the mark; a tenant whose blocks another gateway's requests hold is
        simply deferred again."""
        last_admitted = max((k for k, (rid, _) in enumerate(new) if rid not in deferred),
                            default=-1)
        for rid, tenant in new[:max(last_admitted, 0)]:
            if rid in deferred and tenant and tenant in holding:
                self.blocked.add(tenant)

    def unblock(self, tenant: str) -> None:
        """One of the tenant's sequences ended or was preempted: its blocks came back."""
        self.blocked.discard(tenant)


@dataclass(slots=True)
class Admission:
    gate: TenantGate
    running: dict[str, TenantRunning] | None

    def admits(self, request: Request) -> bool:
        """The request may start now (it is counted as running from here on)."""
        tenant = request.tenant
        if tenant in self.gate.blocked:
            return False
        if self.running is None or not tenant:
            return True
        running = self.running.setdefault(tenant, TenantRunning())
        if request not in running.requests:
            limit = self.gate.max_running_per_tenant
            if running.num_seqs and running.num_seqs + request.num_seqs > limit:
                return False  # its tenant is at its limit: the next tenant's go first
            running.add(request)
        return True
