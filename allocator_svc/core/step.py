"""The batched step: a whole scheduling step's allocations for one pool, atomically.

Items arrive in the gateway's priority order. Running requests are served first; when the
pool is short, a running request preempts running requests behind it, from the tail of the
order or by cost (victims.py), or itself when none behind it would do. Requests waiting for
admission (new ones, and swapped-out ones coming back) are admitted from free space only, in
order, stopping at the first that does not fit, and not at all in a step that preempted (as
vLLM does). A request that cannot be served leaves no trace: it is deferred, or preempted as
a whole.

Decodes come as a column of request ids, each computing one more token: when they all fit
without preemption (most steps), they are served without an item or a Grant per request;
otherwise they join the general path as items, with the same outcome. A decode needs no
value: slots depend on counts, and values arrive in `Appends` once known (request.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from allocator_svc.core.pool import Pool
from allocator_svc.core.request import Grant, Request
from allocator_svc.core.victims import PreemptionPolicy, choose_victim
from common.step_records import BlockCopy, PreemptionMode, StepItem


@dataclass(slots=True)
class Appends:
    """Token values the caller has learned: request `request_ids[i]` appends `token_ids[i]`
    (one request's rows in order). Columns: a step carries one per decoding request."""

    request_ids: Sequence[str]
    token_ids: Sequence[int]


@dataclass(frozen=True, slots=True)
class Preemption:
    request_id: str
    mode: PreemptionMode


class StepResult:
    """What a step changed. Built by hand, not as a dataclass: nine default factories cost
    0.8 us a step, a quarter of a one-request decode step."""

    __slots__ = (
        "grants",
        "preempted",
        "deferred",
        "copies",
        "swap_out",
        "swap_in",
        "swapped_in",
        "appended_request_ids",
        "appended_block_ids",
        "appended_indexes",
        "tenant_service",
    )

    def __init__(self) -> None:
        self.grants: list[Grant] = []
        self.preempted: list[Preemption] = []
        self.deferred: list[str] = []
        self.copies: list[BlockCopy] = []
        self.swap_out: list[BlockCopy] = []
        self.swap_in: list[BlockCopy] = []
        self.swapped_in: list[str] = []  # requests brought back from CPU blocks
        # Decodes (the `decode_request_ids` column) that reached a block boundary and got one
        # fresh block at table index `appended_indexes[i]`: their grants, in columns.
        self.appended_request_ids: list[str] = []
        self.appended_block_ids: list[int] = []
        self.appended_indexes: list[int] = []
        self.tenant_service: dict[str, float] | None = None  # waiting tenants' (fair share)

    def all_grants(self, block_size: int) -> list[Grant]:
        """Every grant as a `Grant`, the columnar appends first (they lead the priority order)."""
        appended = [
            Grant(request_id, index, [block_id], 1, index * block_size)
            for request_id, block_id, index in zip(
                self.appended_request_ids,
                self.appended_block_ids,
                self.appended_indexes,
                strict=True,
            )
        ]
        return appended + self.grants


def run_step(
    pool: Pool,
    items: Sequence[StepItem],
    mode: PreemptionMode,
    lease_id: str | None,
    decode_requests: list[Request] | None = None,
    step_id: int = 0,
    tenant_quota: int = 0,
    policy: PreemptionPolicy = PreemptionPolicy.TAIL,
) -> StepResult:
    """Schedule `decode_requests` (one more token each), then `items` (all validated by the
    caller); return what changed. What it grants is kept as
    step `step_id` of the lease, until a call commits it (scheduled_steps.py).
    `tenant_quota` (blocks; 0: none): TenantQuota. `policy`: whom a shortage preempts, and
    how (victims.py)."""
    result = StepResult()
    scheduled: list[Request] = []
    if decode_requests:
        if not _run_plain_decodes(pool, decode_requests, result):
            decode_items = [StepItem(r.request_id, 1, decode=True) for r in decode_requests]
            items = [*decode_items, *items]
        elif not items:  # the common step: served
            _finish(pool, lease_id, step_id, decode_requests, result)
            return result
        else:
            scheduled.extend(decode_requests)
    running: list[tuple[StepItem, Request]] = []
    admissions: list[StepItem] = []
    for item in items:
        request = pool.requests.get(item.request_id)
        if request is None:
            admissions.append(item)
            continue
        if request.swapped:
            admissions.append(item)
        else:
            running.append((item, request))

    preempted: set[str] = set()
    drafting: list[tuple[Request, Grant, int]] = []  # (lookahead asked: served last)
    bs = pool.block_size
    free_blocks = pool.blocks
    for index, (item, request) in enumerate(running):
        if preempted and item.request_id in preempted:
            continue
        computed = request.num_computed
        # Known, uncomputed tokens; a decode's one token may be unknown (validated).
        num_tokens = len(request.token_ids) + item.decode - computed
        if item.num_tokens < num_tokens:
            num_tokens = item.num_tokens
        if num_tokens <= 0:
            continue
        offset = computed % bs
        lookahead = item.num_lookahead
        if num_tokens == item.num_tokens and offset + num_tokens <= bs and not lookahead:
            if offset and request.blocks[computed // bs].ref_count == 1:
                # Fast path (most decode steps): the tokens fit the private last block.
                request.num_computed = computed + num_tokens
                scheduled.append(request)
                continue
            if not offset and len(request.blocks) * bs == computed and free_blocks.num_free:
                # Fast path (a decode step in every block_size): one fresh block appended.
                taken = free_blocks.allocate(1)
                assert taken is not None, "checked: a block is free"
                block = taken[0]
                request.blocks.append(block)
                request.num_computed = computed + num_tokens
                scheduled.append(request)
                result.grants.append(
                    Grant(
                        item.request_id,
                        len(request.blocks) - 1,
                        [block.block_id],
                        num_tokens,
                        computed,
                    )
                )
                continue
        while (short := pool.blocks_needed(request, num_tokens) - pool.blocks.num_free) > 0:
            victim = choose_victim(pool, running, index + 1, preempted, short, mode, policy)
            if victim is None:
                break
            _preempt(pool, victim.request, victim.mode, result)
            preempted.add(victim.request.request_id)
        grant = pool.allocate(request, num_tokens, result.copies)
        if grant is None:
            # Not scheduled: a step's commit must never reach it (swapped back in by a later
            # step, its fresh blocks hold nothing until that step's batch has run).
            _preempt(pool, request, mode, result)
            preempted.add(request.request_id)
            continue
        scheduled.append(request)
        if lookahead:
            drafting.append((request, grant, lookahead))
            result.grants.append(grant)  # (it says how much lookahead was granted)
        elif grant.changes_table or grant.num_scheduled != item.num_tokens:
            result.grants.append(grant)

    quota = TenantQuota(pool, tenant_quota) if tenant_quota else None
    for position, item in enumerate(admissions):
        if quota is not None and not quota.admits(item):
            result.deferred.append(item.request_id)  # its tenant waits; the others go on
            continue
        grant = None if preempted else _admit(pool, item, lease_id, result)
        if grant is None:
            result.deferred.extend(i.request_id for i in admissions[position:])
            break
        result.grants.append(grant)
        admitted = pool.requests[item.request_id]
        if quota is not None:
            quota.add(admitted)
        if grant.num_scheduled:
            scheduled.append(admitted)
    for request, grant, wanted in drafting:
        # Draft slots come from what every token of the step has left free.
        pool.add_lookahead(request, grant, wanted)
    _finish(pool, lease_id, step_id, scheduled, result)
    return result


def _finish(pool: Pool, lease_id: str | None, step_id: int, scheduled: list[Request],
            result: StepResult) -> None:
    """Keep what the step granted for its commit, with the CPU-tier copies of the cached
    blocks it evicted (swap-outs: the executor applies them before anything else)."""
    service = pool.tenant_service
    if service is not None and service.in_use:
        service.charge(scheduled)
    copies, tier, holds = pool.end_step(numbered=bool(step_id))
    if copies:
        result.swap_out.extend(copies)
    if tier is not None and step_id and not scheduled:
        tier.tainted = True  # nothing of it can be aborted: never trusted
    pool.scheduled.record(lease_id, step_id, scheduled, tier, holds)


def _run_plain_decodes(pool: Pool, batch: list[Request], result: StepResult) -> bool:
    """Serve every decode without preemption, or change nothing and return False.

    The common step: each request's token fits its private last block or, once every
    block_size steps, takes one fresh block, and the pool has them all. Anything else (a
    shortage, a shared last block) goes the general way."""
    bs = pool.block_size
    num_boundaries = 0
    for request in batch:
        computed = request.num_computed
        if computed % bs:
            if request.blocks[computed // bs].ref_count != 1:
                return False  # a shared partial block: copy-on-write
        elif len(request.blocks) * bs == computed:
            num_boundaries += 1
        else:
            return False
    if num_boundaries > pool.blocks.num_free:
        return False  # someone must be preempted
    taken = pool.blocks.allocate(num_boundaries) if num_boundaries else []  # 15 steps in 16: none
    assert taken is not None, "checked: the pool has num_boundaries free blocks"
    fresh = iter(taken)
    for request in batch:
        computed = request.num_computed
        request.num_computed = computed + 1
        if not computed % bs:
            block = next(fresh)
            result.appended_request_ids.append(request.request_id)
            result.appended_block_ids.append(block.block_id)
            result.appended_indexes.append(len(request.blocks))
            request.blocks.append(block)
    return True


def _preempt(pool: Pool, request: Request, mode: PreemptionMode, result: StepResult) -> None:
    pool.num_preemptions += 1
    if mode is PreemptionMode.SWAP:
        copies = pool.swap_out(request)
        if copies is not None:
            result.swap_out.extend(copies)
            result.preempted.append(Preemption(request.request_id, PreemptionMode.SWAP))
            return
    pool.free(request)
    result.preempted.append(Preemption(request.request_id, PreemptionMode.RECOMPUTE))


class TenantQuota:
    """Per-tenant block quota at admission: a tenant's new request is admitted while the
    blocks its running requests hold, plus the prompt's, stay within the quota, so that one
    tenant cannot take a pool from the others. A tenant holding nothing is always admitted
    (a request larger than the quota still runs, alone). Running requests are not stopped
    when they grow past it: the quota decides who may start, not who must stop."""

    __slots__ = ("held", "limit", "pool")

    def __init__(self, pool: Pool, limit: int) -> None:
        self.pool = pool
        self.limit = limit
        self.held: dict[str, int] | None = None  # counted at the first tenant's admission

    def admits(self, item: StepItem) -> bool:
        if not item.tenant or item.prompt_token_ids is None:  # no tenant, or swapped back
            return True
        return self.fits(item.tenant, self.pool.blocks_for(len(item.prompt_token_ids)))

    def fits(self, tenant: str, num_blocks: int) -> bool:
        """The tenant may start a request of `num_blocks` (also a hand-off's reservation)."""
        held = self.held_by(tenant)
        return held == 0 or held + num_blocks <= self.limit

    def held_by(self, tenant: str) -> int:
        return self._held().get(tenant, 0)

    def add(self, request: Request) -> None:
        if self.held is not None and request.tenant:
            self.held[request.tenant] = self.held.get(request.tenant, 0) + len(request.blocks)

    def _held(self) -> dict[str, int]:
        if self.held is None:
            self.held = {}
            for request in self.pool.requests.values():
                if request.tenant and not request.swapped:
                    self.held[request.tenant] = (
                        self.held.get(request.tenant, 0) + len(request.blocks))
        return self.held


def _admit(pool: Pool, item: StepItem, lease_id: str | None, result: StepResult) -> Grant | None:
    request = pool.requests.get(item.request_id)
    if request is not None:  # swapped out: bring it back
        num_tokens = max(min(item.num_tokens, len(request.token_ids) - request.num_computed), 0)
        grant = pool.swap_in(request, num_tokens, result.swap_in)
        if grant is not None:
            result.swapped_in.append(request.request_id)
        return grant
    assert item.prompt_token_ids is not None, "validated: a new request carries its prompt"
    prompt = list(item.prompt_token_ids)
    request = Request(item.request_id, lease_id, pool.root(item.cache_salt), prompt, len(prompt),
                      tenant=item.tenant, priority=item.priority)
    return pool.admit(request, item.num_tokens, result.swap_in, resumed=item.resumed,
                      lookup=not item.skip_prefix_lookup)
