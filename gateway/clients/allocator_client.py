"""The allocator, seen from the gateway: typed calls over the generated stub.

The only gateway module besides executor_client.py and service.py that touches protobuf.
Calls that concern one request carry its id as `x-request-id` metadata, so that one id can
be followed through the logs of all three services. A failed call raises its
call_failures.CallFailed, never a gRPC error.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from common.channel import InternalChannel
from common.credentials import InternalAuth
from common.step_records import BlockCopy, Commit, PreemptionMode, StepCall
from gateway.clients.call_failures import translated
from gateway.core.step import Grant, Preemption, StepOutcome, TableDelta
from pagedkv.allocator.v1 import allocator_pb2 as pb
from pagedkv.allocator.v1 import allocator_pb2_grpc as pb_grpc


@dataclass(frozen=True, slots=True)
class PoolSpec:
    pool_id: str
    num_blocks: int
    block_size: int
    num_cpu_blocks: int
    model_fingerprint: str
    executor_instance_id: str
    enable_prefix_caching: bool
    executor_address: str = ""  # where the allocator may confirm the instance id
    num_shards: int = 1  # the allocator shards this gateway splits pools across
    num_cpu_cache_blocks: int = 0  # the executor's CPU tier (of num_cpu_blocks)


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    pool_id: str
    num_cached_tokens: int
    num_free_blocks: int
    num_running_requests: int


@dataclass(frozen=True, slots=True)
class HandOffReservation:
    """A request reserved in the target pool for a KV hand-off (ReserveHandOff)."""

    block_ids: tuple[int, ...]  # its whole table
    num_cached_tokens: int  # leading tokens the pool had cached: their KV is not moved
    num_free_blocks: int  # the pool's, once reserved


@dataclass(frozen=True, slots=True)
class CacheEvent:
    """A pool's BlockStored (`stored`) or BlockRemoved, as a prefix index needs it."""

    seq: int
    stored: bool
    block_hash: bytes
    block_id: int


@dataclass(frozen=True, slots=True)
class EventPage:
    events: tuple[CacheEvent, ...]
    last_seq: int  # the newest event the pool has produced
    truncated: bool  # events after the cursor were dropped: take a snapshot


@dataclass(frozen=True, slots=True)
class CachedBlock:
    block_hash: bytes
    block_id: int


@dataclass(frozen=True, slots=True)
class CacheSnapshot:
    seq: int  # it reflects every event up to this one: follow on from here
    blocks: tuple[CachedBlock, ...]


def _event(event: pb.CacheEvent) -> CacheEvent:
    if event.WhichOneof("event") == "stored":
        return CacheEvent(event.seq, True, event.stored.block_hash, event.stored.block_id)
    return CacheEvent(event.seq, False, event.removed.block_hash, event.removed.block_id)


def _copies(copies: Sequence[pb.BlockCopy]) -> tuple[BlockCopy, ...]:
    return tuple(BlockCopy(c.src_block_id, c.dst_block_id) for c in copies)


def _commits(commits: Sequence[Commit]) -> list[pb.Commit]:
    return [
        pb.Commit(request_id=c.request_id, num_computed_tokens=c.num_computed_tokens)
        for c in commits
    ]


def _outcome(response: pb.StepResponse) -> StepOutcome:
    grants = {
        g.request_id: Grant(
            request_id=g.request_id,
            delta=(
                TableDelta(g.delta.start_index, tuple(g.delta.block_ids))
                if g.HasField("delta")
                else None
            ),
            num_cached_tokens=g.num_cached_tokens,
            num_scheduled_tokens=g.num_scheduled_tokens,
            start_position=g.start_position,
            num_lookahead=g.num_lookahead,
        )
        for g in response.grants
    }
    return StepOutcome(
        grants=grants,
        preempted=tuple(
            Preemption(p.request_id, swapped=p.mode == pb.PREEMPTION_MODE_SWAP)
            for p in response.preempted
        ),
        deferred_request_ids=frozenset(response.deferred_request_ids),
        copies=_copies(response.copies),
        swap_out=_copies(response.swap_out),
        swap_in=_copies(response.swap_in),
        appended=dict(
            zip(response.appended_request_ids, response.appended_block_ids, strict=True)
        ),
        num_free_blocks=response.num_free_blocks,
        tenant_service={t.tenant: t.service for t in response.tenant_service},
        prefill_weight=response.prefill_weight,
    )


class AllocatorClient(InternalChannel):
    """Every call carries a deadline of `timeout_s` seconds: a hung allocator must not hang
    the gateway (None: no deadline)."""

    def __init__(
        self, address: str, timeout_s: float | None = None, auth: InternalAuth | None = None
    ) -> None:
        super().__init__(address, auth)
        self.timeout_s = timeout_s
        self.stub = pb_grpc.AllocatorServiceStub(self.channel)

    async def register_pool(self, spec: PoolSpec) -> int:
        """Register (or re-register) an executor's pool; returns the epoch to send."""
        with translated():
            response = await self.stub.RegisterPool(
                pb.RegisterPoolRequest(
                    pool_id=spec.pool_id,
                    num_blocks=spec.num_blocks,
                    block_size=spec.block_size,
                    num_cpu_blocks=spec.num_cpu_blocks,
                    model_fingerprint=spec.model_fingerprint,
                    executor_instance_id=spec.executor_instance_id,
                    enable_prefix_caching=spec.enable_prefix_caching,
                    executor_address=spec.executor_address,
                    num_shards=spec.num_shards,
                    num_cpu_cache_blocks=spec.num_cpu_cache_blocks,
                ),
                metadata=self.auth_metadata,
                timeout=self.timeout_s,
            )
        return int(response.pool.epoch)

    async def create_lease(self, ttl_ms: int) -> tuple[str, int]:
        with translated():
            response = await self.stub.CreateLease(
                pb.CreateLeaseRequest(ttl_ms=ttl_ms), metadata=self.auth_metadata,
                timeout=self.timeout_s,
            )
        return response.lease_id, response.ttl_ms

    async def keep_alive(self, lease_id: str) -> None:
        with translated():
            await self.stub.KeepAlive(
                pb.KeepAliveRequest(lease_id=lease_id), metadata=self.auth_metadata,
                timeout=self.timeout_s,
            )

    async def step(self, pool_id: str, epoch: int, lease_id: str, call: StepCall) -> StepOutcome:
        items = [
            pb.StepItem(
                request_id=i.request_id,
                prompt_token_ids=i.prompt_token_ids,
                cache_salt=i.cache_salt,
                tenant=i.tenant,
                num_tokens=i.num_tokens,
                resumed=i.resumed,
                skip_prefix_lookup=i.skip_prefix_lookup,
                priority=i.priority,
            )
            if i.is_new
            else pb.StepItem(request_id=i.request_id, num_tokens=i.num_tokens,
                             num_lookahead=i.num_lookahead)
            for i in call.items
        ]
        request = pb.StepRequest(
            pool_id=pool_id,
            epoch=epoch,
            lease_id=lease_id,
            commits=_commits(call.commits),
            free_request_ids=call.free_request_ids,
            abort_request_ids=call.abort_request_ids,
            items=items,
            preemption_mode=(
                pb.PREEMPTION_MODE_SWAP if call.mode is PreemptionMode.SWAP
                else pb.PREEMPTION_MODE_RECOMPUTE
            ),
            decode_request_ids=call.decode_request_ids,
            append_request_ids=call.append_request_ids,
            append_token_ids=call.append_token_ids,
            step_id=call.step_id,
            commit_through_step_id=call.commit_through_step_id,
            waiting_tenants=call.waiting_tenants,
            accept_request_ids=call.accept_request_ids,
            accept_counts=call.accept_counts,
        )
        # NOTE: Step is not idempotent; past the deadline its outcome is unknown (recovery.py).
        with translated():
            return _outcome(await self.stub.Step(request, metadata=self.auth_metadata,
                                                 timeout=self.timeout_s))

    # lease_id on Free, Abort, Fork and ReserveHandOff: the allocator refuses
    # (PERMISSION_DENIED) to touch a request of another lease, e.g. another gateway's request
    # that happens to share an id.
    async def free(
        self,
        pool_id: str,
        epoch: int,
        commits: Sequence[Commit],
        request_ids: Sequence[str],
        lease_id: str,
        commit_through_step_id: int = 0,
    ) -> int:
        """The pool's free blocks once applied."""
        with translated():
            response = await self.stub.Free(
                pb.FreeRequest(
                    pool_id=pool_id,
                    epoch=epoch,
                    commits=_commits(commits),
                    request_ids=request_ids,
                    lease_id=lease_id,
                    commit_through_step_id=commit_through_step_id,
                ),
                metadata=self._about(request_ids),
                timeout=self.timeout_s,
            )
        return int(response.num_free_blocks)

    async def abort(
        self, pool_id: str, epoch: int, request_ids: Sequence[str], lease_id: str
    ) -> int:
        """The pool's free blocks once applied."""
        with translated():
            response = await self.stub.Abort(
                pb.AbortRequest(
                    pool_id=pool_id, epoch=epoch, request_ids=request_ids, lease_id=lease_id
                ),
                metadata=self._about(request_ids),
                timeout=self.timeout_s,
            )
        return int(response.num_free_blocks)

    async def fork(
        self,
        pool_id: str,
        epoch: int,
        parent_id: str,
        child_ids: Sequence[str],
        request_id: str,
        lease_id: str,
    ) -> list[TableDelta]:
        with translated():
            response = await self.stub.Fork(
                pb.ForkRequest(
                    pool_id=pool_id,
                    epoch=epoch,
                    parent_request_id=parent_id,
                    child_request_ids=child_ids,
                    lease_id=lease_id,
                ),
                metadata=self._about([request_id]),
                timeout=self.timeout_s,
            )
        return [TableDelta(t.start_index, tuple(t.block_ids)) for t in response.child_tables]

    async def reserve_hand_off(
        self,
        pool_id: str,
        epoch: int,
        request_id: str,
        token_ids: Sequence[int],
        num_prompt_tokens: int,
        cache_salt: str,
        tenant: str,
        source_model_fingerprint: str,
        source_block_size: int,
        source_pool_id: str,
        client_request_id: str,
        lease_id: str,
        priority: int = 0,
    ) -> HandOffReservation:
        """Reserve `request_id` (its KV, of `token_ids`, held by the source's executor) in
        the target pool `pool_id`, joining `lease_id`. Commit it once the KV has moved, or
        abort it. Not idempotent: a second call for the id is ALREADY_EXISTS."""
        with translated():
            response = await self.stub.ReserveHandOff(
                pb.ReserveHandOffRequest(
                    pool_id=pool_id,
                    epoch=epoch,
                    lease_id=lease_id,
                    request_id=request_id,
                    token_ids=token_ids,
                    num_prompt_tokens=num_prompt_tokens,
                    cache_salt=cache_salt,
                    tenant=tenant,
                    source_model_fingerprint=source_model_fingerprint,
                    source_block_size=source_block_size,
                    source_pool_id=source_pool_id,
                    priority=priority,
                ),
                metadata=self._about([client_request_id]),
                timeout=self.timeout_s,
            )
        return HandOffReservation(tuple(response.table.block_ids), response.num_cached_tokens,
                                  response.num_free_blocks)

    async def match_prefix(
        self,
        token_ids: Sequence[int],
        cache_salt: str,
        pool_ids: Sequence[str],
        request_id: str,
    ) -> list[PrefixMatch]:
        with translated():
            response = await self.stub.MatchPrefix(
                pb.MatchPrefixRequest(
                    token_ids=token_ids, cache_salt=cache_salt, pool_ids=pool_ids
                ),
                metadata=self._about([request_id]),
                timeout=self.timeout_s,
            )
        return [
            PrefixMatch(m.pool_id, m.num_cached_tokens, m.num_free_blocks, m.num_running_requests)
            for m in response.matches
        ]

    async def get_events(self, pool_id: str, after_seq: int, max_events: int) -> EventPage:
        """The pool's cache events after `after_seq`, oldest first, at most `max_events`."""
        with translated():
            response = await self.stub.GetEvents(
                pb.GetEventsRequest(pool_id=pool_id, after_seq=after_seq, max_events=max_events),
                metadata=self.auth_metadata,
                timeout=self.timeout_s,
            )
        return EventPage(tuple(_event(e) for e in response.events), response.last_seq,
                         response.truncated)

    async def get_snapshot(self, pool_id: str) -> CacheSnapshot:
        """Every block the pool's prefix cache holds, and the event it is current to."""
        with translated():
            response = await self.stub.GetSnapshot(
                pb.GetSnapshotRequest(pool_id=pool_id), metadata=self.auth_metadata,
                timeout=self.timeout_s,
            )
        return CacheSnapshot(
            response.seq, tuple(CachedBlock(b.block_hash, b.block_id) for b in response.blocks)
        )
