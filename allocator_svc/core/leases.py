"""Client leases: a gateway keeps its lease alive; when it stops, its requests are freed."""

from __future__ import annotations

import secrets
from dataclasses import dataclass


@dataclass(slots=True)
class Lease:
    lease_id: str
    ttl_s: float
    expires_at: float


class LeaseTable:
    def __init__(self) -> None:
        self.leases: dict[str, Lease] = {}

    def create(self, ttl_s: float, now: float) -> Lease:
        lease = Lease("lease-" + secrets.token_hex(8), ttl_s, now + ttl_s)
        self.leases[lease.lease_id] = lease
        return lease

    def get(self, lease_id: str, now: float) -> Lease | None:
        """The live lease, or None when unknown or expired."""
        lease = self.leases.get(lease_id)
        if lease is None or lease.expires_at <= now:
            return None
        return lease

    def keep_alive(self, lease_id: str, now: float) -> Lease | None:
        lease = self.get(lease_id, now)
        if lease is not None:
            lease.expires_at = now + lease.ttl_s
        return lease

    def expire(self, now: float) -> list[str]:
        """Remove and return the ids of every lease that has run out."""
        expired = [lid for lid, lease in self.leases.items() if lease.expires_at <= now]
        for lease_id in expired:
            del self.leases[lease_id]
        return expired
