"""The allocator: every registered pool, the leases, and argument validation.

Single writer: the service calls these methods from one asyncio event loop and none of them
awaits, so every call is atomic without locks. Each call validates all of its arguments
before it mutates anything, so a rejected call changes nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import chain
from operator import attrgetter

from allocator_svc.core.cpu_blocks import CpuEntry
from allocator_svc.core.hand_off import HandOff, check_hand_off, reserve
from allocator_svc.core.leases import Lease, LeaseTable
from allocator_svc.core.limits import Limits
from allocator_svc.core.pins import Pin, PinStatus, pin_budget
from allocator_svc.core.pool import Pool, PoolConfig
from allocator_svc.core.request import Request
from allocator_svc.core.step import Appends, StepResult, run_step
from allocator_svc.core.tenant_service import TenantService
from allocator_svc.core.validation import (
    check_accepts,
    check_appends,
    check_commits,
    check_decodes,
    check_items,
    check_length,
    check_owner,
    check_pin,
    check_pin_budget,
    check_pool_config,
    check_releases,
    check_token_ids,
    check_values_known,
    check_waiting_tenants,
)
from allocator_svc.core.victims import PreemptionPolicy
from common.credentials import lease_tag
from common.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from common.step_records import BlockCopy, Commit, StepCall

_NONE_RELEASED: frozenset[str] = frozenset()
_TOKENS = attrgetter("token_ids")


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    pool_id: str
    num_cached_tokens: int
    num_free_blocks: int
    num_running_requests: int
    num_cpu_cached_tokens: int = 0  # of num_cached_tokens, in the CPU tier


class Allocator:
    def __init__(self, limits: Limits, clock: Callable[[], float] = time.monotonic,
                 preemption_policy: PreemptionPolicy = PreemptionPolicy.TAIL,
                 tenant_service: TenantService | None = None) -> None:
        self.limits = limits
        self.clock = clock
        self.preemption_policy = preemption_policy  # whom a short step preempts (victims.py)
        # Every tenant's service over all pools, charged by every step (tenant_service.py).
        self.tenant_service = tenant_service or TenantService(clock=clock)
        self.pools: dict[str, Pool] = {}
        self.leases = LeaseTable()
        self.num_expired_leases = 0

    # Pools.
    def register_pool(self, config: PoolConfig) -> tuple[Pool, bool]:
        """Register (idempotent for the same executor instance); returns (pool, was_reset)."""
        check_pool_config(config, self.limits)
        existing = self.pools.get(config.pool_id)
        if existing is not None and existing.config == config:
            return existing, False
        if existing is not None and existing.config.executor_instance_id == (
            config.executor_instance_id
        ):
            raise AlreadyExists(
                f"pool {config.pool_id!r} exists with another shape for the same executor "
                "instance; a restarted executor must register with a new executor_instance_id"
            )
        if existing is None and len(self.pools) >= self.limits.max_pools:
            raise ResourceExhausted(f"at most {self.limits.max_pools} pools may be registered")
        epoch = max(time.time_ns(), existing.epoch + 1 if existing else 0)
        budget = pin_budget(config.num_blocks, self.limits.max_pinned_fraction)
        pool = Pool(config, epoch, self.limits.event_capacity, budget)
        pool.tenant_service = self.tenant_service
        if existing is not None:  # pins are configuration: the new pool keeps what it can
            pool.pins.carry(existing.pins.pins.values(), pool.block_size, pool.chain)
        self.pools[config.pool_id] = pool
        return pool, existing is not None

    def pool(self, pool_id: str, epoch: int | None = None) -> Pool:
        pool = self.pools.get(pool_id)
        if pool is None:
            raise NotFound(f"unknown pool {pool_id!r}: register it first")
        if epoch is not None and epoch != pool.epoch:
            raise FailedPrecondition(
                f"pool {pool_id!r} is at epoch {pool.epoch}, not {epoch}: it was reset after an "
                "executor restart; describe the pool and resubmit its requests"
            )
        return pool

    # The hot path.
    def step(self, pool_id: str, epoch: int, lease_id: str | None, call: StepCall) -> StepResult:
        """One scheduling step of the pool `pool_id` at `epoch`, for the caller's lease
        (StepCall says in which order its parts apply)."""
        pool = self.pools.get(pool_id)
        if pool is None or pool.epoch != epoch:
            pool = self.pool(pool_id, epoch)  # raises, with the message
        items, decode_ids = call.items, call.decode_request_ids
        commits, free_ids, abort_ids = call.commits, call.free_request_ids, call.abort_request_ids
        appends = (Appends(call.append_request_ids, call.append_token_ids)
                   if call.append_request_ids or call.append_token_ids else None)
        num_items = len(items) + len(decode_ids)
        commit_through = call.commit_through_step_id
        if not (num_items or commits or free_ids or abort_ids or appends or commit_through
                or call.accept_request_ids):
            raise InvalidArgument("empty step: send at least one item, commit, free or abort")
        if call.waiting_tenants:
            check_waiting_tenants(call.waiting_tenants, self.limits)
        if num_items > self.limits.max_batch_items:
            raise InvalidArgument(
                f"{num_items} items exceed the maximum batch of {self.limits.max_batch_items}"
            )
        scheduled = pool.scheduled
        if call.step_id or commit_through:
            scheduled.check(lease_id, call.step_id, commit_through)
        if lease_id is not None:
            self._live_lease(lease_id)
            # Every request named must be this lease's (new ones are admitted into it; the
            # decodes and appends are checked with their columns).
            if items:
                check_owner(pool, [i.request_id for i in items if not i.prompt_token_ids], lease_id)
            if commits:
                check_owner(pool, [c.request_id for c in commits], lease_id)
            if free_ids or abort_ids:
                check_owner(pool, (*free_ids, *abort_ids), lease_id)
        # The common step is decodes and appends: skip the checks with nothing to check.
        released = (
            check_releases(pool, free_ids, abort_ids) if free_ids or abort_ids else _NONE_RELEASED
        )
        if commits:
            check_commits(pool, commits)
        if items:
            check_items(pool, items, released, self.limits)
        # The common step appends one value to each decode: checked with the decodes.
        one_value_each = appends is not None and appends.request_ids == decode_ids
        decode_requests = (
            check_decodes(pool, decode_ids, items, released, lease_id, one_value_each)
            if decode_ids else []
        )
        appended = (
            check_appends(pool, appends, lease_id, one_value_each, decode_requests)
            if appends is not None else None
        )
        if decode_requests:
            check_values_known(decode_requests, appended, one_value_each)
        accepted = (
            check_accepts(pool, call.accept_request_ids, call.accept_counts, lease_id, appends)
            if call.accept_request_ids or call.accept_counts else ()
        )
        # Validated: from here on the call is applied.
        if appended:
            assert appends is not None
            # (C-level: each request's list.append with its value; the hot path.)
            list(map(list.append, map(_TOKENS, appended), appends.token_ids))
        for request, count in accepted:
            pool.settle_lookahead(request, count)
        if pool.lookahead:
            # Lookahead this lease's call did not settle: its drafts count as rejected (the
            # caller's batch has landed before it plans again, or it never ran).
            for request in [r for r in pool.lookahead if r.lease_id == lease_id]:
                pool.settle_lookahead(request, 0)
        if commit_through:
            scheduled.commit_through(pool, lease_id, commit_through, frozenset(abort_ids))
        for commit in commits:
            pool.commit(pool.requests[commit.request_id], commit.num_computed_tokens)
        if released:
            for request_id in free_ids:
                pool.free(pool.requests[request_id])
            for request_id in abort_ids:
                pool.abort(pool.requests[request_id])
        if call.waiting_tenants:
            self.tenant_service.in_use = True  # this step is charged too
        result = run_step(
            pool, items, call.mode, lease_id, decode_requests, call.step_id,
            self.limits.max_blocks_per_tenant, self.preemption_policy,
        )
        if call.waiting_tenants:
            result.tenant_service = self.tenant_service.service(call.waiting_tenants)
        return result

    # Outside a step. `lease_id`: the caller's lease, which every named request must be in.
    def free(
        self,
        pool_id: str,
        epoch: int,
        commits: list[Commit],
        request_ids: list[str],
        lease_id: str | None = None,
        commit_through: int = 0,
        aborted: bool = False,
    ) -> Pool:
        pool = self.pool(pool_id, epoch)
        self._check_owner(pool, chain(request_ids, (c.request_id for c in commits)), lease_id)
        check_releases(pool, request_ids, [])
        check_commits(pool, commits)
        if commit_through:
            pool.scheduled.check(lease_id, 0, commit_through)
            pool.scheduled.commit_through(pool, lease_id, commit_through)
        for commit in commits:
            pool.commit(pool.requests[commit.request_id], commit.num_computed_tokens)
        release = pool.abort if aborted else pool.free
        for request_id in request_ids:
            release(pool.requests[request_id])
        return pool

    def abort(
        self, pool_id: str, epoch: int, request_ids: list[str], lease_id: str | None = None
    ) -> Pool:
        """Free without committing: blocks whose KV was never confirmed are not cached."""
        return self.free(pool_id, epoch, [], request_ids, lease_id, aborted=True)

    def fork(
        self,
        pool_id: str,
        epoch: int,
        parent_id: str,
        child_ids: list[str],
        lease_id: str | None = None,
    ) -> list[Request]:
        pool = self.pool(pool_id, epoch)
        parent = pool.requests.get(parent_id)
        if parent is None:
            raise NotFound(f"unknown parent request {parent_id!r}")
        self._check_owner(pool, [parent_id], lease_id)
        if parent.swapped:
            raise FailedPrecondition(f"parent {parent_id!r} is swapped out; swap it in first")
        if parent.num_computed > len(parent.token_ids):
            raise FailedPrecondition(
                f"parent {parent_id!r} holds a computed token whose value is unknown: append "
                "its value first"
            )
        if not child_ids or len(set(child_ids)) != len(child_ids):
            raise InvalidArgument("child_request_ids must be non-empty and distinct")
        for child_id in child_ids:
            if not child_id:
                raise InvalidArgument("every child needs a request id")
            check_length("child_request_ids", child_id, self.limits.max_id_chars)
            if child_id in pool.requests:
                raise AlreadyExists(f"request {child_id!r} already exists")
        return pool.fork(parent, child_ids)

    def swap_out(
        self, pool_id: str, epoch: int, request_id: str, lease_id: str | None = None
    ) -> list[BlockCopy]:
        pool = self.pool(pool_id, epoch)
        request = pool.requests.get(request_id)
        if request is None:
            raise NotFound(f"unknown request {request_id!r}")
        self._check_owner(pool, [request_id], lease_id)
        if request.swapped:
            raise FailedPrecondition(f"request {request_id!r} is already swapped out")
        copies = pool.swap_out(request)
        pool.end_step(numbered=False)  # nothing else is in this "step": nothing stays busy
        if copies is None:
            raise ResourceExhausted(
                f"pool {pool_id!r} has {len(pool.free_cpu_block_ids)} free CPU blocks; "
                f"{request_id!r} needs {pool.blocks_for(request.num_computed)}"
            )
        pool.num_preemptions += 1
        return copies

    def reserve_hand_off(self, call: HandOff) -> Request:
        """Reserve, in the target pool, a request whose KV another pool's executor holds
        (hand_off.py); the caller moves the KV, then commits (or aborts) it."""
        pool = self.pool(call.pool_id, call.epoch)
        self._check_owner(pool, [call.request_id], call.lease_id)
        source = self.pools.get(call.source_pool_id) if call.source_pool_id else None
        check_hand_off(pool, call, source, self.limits)
        request = reserve(pool, call)
        if request is None:
            raise ResourceExhausted(
                f"pool {call.pool_id!r} has {pool.blocks.num_free} free blocks, too few for "
                f"the hand-off of {call.request_id!r} ({len(call.token_ids)} tokens, "
                f"{pool.blocks_for(len(call.token_ids))} blocks less its cached prefix): retry "
                "once requests finish, or hand off to another pool"
            )
        return request

    def match_prefix(
        self, token_ids: list[int], cache_salt: str, pool_ids: Iterable[str]
    ) -> list[PrefixMatch]:
        check_token_ids("match_prefix", token_ids)
        pools = [self.pool(pid) for pid in pool_ids] or list(self.pools.values())
        matches = []
        for pool in pools:
            hits, _ = pool.match_prefix(pool.root(cache_salt), token_ids)
            num_cpu = sum(1 for hit in hits if isinstance(hit, CpuEntry))
            matches.append(
                PrefixMatch(
                    pool.config.pool_id,
                    len(hits) * pool.block_size,
                    pool.blocks.num_free,
                    len(pool.requests),
                    num_cpu * pool.block_size,
                )
            )
        return matches

    # Pins (operators): prefixes whose blocks are never evicted, within a per-pool budget.
    def pin_prefix(
        self, pool_id: str, token_ids: list[int], cache_salt: str, name: str
    ) -> tuple[PinStatus, bool]:
        """Pin the full blocks of `token_ids` under `cache_salt`; returns the pin and whether
        it is new. The same chain pinned again under the same name is the same pin."""
        pool = self.pool(pool_id)
        check_pin(pool, token_ids, cache_salt, name, self.limits)
        tokens = token_ids[: len(token_ids) // pool.block_size * pool.block_size]
        hashes = pool.chain(cache_salt, tokens)
        existing = pool.pins.find(hashes)
        if existing is not None:
            if existing.name != name:
                raise AlreadyExists(
                    f"this prefix is pinned in pool {pool_id!r} already, as pin "
                    f"{existing.pin_id!r} named {existing.name!r}: pin it under that name, or "
                    "unpin that one first"
                )
            return pool.pins.status(existing, pool_id, pool.block_size), False
        check_pin_budget(pool, hashes)
        pin_id = pool.pins.new_id()
        pool.pins.add(Pin(pin_id, name, cache_salt, tokens, hashes))
        return pool.pins.status(pool.pins.pins[pin_id], pool_id, pool.block_size), True

    def unpin_prefix(self, pool_id: str, pin_id: str) -> tuple[PinStatus, int]:
        """Drop a pin: its blocks no other pin names go back to the LRU (still cached) once
        no request holds them. Returns the pin as it was and how many blocks it let go."""
        pool = self.pool(pool_id)
        if not pin_id:
            raise InvalidArgument("pin_id is required (PinPrefix returned it; ListPins lists them)")
        pin = pool.pins.pins.get(pin_id)
        if pin is None:
            raise NotFound(
                f"unknown pin {pin_id!r} in pool {pool_id!r}: ListPins lists the pool's pins"
            )
        status = pool.pins.status(pin, pool_id, pool.block_size)
        return status, pool.pins.remove(pin_id)

    def list_pins(self, pool_id: str) -> list[PinStatus]:
        pool = self.pool(pool_id)
        return [pool.pins.status(p, pool_id, pool.block_size) for p in pool.pins.pins.values()]

    # Leases.
    def create_lease(self, ttl_s: float | None) -> Lease:
        # A client taking a new lease after its old one ran out readmits the same request
        # ids: free the expired leases' requests now rather than at the next sweep.
        self.expire_leases()
        ttl = ttl_s if ttl_s else self.limits.default_lease_ttl_s
        if ttl > self.limits.max_lease_ttl_s:
            raise InvalidArgument(
                f"ttl_ms={round(ttl * 1000)} is over this allocator's maximum of "
                f"{round(self.limits.max_lease_ttl_s * 1000)}: keep a shorter lease alive"
            )
        return self.leases.create(ttl, self.clock())

    def keep_alive(self, lease_id: str) -> Lease:
        lease = self.leases.keep_alive(lease_id, self.clock())
        if lease is None:
            self.expire_leases()
            raise NotFound(f"{lease_tag(lease_id)} is unknown or expired: create a new one")
        return lease

    def _live_lease(self, lease_id: str) -> Lease:
        lease = self.leases.get(lease_id, self.clock())
        if lease is None:
            self.expire_leases()
            raise NotFound(f"{lease_tag(lease_id)} is unknown or expired: create a new one")
        return lease

    def _check_owner(self, pool: Pool, request_ids: Iterable[str], lease_id: str | None) -> None:
        """A call outside a step names its lease: it must be live, as for a Step, and hold
        every request named."""
        if lease_id is not None:
            self._live_lease(lease_id)
            check_owner(pool, request_ids, lease_id)

    def expire_leases(self) -> list[str]:
        """Free every request of every expired lease; returns the freed request ids."""
        expired = set(self.leases.expire(self.clock()))
        freed = []
        if expired:
            self.num_expired_leases += len(expired)
            for pool in self.pools.values():
                for request in [r for r in pool.requests.values() if r.lease_id in expired]:
                    pool.free(request)
                    freed.append(request.request_id)
                for lease_id in expired:
                    pool.scheduled.forget(lease_id)
        return freed

    def check_invariants(self) -> None:
        for pool in self.pools.values():
            pool.check_invariants()
