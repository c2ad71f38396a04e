"""The AllocatorService servicer: decode the proto, call the core, encode the answer.

Every handler runs on the server's one event loop and calls the core synchronously, so each
RPC is applied atomically (single writer, no locks).

Every call that changes a request names a lease: a request's blocks can be committed, freed,
forked or aborted only under the lease that admitted it (the core checks ownership; the core
itself still accepts lease-less calls, for its own tests and tools in process). A lease id is
a capability: logs name a lease by its tag (common.credentials.lease_tag), never its id.

Who may call: only gateways (`METHOD_ROLES`; an operator's tools, pins for one, present the
gateway's credentials). Executors call nothing here: a Step then a Free with commits and no
Execute would fill a tenant's prefix cache with blocks no model computed.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Iterable
from typing import TypeAlias

import grpc
import structlog

from allocator_svc import convert, request_log
from allocator_svc.core.allocator import Allocator
from allocator_svc.core.pool import Pool
from allocator_svc.core.request import Request
from allocator_svc.core.validation import check_pool_config
from allocator_svc.pool_resets import ResetVerifier
from allocator_svc.recording import Recorder
from common.credentials import lease_tag
from common.errors import FailedPrecondition, InvalidArgument, NotFound
from common.sharding import shard_of
from pagedkv.allocator.v1 import allocator_pb2 as pb
from pagedkv.allocator.v1 import allocator_pb2_grpc

log = structlog.get_logger(__name__)
Ctx: TypeAlias = grpc.aio.ServicerContext

_SERVICE = pb.DESCRIPTOR.services_by_name["AllocatorService"]
# Every method, for gateways alone (common.auth.Access).
METHOD_ROLES: dict[str, frozenset[str]] = {
    m.name: frozenset({"gateway"}) for m in _SERVICE.methods}


class AllocatorServicer(allocator_pb2_grpc.AllocatorServiceServicer):
    def __init__(self, allocator: Allocator, reset_verifier: ResetVerifier | None = None,
                 shard_index: int = 0, num_shards: int = 1,
                 recorder: Recorder | None = None) -> None:
        self.allocator = allocator
        self.recorder = recorder  # --record-allocations (recording.py); None: off
        # None: a registration with a new instance id resets a live pool unconfirmed (tests).
        self.reset_verifier = reset_verifier
        self.shard_index, self.num_shards = shard_index, num_shards

    def _check_shard(self, pool_id: str, callers_num_shards: int) -> None:
        """A pool registered with two shards would have its blocks handed out twice."""
        if (callers_num_shards or 1) != self.num_shards:
            raise FailedPrecondition(
                f"the caller splits pools across {callers_num_shards or 1} allocator shard(s), "
                f"this allocator is shard {self.shard_index} of {self.num_shards}: give every "
                f"gateway the same shard list the allocators were started with"
            )
        owner = shard_of(pool_id, self.num_shards)
        if owner != self.shard_index:
            raise FailedPrecondition(
                f"pool {pool_id!r} belongs to allocator shard {owner} of {self.num_shards}, "
                f"this allocator is shard {self.shard_index}: list the allocator shards to "
                f"the gateway in shard order (--allocator-addr shard0,shard1,...)"
            )

    def _before_free(self, pool_id: str, request_ids: Iterable[str]) -> list[Request]:
        """The requests a Free or Abort names, for the recording (read after the call)."""
        if self.recorder is None:
            return []
        return self.recorder.before_free(self.allocator.pools, pool_id, request_ids)

    async def RegisterPool(
        self, request: pb.RegisterPoolRequest, context: Ctx
    ) -> pb.RegisterPoolResponse:
        # A pool's blocks live as long as the pool: frozen, the cyclic GC never rescans them
        # (the free queue links make them cyclic), which otherwise shows as p99 spikes. A
        # pool replaced on re-registration was frozen too, and its cycles would leak: thaw,
        # collect once (only when a pool is replaced), freeze again.
        self._check_shard(request.pool_id, request.num_shards)
        config = convert.pool_config(request)
        check_pool_config(config, self.allocator.limits)  # a bad shape is refused first
        previous = self.allocator.pools.get(request.pool_id)
        if (self.reset_verifier is not None and previous is not None
                and previous.config.executor_instance_id != request.executor_instance_id):
            await self.reset_verifier.verify(request.pool_id, request.executor_address,
                                             request.executor_instance_id)
            previous = self.allocator.pools.get(request.pool_id)  # (it may have changed)
        pool, reset = self.allocator.register_pool(config)
        if reset and previous is not None:
            _log_dropped_pins(previous, pool)
        created = pool is not previous
        replaced = created and previous is not None
        del previous  # the replaced pool must be garbage for the collection below
        if replaced:
            gc.disable()
            try:
                gc.unfreeze()
                gc.collect()
            finally:
                gc.freeze()
                gc.enable()
        elif created:  # nothing to reclaim: just freeze the new blocks
            gc.freeze()
        if created and self.recorder is not None:
            self.recorder.pool_registered(config, reset)
        log.info(
            "pool_registered",
            pool_id=request.pool_id,
            epoch=pool.epoch,
            num_blocks=request.num_blocks,
            block_size=request.block_size,
            reset=reset,
        )
        return pb.RegisterPoolResponse(pool=convert.pool_info(pool), reset=reset)

    async def DescribePool(
        self, request: pb.DescribePoolRequest, context: Ctx
    ) -> pb.DescribePoolResponse:
        return pb.DescribePoolResponse(pool=convert.pool_info(self.allocator.pool(request.pool_id)))

    async def Step(self, request: pb.StepRequest, context: Ctx) -> pb.StepResponse:
        _require_lease(request.lease_id, "Step")
        call = convert.step_call(request)
        recorder = self.recorder
        ending = (recorder.before_step(self.allocator.pools, request.pool_id, call)
                  if recorder else [])
        result = self.allocator.step(request.pool_id, request.epoch, request.lease_id or None,
                                     call)
        request_log.step_applied(request.pool_id, call, result)
        pool = self.allocator.pools[request.pool_id]
        if recorder is not None:
            recorder.step(pool, call, result, ending)
        return convert.step_response(result, pool.blocks.num_free, pool.block_size,
                                     self.allocator.tenant_service.prefill_weight)

    async def Free(self, request: pb.FreeRequest, context: Ctx) -> pb.FreeResponse:
        ending = self._before_free(request.pool_id, request.request_ids)
        pool = self.allocator.free(
            request.pool_id,
            request.epoch,
            convert.commits(request.commits),
            list(request.request_ids),
            _require_lease(request.lease_id, "Free"),
            request.commit_through_step_id,
        )
        request_log.freed(request.pool_id, request.request_ids)
        if self.recorder is not None:
            self.recorder.ended(request.pool_id, ending, aborted=False)
        return pb.FreeResponse(num_free_blocks=pool.blocks.num_free)

    async def Abort(self, request: pb.AbortRequest, context: Ctx) -> pb.AbortResponse:
        ending = self._before_free(request.pool_id, request.request_ids)
        pool = self.allocator.abort(
            request.pool_id, request.epoch, list(request.request_ids),
            _require_lease(request.lease_id, "Abort"),
        )
        request_log.aborted(request.pool_id, request.request_ids)
        if self.recorder is not None:
            self.recorder.ended(request.pool_id, ending, aborted=True)
        return pb.AbortResponse(num_free_blocks=pool.blocks.num_free)

    async def Fork(self, request: pb.ForkRequest, context: Ctx) -> pb.ForkResponse:
        children = self.allocator.fork(
            request.pool_id,
            request.epoch,
            request.parent_request_id,
            list(request.child_request_ids),
            _require_lease(request.lease_id, "Fork"),
        )
        request_log.forked(request.pool_id, request.parent_request_id,
                           list(request.child_request_ids))
        if self.recorder is not None:
            self.recorder.forked(request.pool_id, self.allocator.pools[request.pool_id]
                                 .requests[request.parent_request_id],
                                 list(request.child_request_ids))
        return pb.ForkResponse(child_tables=[convert.child_table(c) for c in children])

    async def SwapOut(self, request: pb.SwapOutRequest, context: Ctx) -> pb.SwapOutResponse:
        copies = self.allocator.swap_out(
            request.pool_id, request.epoch, request.request_id,
            _require_lease(request.lease_id, "SwapOut"),
        )
        request_log.swapped_out(request.pool_id, request.request_id, len(copies))
        if self.recorder is not None:
            self.recorder.swapped_out(request.pool_id, request.request_id)
        return pb.SwapOutResponse(swap_out=convert.swap_copies(copies))

    async def ReserveHandOff(
        self, request: pb.ReserveHandOffRequest, context: Ctx
    ) -> pb.ReserveHandOffResponse:
        call = convert.hand_off(request, _require_lease(request.lease_id, "ReserveHandOff"))
        reserved = self.allocator.reserve_hand_off(call)
        pool = self.allocator.pools[request.pool_id]
        request_log.handed_off(request.pool_id, reserved)
        if self.recorder is not None:
            self.recorder.handed_off(request.pool_id, reserved)
        return convert.hand_off_response(reserved, pool.blocks.num_free)

    async def MatchPrefix(
        self, request: pb.MatchPrefixRequest, context: Ctx
    ) -> pb.MatchPrefixResponse:
        matches = self.allocator.match_prefix(
            list(request.token_ids), request.cache_salt, list(request.pool_ids)
        )
        return pb.MatchPrefixResponse(
            matches=[
                pb.PrefixMatch(
                    pool_id=m.pool_id,
                    num_cached_tokens=m.num_cached_tokens,
                    num_free_blocks=m.num_free_blocks,
                    num_running_requests=m.num_running_requests,
                    num_cpu_cached_tokens=m.num_cpu_cached_tokens,
                )
                for m in matches
            ]
        )

    async def GetStats(self, request: pb.GetStatsRequest, context: Ctx) -> pb.GetStatsResponse:
        if request.pool_id:
            pools = [self.allocator.pool(request.pool_id)]
        else:
            if request.request_ids:
                raise InvalidArgument("request_ids need a pool_id")
            pools = list(self.allocator.pools.values())
        response = pb.GetStatsResponse(pools=[convert.pool_stats(p) for p in pools])
        for request_id in request.request_ids:
            found = pools[0].requests.get(request_id)
            if found is None:
                raise NotFound(f"unknown request {request_id!r} in pool {request.pool_id!r}")
            response.requests.append(convert.request_stats(pools[0], found))
        return response

    async def GetEvents(self, request: pb.GetEventsRequest, context: Ctx) -> pb.GetEventsResponse:
        pool = self.allocator.pool(request.pool_id)
        page = pool.events.after(request.after_seq, request.max_events or 1024,
                                 request.include_pin_events)
        return pb.GetEventsResponse(
            events=[convert.cache_event(e) for e in page.events],
            last_seq=page.last_seq,
            truncated=page.truncated,
        )

    async def GetSnapshot(
        self, request: pb.GetSnapshotRequest, context: Ctx
    ) -> pb.GetSnapshotResponse:
        pool = self.allocator.pool(request.pool_id)
        return pb.GetSnapshotResponse(
            seq=pool.events.last_seq,
            blocks=[
                pb.CachedBlock(block_hash=h, block_id=b.block_id)
                for h, b in pool.blocks.cached.items()
            ],
        )

    async def CreateLease(
        self, request: pb.CreateLeaseRequest, context: Ctx
    ) -> pb.CreateLeaseResponse:
        # create_lease frees the requests of leases that ran out (a client readmits them under
        # its new lease): done first here, so that they are logged.
        expired = self.allocator.expire_leases()
        request_log.expired(expired)
        if self.recorder is not None:
            self.recorder.expired(expired)
        lease = self.allocator.create_lease(request.ttl_ms / 1000 if request.ttl_ms else None)
        log.info("lease_created", lease=lease_tag(lease.lease_id), ttl_s=lease.ttl_s)
        return pb.CreateLeaseResponse(lease_id=lease.lease_id, ttl_ms=round(lease.ttl_s * 1000))

    async def KeepAlive(self, request: pb.KeepAliveRequest, context: Ctx) -> pb.KeepAliveResponse:
        lease = self.allocator.keep_alive(request.lease_id)
        return pb.KeepAliveResponse(ttl_ms=round(lease.ttl_s * 1000))

    # Pins: operator calls (internal credentials, like every call here), no lease.
    async def PinPrefix(self, request: pb.PinPrefixRequest, context: Ctx) -> pb.PinPrefixResponse:
        pin, created = self.allocator.pin_prefix(
            request.pool_id, list(request.token_ids), request.cache_salt, request.name
        )
        log.info("prefix_pinned", pool_id=pin.pool_id, pin_id=pin.pin_id, name=pin.name,
                 num_blocks=pin.num_blocks, num_pinned_blocks=pin.num_pinned_blocks,
                 created=created)
        return pb.PinPrefixResponse(pin=convert.pin_info(pin), created=created)

    async def UnpinPrefix(
        self, request: pb.UnpinPrefixRequest, context: Ctx
    ) -> pb.UnpinPrefixResponse:
        pin, num_released = self.allocator.unpin_prefix(request.pool_id, request.pin_id)
        log.info("prefix_unpinned", pool_id=pin.pool_id, pin_id=pin.pin_id, name=pin.name,
                 num_released_blocks=num_released)
        return pb.UnpinPrefixResponse(pin=convert.pin_info(pin),
                                      num_released_blocks=num_released)

    async def ListPins(self, request: pb.ListPinsRequest, context: Ctx) -> pb.ListPinsResponse:
        pins = self.allocator.list_pins(request.pool_id)
        table = self.allocator.pools[request.pool_id].pins
        return pb.ListPinsResponse(pins=[convert.pin_info(p) for p in pins],
                                   pin_budget_blocks=table.budget,
                                   num_budget_blocks_used=table.num_blocks)


def _require_lease(lease_id: str, method: str) -> str:
    if not lease_id:
        raise InvalidArgument(
            f"{method}: lease_id is required (CreateLease, then name it in every call that "
            "changes a request)"
        )
    return lease_id


def _log_dropped_pins(previous: Pool, pool: Pool) -> None:
    """A reset pool keeps its pins; the ones it cannot hold are dropped, and said so."""
    for pin_id, pin in previous.pins.pins.items():
        if pin_id not in pool.pins.pins:
            log.warning("pin_dropped_on_reset", pool_id=pool.config.pool_id, pin_id=pin_id,
                        name=pin.name, num_blocks=len(pin.block_hashes),
                        pin_budget_blocks=pool.pins.budget)


async def sweep_leases(allocator: Allocator, interval_s: float,
                       recorder: Recorder | None = None) -> None:
    """Free the requests of expired leases, forever (cancelled at shutdown)."""
    while True:
        await asyncio.sleep(interval_s)
        freed = allocator.expire_leases()
        if freed:
            log.warning("lease_expired_requests_freed", num_requests=len(freed))
            request_log.expired(freed)
            if recorder is not None:
                recorder.expired(freed)
