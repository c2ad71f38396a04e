"""Proto <-> core conversions: the only allocator module besides the servicer that sees pb2."""

from __future__ import annotations

from allocator_svc.core.events import CacheEvent, EventKind
from allocator_svc.core.hand_off import HandOff
from allocator_svc.core.hashing import hash_profile
from allocator_svc.core.pins import PinStatus
from allocator_svc.core.pool import Pool, PoolConfig
from allocator_svc.core.request import Grant, Request
from allocator_svc.core.step import StepResult
from common.errors import InvalidArgument
from common.step_records import BlockCopy, Commit, PreemptionMode, StepCall, StepItem
from pagedkv.allocator.v1 import allocator_pb2 as pb

_MODES: dict[int, PreemptionMode] = {
    pb.PREEMPTION_MODE_UNSPECIFIED: PreemptionMode.RECOMPUTE,
    pb.PREEMPTION_MODE_RECOMPUTE: PreemptionMode.RECOMPUTE,
    pb.PREEMPTION_MODE_SWAP: PreemptionMode.SWAP,
}
_MODE_TO_PB = {
    PreemptionMode.RECOMPUTE: pb.PREEMPTION_MODE_RECOMPUTE,
    PreemptionMode.SWAP: pb.PREEMPTION_MODE_SWAP,
}


def pool_config(msg: pb.RegisterPoolRequest) -> PoolConfig:
    return PoolConfig(
        msg.pool_id,
        msg.num_blocks,
        msg.block_size,
        msg.num_cpu_blocks,
        msg.model_fingerprint,
        msg.executor_instance_id,
        msg.enable_prefix_caching,
        msg.num_cpu_cache_blocks,
    )


def pool_info(pool: Pool) -> pb.PoolInfo:
    c = pool.config
    profile = hash_profile(c.block_size)
    return pb.PoolInfo(
        pool_id=c.pool_id,
        epoch=pool.epoch,
        num_blocks=c.num_blocks,
        block_size=c.block_size,
        num_cpu_blocks=c.num_cpu_blocks,
        model_fingerprint=c.model_fingerprint,
        executor_instance_id=c.executor_instance_id,
        enable_prefix_caching=c.enable_prefix_caching,
        num_cpu_cache_blocks=pool.cpu.capacity,
        hash_profile=pb.HashProfile(
            version=profile.version,
            algorithm=profile.algorithm,
            block_size=profile.block_size,
            encoding=profile.encoding,
        ),
    )


def preemption_mode(value: int) -> PreemptionMode:
    mode = _MODES.get(value)
    if mode is None:
        raise InvalidArgument(f"preemption_mode={value} is not a PreemptionMode value")
    return mode


def commits(msgs: list[pb.Commit]) -> list[Commit]:
    return [Commit(m.request_id, m.num_computed_tokens) for m in msgs]


def step_call(msg: pb.StepRequest) -> StepCall:
    """The call (its pool, epoch and lease are the request's own fields)."""
    return StepCall(
        items=step_items(msg),
        mode=preemption_mode(msg.preemption_mode),
        commits=commits(msg.commits),
        free_request_ids=list(msg.free_request_ids),
        abort_request_ids=list(msg.abort_request_ids),
        decode_request_ids=list(msg.decode_request_ids),
        append_request_ids=list(msg.append_request_ids),
        append_token_ids=list(msg.append_token_ids),
        step_id=msg.step_id,
        commit_through_step_id=msg.commit_through_step_id,
        waiting_tenants=list(msg.waiting_tenants),
        accept_request_ids=list(msg.accept_request_ids),
        accept_counts=list(msg.accept_counts),
    )


def step_items(msg: pb.StepRequest) -> list[StepItem]:
    """The general items, in priority order (after the decodes)."""
    items = []
    for m in msg.items:
        prompt = m.prompt_token_ids
        items.append(
            StepItem(
                m.request_id,
                m.num_tokens,
                tuple(prompt) if prompt else None,
                m.cache_salt,
                m.tenant,
                m.resumed,
                m.skip_prefix_lookup,
                m.priority,
                m.num_lookahead,
            )
        )
    return items


def _copies(copies: list[BlockCopy]) -> list[pb.BlockCopy]:
    return [pb.BlockCopy(src_block_id=c.src_block_id, dst_block_id=c.dst_block_id) for c in copies]


def _grant(grant: Grant) -> pb.Grant:
    return pb.Grant(
        request_id=grant.request_id,
        delta=pb.BlockTableDelta(start_index=grant.delta_start, block_ids=grant.block_ids),
        num_cached_tokens=grant.num_cached_tokens,
        num_scheduled_tokens=grant.num_scheduled,
        start_position=grant.start_position,
        new_request=grant.new_request,
        num_cpu_cached_tokens=grant.num_cpu_cached_tokens,
        num_lookahead=grant.num_lookahead,
    )


def _appends_one_block(grant: Grant, block_size: int) -> bool:
    """The grant appends one block at a block boundary and schedules one token."""
    return (
        len(grant.block_ids) == 1
        and grant.num_scheduled == 1
        and not grant.new_request
        and not grant.num_lookahead
        and grant.start_position == grant.delta_start * block_size
    )


def step_response(result: StepResult, num_free_blocks: int, block_size: int,
                  prefill_weight: float = 0.0) -> pb.StepResponse:
    # The decodes' appended blocks are already columns; general grants that only append a
    # block join them.
    appended_ids, appended_blocks = result.appended_request_ids, result.appended_block_ids
    others = result.grants
    if any(_appends_one_block(g, block_size) for g in others):
        appended_ids, appended_blocks = list(appended_ids), list(appended_blocks)
        kept = []
        for grant in others:
            if _appends_one_block(grant, block_size):
                appended_ids.append(grant.request_id)
                appended_blocks.append(grant.block_ids[0])
            else:
                kept.append(grant)
        others = kept
    response = pb.StepResponse(
        grants=[_grant(g) for g in others],
        appended_request_ids=appended_ids,
        appended_block_ids=appended_blocks,
        preempted=[
            pb.Preemption(request_id=p.request_id, mode=_MODE_TO_PB[p.mode])
            for p in result.preempted
        ],
        deferred_request_ids=result.deferred,
        copies=_copies(result.copies),
        swap_out=_copies(result.swap_out),
        swap_in=_copies(result.swap_in),
        num_free_blocks=num_free_blocks,
    )
    if result.tenant_service is not None:
        response.tenant_service.extend(pb.TenantService(tenant=t, service=s)
                                       for t, s in result.tenant_service.items())
        response.prefill_weight = prefill_weight
    return response


def swap_copies(copies: list[BlockCopy]) -> list[pb.BlockCopy]:
    return _copies(copies)


def child_table(child: Request) -> pb.BlockTableDelta:
    return pb.BlockTableDelta(start_index=0, block_ids=[b.block_id for b in child.blocks])


def hand_off(msg: pb.ReserveHandOffRequest, lease_id: str) -> HandOff:
    return HandOff(
        msg.pool_id,
        msg.epoch,
        lease_id,
        msg.request_id,
        list(msg.token_ids),
        msg.num_prompt_tokens,
        msg.cache_salt,
        msg.tenant,
        msg.source_model_fingerprint,
        msg.source_block_size,
        msg.source_pool_id,
        msg.priority,
    )


def hand_off_response(request: Request, num_free_blocks: int) -> pb.ReserveHandOffResponse:
    return pb.ReserveHandOffResponse(
        table=child_table(request),  # start_index 0: the whole table
        num_cached_tokens=request.num_cached_tokens,
        num_free_blocks=num_free_blocks,
    )


def pool_stats(pool: Pool) -> pb.PoolStats:
    blocks = pool.blocks
    num_free = blocks.num_free
    return pb.PoolStats(
        pool_id=pool.config.pool_id,
        epoch=pool.epoch,
        num_blocks=pool.config.num_blocks,
        num_free_blocks=num_free,
        num_cached_free_blocks=blocks.num_cached_free,
        num_used_blocks=pool.config.num_blocks - num_free,
        num_cached_blocks=len(blocks.cached),
        num_requests=len(pool.requests),
        num_swapped_requests=sum(1 for r in pool.requests.values() if r.swapped),
        num_free_cpu_blocks=len(pool.free_cpu_block_ids),
        num_prefix_queries=pool.num_prefix_queries,
        num_prefix_hits=pool.num_prefix_hits,
        num_resumed_prefix_queries=pool.num_resumed_prefix_queries,
        num_resumed_prefix_hits=pool.num_resumed_prefix_hits,
        num_evictions=blocks.num_evictions,
        num_preemptions=pool.num_preemptions,
        event_seq=pool.events.last_seq,
        num_pinned_blocks=blocks.num_pinned,
        num_pins=len(pool.pins.pins),
        num_cpu_cache_blocks=pool.cpu.capacity,
        num_cpu_cached_blocks=len(pool.cpu.entries),
        num_prefix_cpu_hits=pool.num_prefix_cpu_hits,
        num_cpu_cache_stores=pool.cpu.num_kept,
        num_cpu_cache_loads=pool.cpu.num_loaded,
        num_swap_outs=pool.num_swap_outs,
        num_swap_ins=pool.num_swap_ins,
        num_swapped_out_blocks=pool.num_swapped_out_blocks,
        num_swapped_in_blocks=pool.num_swapped_in_blocks,
    )


def request_stats(pool: Pool, request: Request) -> pb.RequestStats:
    written = pool.blocks_for(request.num_computed) - request.num_cached_tokens // pool.block_size
    return pb.RequestStats(
        request_id=request.request_id,
        num_tokens=max(len(request.token_ids), request.num_computed),
        num_computed_tokens=request.num_computed,
        num_cached_tokens=request.num_cached_tokens,
        num_blocks=len(request.blocks) or len(request.cpu_block_ids or ()),
        num_blocks_written=written,
        num_preemptions=request.num_preemptions,
        block_ids=[b.block_id for b in request.blocks],
    )


def cache_event(event: CacheEvent) -> pb.CacheEvent:
    if event.kind is EventKind.STORED:
        return pb.CacheEvent(
            seq=event.seq,
            stored=pb.BlockStored(
                block_hash=event.block_hash,
                parent_block_hash=event.parent_hash or b"",
                block_id=event.block_id,
                token_ids=event.token_ids,
            ),
        )
    if event.kind is EventKind.PINNED:
        return pb.CacheEvent(
            seq=event.seq,
            pinned=pb.BlockPinned(block_hash=event.block_hash, block_id=event.block_id),
        )
    if event.kind is EventKind.UNPINNED:
        return pb.CacheEvent(
            seq=event.seq,
            unpinned=pb.BlockUnpinned(block_hash=event.block_hash, block_id=event.block_id),
        )
    return pb.CacheEvent(
        seq=event.seq, removed=pb.BlockRemoved(block_hash=event.block_hash, block_id=event.block_id)
    )


def pin_info(pin: PinStatus) -> pb.PinInfo:
    return pb.PinInfo(
        pin_id=pin.pin_id,
        name=pin.name,
        pool_id=pin.pool_id,
        num_blocks=pin.num_blocks,
        num_pinned_blocks=pin.num_pinned_blocks,
        num_pending_blocks=pin.num_pending_blocks,
        num_tokens=pin.num_tokens,
    )
