"""The commit rule's bookkeeping: a full block enters the prefix cache only once the executor
has written its KV. The gateway confirms a whole step with one flag (commit_previous_step),
so what each step granted is kept per lease until a call commits or drops it.

Not pipelined, a Step commits what the previous Step granted, at the requests' current
counts (nothing was granted since). Pipelined (previous_step_in_flight), the previous step is
still executing: its grants are kept with each request's count at that point, and the next
Step commits them, once the gateway has seen that batch return. The pool does the committing
(Pool.commit_current, Pool.commit_run).
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Set as AbstractSet
from typing import Protocol

from allocator_svc.core.request import Request


class Committer(Protocol):
    """The pool, as far as committing a step's requests goes."""

    def commit_current(self, requests: list[Request]) -> None: ...

    def commit_run(self, requests: list[Request], counts: Iterable[int]) -> None: ...


class ScheduledSteps:
    """Per lease (None: no lease): the requests its latest Step granted tokens, and in a
    pipeline the Step before it, with the counts it granted them. Two leases may step the
    same pool."""

    __slots__ = ("latest", "executing")

    def __init__(self) -> None:
        self.latest: dict[str | None, list[Request]] = {}
        self.executing: dict[str | None, tuple[list[Request], list[int]]] = {}

    def record(self, lease_id: str | None, requests: list[Request]) -> None:
        self.latest[lease_id] = requests

    def forget(self, lease_id: str | None) -> None:
        self.latest.pop(lease_id, None)
        self.executing.pop(lease_id, None)

    def advance(
        self,
        pool: Committer,
        lease_id: str | None,
        commit_previous: bool,
        previous_in_flight: bool,
        aborted: AbstractSet[str] = frozenset(),
    ) -> None:
        """Before a Step: commit the steps it confirms executed (commit_previous), drop the
        rest; with the previous step in flight, keep that one for the next call. A request
        the same call aborts is never committed (an abort commits nothing)."""
        latest = self.latest.pop(lease_id, None)
        executing = self.executing.pop(lease_id, None) if self.executing else None
        if aborted and commit_previous:
            if latest:
                latest = [r for r in latest if r.request_id not in aborted]
            if executing is not None:
                kept = [(r, c) for r, c in zip(*executing, strict=True)
                        if r.request_id not in aborted]
                executing = ([r for r, _ in kept], [c for _, c in kept])
        if commit_previous and executing is not None:
            pool.commit_run(*executing)
        if previous_in_flight:
            if latest:
                self.executing[lease_id] = (latest, [r.num_computed for r in latest])
        elif commit_previous and latest:
            pool.commit_current(latest)
