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

What a step did to the CPU tier (cpu_blocks.py: the cached blocks it evicted there, the
entries it copied back) is kept with it too and settled when it is committed: its entries are
then written, unless one of its requests was aborted before (the executor may have refused the
step: they are dropped). A step that is never committed (pushed out of the kept steps, its
lease expired) drops its entries. An unnumbered step's are settled at once, as written.

NOTE: so are the blocks a step's copies still read (`StepHolds`): the device blocks its
swap-outs copy from and the CPU blocks its swap-ins copy from, which the step gave up. Two
leases stepping one pool are not ordered at the executor, so another lease's step, planned
later, could run first and write them before this step's copy has read them. Each one still
free when the step is built is held (a device block by one reference, out of the free queue;
a CPU block out of the free list) until the step is settled. The same step may reuse them: the
executor applies a step's swap-outs before its swap-ins, copies and forward, and a lease's own
steps run in order.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Protocol

from allocator_svc.core.block_pool import BlockPool
from allocator_svc.core.cpu_blocks import CpuBlocks, TierOps
from allocator_svc.core.free_queue import Block
from allocator_svc.core.request import Request
from common.errors import InvalidArgument

# Steps kept per lease at most: a caller that never commits loses prefix caching for the
# oldest (never correctness: a block not cached is always safe), not memory. A gateway keeps
# two outstanding.
MAX_KEPT_STEPS = 16


class Committer(Protocol):
    """The pool, as far as committing a step's requests goes."""

    def commit_run(self, requests: list[Request], counts: Iterable[int]) -> None: ...


@dataclass(slots=True, eq=False)
class StepHolds:
    """Blocks a step gave up that its copies still read, held until it is settled."""

    device: list[Block]  # its swap-outs' sources, one reference each
    cpu: list[int]  # its swap-ins' sources


@dataclass(slots=True, eq=False)
class KeptStep:
    step_id: int
    requests: list[Request]  # the requests it scheduled ...
    counts: list[int]  # ... each at the count it granted
    tier: TierOps | None = None  # what it did to the CPU tier
    holds: StepHolds | None = None


class ScheduledSteps:
    """Per lease (None: no lease): its numbered steps not yet committed, oldest first, and
    the newest id it has sent. Two leases may step the same pool."""

    __slots__ = ("blocks", "cpu", "kept", "newest")

    def __init__(self, cpu: CpuBlocks | None = None, blocks: BlockPool | None = None) -> None:
        self.cpu = cpu  # the CPU tier the kept steps' TierOps settle in
        self.blocks = blocks  # where held device blocks go back
        self.kept: dict[str | None, deque[KeptStep]] = {}
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

    def record(self, lease_id: str | None, step_id: int, requests: list[Request],
               tier: TierOps | None = None, holds: StepHolds | None = None) -> None:
        """What step `step_id` granted: each request at its count now, what it did to the
        CPU tier, the blocks it holds. 0: nothing kept (settled at once, as done)."""
        step = KeptStep(step_id, requests, [r.num_computed for r in requests], tier, holds)
        if not step_id:
            self._settle(step, ran=True)
            return
        self.newest[lease_id] = step_id
        kept = self.kept.setdefault(lease_id, deque())
        kept.append(step)
        if len(kept) > MAX_KEPT_STEPS:
            # Never committed: its blocks stay out of the prefix cache, its CPU entries go.
            self._settle(kept.popleft(), ran=False)

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
        while kept and kept[0].step_id <= step_id:
            step = kept.popleft()
            requests, counts = step.requests, step.counts
            if aborted:
                pairs = [(r, c) for r, c in zip(requests, counts, strict=True)
                         if r.request_id not in aborted]
                if step.tier is not None and len(pairs) < len(requests):
                    step.tier.tainted = True
                requests, counts = [r for r, _ in pairs], [c for _, c in pairs]
            pool.commit_run(requests, counts)
            self._settle(step, ran=step.tier is None or not step.tier.tainted)

    def drop(self, request: Request) -> None:
        """The request's KV moved to blocks that a later batch writes (a swap-in's copies run
        with the batch of the step that granted it): what older steps granted it must not
        commit into them. The swap-in step, recorded after this, commits it all."""
        kept = self.kept.get(request.lease_id)
        if kept is None:
            return
        for step in kept:
            if any(r is request for r in step.requests):
                pairs = [(r, c) for r, c in zip(step.requests, step.counts, strict=True)
                         if r is not request]
                step.requests, step.counts = [r for r, _ in pairs], [c for _, c in pairs]

    def aborted(self, request: Request) -> None:
        """The request is aborted: a kept step that scheduled it may have been refused by the
        executor, so the CPU-tier entries that step was to write are dropped when it is
        committed (their blocks stay reserved until then: the step may still be running).
        Every lease's steps are looked at: a call without a lease may step any request."""
        for steps in self.kept.values():
            for step in steps:
                if step.tier is not None and any(r is request for r in step.requests):
                    step.tier.tainted = True

    def forget(self, lease_id: str | None) -> None:
        for step in self.kept.pop(lease_id, ()):
            self._settle(step, ran=False)
        self.newest.pop(lease_id, None)

    def unsettled(self) -> list[TierOps]:
        """The kept steps' CPU-tier work (for the invariants)."""
        return [s.tier for steps in self.kept.values() for s in steps if s.tier is not None]

    def held(self) -> list[StepHolds]:
        """The kept steps' held blocks (for the invariants)."""
        return [s.holds for steps in self.kept.values() for s in steps if s.holds is not None]

    def _settle(self, step: KeptStep, ran: bool) -> None:
        """Its tier work settled (`ran`: confirmed); its held blocks go back either way."""
        if step.tier is not None:
            assert self.cpu is not None, "CPU-tier work without a CPU tier"
            self.cpu.settle(step.tier, ran)
        if step.holds is not None:
            assert self.blocks is not None and self.cpu is not None, "holds without a pool"
            self.blocks.free(reversed(step.holds.device))
            self.cpu.release(step.holds.cpu)
            step.holds = None
