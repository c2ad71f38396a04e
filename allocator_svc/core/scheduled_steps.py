"""The commit rule's bookkeeping: a full block enters the prefix cache only once the executor
has written its KV. A caller numbers its Steps (`step_id`, increasing per lease and pool) and
says which have executed: "every step up to N" (`commit_through_step_id`). Until then, what
each numbered step granted is kept here, per lease, with each request's count at that step.

Committing through N commits every kept step up to N, oldest first, at the counts it granted
(but a request swapped in since: its KV is in new blocks, written only when the swap-in
step's batch runs, so only that step and later ones commit it);
an id already committed is nothing to do, so resending it is harmless. A step whose batch
failed is covered by a later N too: the caller aborts its requests before (or in the same
call), and an aborted or freed request is never committed. An unnumbered step (0) keeps
nothing: its caller commits with explicit commits. The pool does the committing
(Pool.commit_run).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from collections.abc import Set as AbstractSet
from typing import Protocol

from allocator_svc.core.request import Request
from common.errors import InvalidArgument

# Steps kept per lease at most: a caller that never commits loses prefix caching for the
# oldest (never correctness: a block not cached is always safe), not memory. A gateway keeps
# two outstanding.
MAX_KEPT_STEPS = 16


class Committer(Protocol):
    """The pool, as far as committing a step's requests goes."""

    def commit_run(self, requests: list[Request], counts: Iterable[int]) -> None: ...


class ScheduledSteps:
    """Per lease (None: no lease): its numbered steps not yet committed, oldest first, and
    the newest id it has sent. Two leases may step the same pool."""

    __slots__ = ("kept", "newest")

    def __init__(self) -> None:
        self.kept: dict[str | None, deque[tuple[int, list[Request], list[int]]]] = {}
        self.newest: dict[str | None, int] = {}

    def check(self, lease_id: str | None, step_id: int, commit_through: int) -> None:
        """A numbered step must be newer than the lease's last; the steps committed must have
        been sent. Nothing is changed."""
        newest = self.newest.get(lease_id, 0)
        if step_id and step_id <= newest:
            raise InvalidArgument(
                f"step_id {step_id} is not newer than this lease's last step {newest}: "
                "number each Step anew, increasing"
            )
        if commit_through > max(newest, step_id - 1 if step_id else 0):
            raise InvalidArgument(
                f"commit_through_step_id {commit_through} names a step not sent yet (the "
                f"newest is {newest}): commit only steps whose batches executed"
            )

    def record(self, lease_id: str | None, step_id: int, requests: list[Request]) -> None:
        """What step `step_id` granted: each request at its count now. 0: nothing kept."""
        if not step_id:
            return
        self.newest[lease_id] = step_id
        kept = self.kept.setdefault(lease_id, deque())
        kept.append((step_id, requests, [r.num_computed for r in requests]))
        if len(kept) > MAX_KEPT_STEPS:
            kept.popleft()  # never committed: its blocks stay out of the prefix cache

    def commit_through(
        self,
        pool: Committer,
        lease_id: str | None,
        step_id: int,
        aborted: AbstractSet[str] = frozenset(),
    ) -> None:
        """Commit every kept step of the lease up to `step_id`, oldest first, but for the
        requests in `aborted` (an abort commits nothing)."""
        kept = self.kept.get(lease_id)
        while kept and kept[0][0] <= step_id:
            _, requests, counts = kept.popleft()
            if aborted:
                pairs = [(r, c) for r, c in zip(requests, counts, strict=True)
                         if r.request_id not in aborted]
                requests, counts = [r for r, _ in pairs], [c for _, c in pairs]
            pool.commit_run(requests, counts)

    def drop(self, request: Request) -> None:
        """The request's KV moved to blocks that a later batch writes (a swap-in's copies run
        with the batch of the step that granted it): what older steps granted it must not
        commit into them. The swap-in step, recorded after this, commits it all."""
        kept = self.kept.get(request.lease_id)
        if kept is None:
            return
        for index, (step_id, requests, counts) in enumerate(kept):
            if any(r is request for r in requests):
                pairs = [(r, c) for r, c in zip(requests, counts, strict=True) if r is not request]
                kept[index] = (step_id, [r for r, _ in pairs], [c for _, c in pairs])

    def forget(self, lease_id: str | None) -> None:
        self.kept.pop(lease_id, None)
        self.newest.pop(lease_id, None)
