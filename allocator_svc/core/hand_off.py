"""A KV hand-off's reservation (ReserveHandOff): the target pool takes a request whose KV
another pool's executor holds, as if admitted with every one of its tokens computed.

Its longest cached prefix of full blocks is shared (touched), fresh blocks hold the rest, so
the table covers every token. Only that prefix is committed: the rest enters the prefix cache
through a later commit, once the caller has moved the KV (the commit rule); an Abort undoes
the reservation and caches nothing. Then the request runs as any other. Unlike an admission:

- every full block may hit: all of its tokens are computed, none is left to sample from;
- only the device is looked in: a CPU-tier hit needs a swap-in, which no step carries here.
  For the same reason the cached blocks its fresh blocks evict are dropped, not offered to
  the CPU tier (their copy out would have no step to run in);
- it never preempts, nor waits: short of blocks, or over its tenant's block quota, it is
  refused (RESOURCE_EXHAUSTED) and nothing changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

from allocator_svc.core.free_queue import Block
from allocator_svc.core.limits import Limits
from allocator_svc.core.pool import Pool
from allocator_svc.core.request import Request
from allocator_svc.core.step import TenantQuota
from allocator_svc.core.validation import check_length, check_token_ids
from common.errors import AlreadyExists, FailedPrecondition, InvalidArgument, ResourceExhausted


@dataclass(frozen=True, slots=True)
class HandOff:
    """One ReserveHandOff call."""

    pool_id: str  # the target pool
    epoch: int
    lease_id: str | None  # the request joins it (None: in-process callers without leases)
    request_id: str
    token_ids: list[int]  # prompt + generated tokens whose KV the source holds
    num_prompt_tokens: int  # of token_ids
    cache_salt: str
    tenant: str  # whose block quota the request counts against ("": none)
    # The source's, as its executor describes them: checked here, so no shard is asked.
    source_model_fingerprint: str
    source_block_size: int
    source_pool_id: str = ""  # checked too when this allocator holds it
    priority: int = 0  # its level (StepItem.priority)


def check_hand_off(pool: Pool, call: HandOff, source: Pool | None, limits: Limits) -> None:
    """The call's arguments, whether the source's KV fits this pool, the request id, and
    the pool's and the tenant's room (raises; nothing is changed)."""
    if not call.request_id:
        raise InvalidArgument("request_id is required: the id the request runs under here")
    check_length("request_id", call.request_id, limits.max_id_chars)
    check_length("cache_salt", call.cache_salt, limits.max_salt_chars)
    check_length("tenant", call.tenant, limits.max_id_chars)
    check_length("source_model_fingerprint", call.source_model_fingerprint, limits.max_id_chars)
    check_length("source_pool_id", call.source_pool_id, limits.max_id_chars)
    if not call.token_ids:
        raise InvalidArgument(
            f"{call.request_id}: token_ids is empty: a hand-off names every token whose KV "
            "the source holds"
        )
    check_token_ids(call.request_id, call.token_ids)
    if call.num_prompt_tokens > len(call.token_ids):
        raise InvalidArgument(
            f"{call.request_id}: num_prompt_tokens={call.num_prompt_tokens} is more than its "
            f"{len(call.token_ids)} token_ids (the prompt is their first part)"
        )
    if not call.source_block_size:
        raise InvalidArgument(
            "source_block_size is required: the block size the source executor describes"
        )
    if call.source_pool_id == call.pool_id:
        raise InvalidArgument(
            f"pool {call.pool_id!r} is both the source and the target: a hand-off moves a "
            "request to another pool"
        )
    _check_layout(pool, "the source", call.source_model_fingerprint, call.source_block_size)
    if source is not None:
        _check_layout(pool, f"source pool {call.source_pool_id!r}",
                      source.config.model_fingerprint, source.block_size)
    if call.request_id in pool.requests:
        raise AlreadyExists(
            f"request {call.request_id!r} is already in pool {call.pool_id!r}: a reservation "
            "is made once (Abort it to start over)"
        )
    needed = pool.blocks_for(len(call.token_ids))
    if needed > pool.config.num_blocks:
        raise ResourceExhausted(
            f"request {call.request_id!r} needs {needed} blocks; pool {call.pool_id!r} has "
            f"{pool.config.num_blocks} in all"
        )
    if limits.max_blocks_per_tenant and call.tenant:
        _check_quota(pool, call, needed, limits.max_blocks_per_tenant)


def _check_layout(pool: Pool, whose: str, fingerprint: str, block_size: int) -> None:
    """KV moves block for block only between executors of one model and block size."""
    config = pool.config
    if fingerprint != config.model_fingerprint:
        raise FailedPrecondition(
            f"{whose} has model fingerprint {fingerprint!r}, target pool {config.pool_id!r} "
            f"has {config.model_fingerprint!r}: KV is handed off only between executors of "
            "one model"
        )
    if block_size != config.block_size:
        raise FailedPrecondition(
            f"{whose} has block size {block_size}, target pool {config.pool_id!r} has "
            f"{config.block_size}: KV is handed off only between pools of one block size"
        )


def _check_quota(pool: Pool, call: HandOff, needed: int, limit: int) -> None:
    """As at admission (step.py TenantQuota), but refused rather than deferred: a
    reservation does not wait in a queue."""
    quota = TenantQuota(pool, limit)
    if not quota.fits(call.tenant, needed):
        raise ResourceExhausted(
            f"tenant {call.tenant!r} holds {quota.held_by(call.tenant)} blocks of pool "
            f"{call.pool_id!r}; the hand-off of {call.request_id!r} needs {needed} more, over "
            f"the quota of {limit} (--max-blocks-per-tenant): retry once its requests finish"
        )


def reserve(pool: Pool, call: HandOff) -> Request | None:
    """Reserve the validated call's request in `pool`; None (nothing changed) when the pool
    has too few free blocks."""
    tokens = list(call.token_ids)
    root = pool.root(call.cache_salt)
    found, hashes = pool.match_prefix(root, tokens, hand_off=True)
    hits = cast(list[Block], found)  # a hand-off's lookup finds device blocks only
    num_new = pool.blocks_for(len(tokens)) - len(hits)
    num_revived = sum(1 for block in hits if block.ref_count == 0)
    if num_new + num_revived > pool.blocks.num_free:
        return None
    pool.blocks.touch(hits)  # first: the allocation below must not evict them
    fresh = pool.blocks.allocate(num_new, to_tier=False)
    assert fresh is not None, "reserve checked the free count"
    num_cached = len(hits) * pool.block_size
    request = Request(
        call.request_id, call.lease_id, root, tokens, call.num_prompt_tokens,
        num_computed=len(tokens), num_committed=num_cached, blocks=hits + fresh,
        block_hashes=hashes, num_cached_tokens=num_cached, tenant=call.tenant,
        priority=call.priority, num_charged=len(tokens),  # computed (and charged) elsewhere
    )
    pool.requests[call.request_id] = request
    pool.num_hand_offs += 1
    pool.num_hand_off_tokens += len(tokens)
    pool.num_hand_off_cached_tokens += num_cached
    return request
