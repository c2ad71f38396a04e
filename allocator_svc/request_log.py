"""Log lines about individual requests, each naming it: `seq_id` (the id on the wire) and
`request_id` (the client's part of it: common.interceptor.client_request_id).

A Step carries a whole batch and binds no one request's id, so these lines name theirs.
Lifecycle events that are rare (preempted, swapped, aborted, forked, handed off, expired) are
INFO; the ones every request has, and per-step detail (admitted, blocks allocated, deferred,
freed), are DEBUG and cost nothing unless debug logging is on: the level is checked once per
call, not per request. No line is logged per token.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import structlog

from allocator_svc.core.request import Request
from allocator_svc.core.step import StepResult
from common.interceptor import client_request_id
from common.step_records import StepCall

log = structlog.get_logger("allocator_svc.requests")


def _ids(seq_id: str) -> dict[str, str]:
    return {"seq_id": seq_id, "request_id": client_request_id(seq_id)}


def debug_enabled() -> bool:
    return bool(log.is_enabled_for(logging.DEBUG))


def step_applied(pool_id: str, call: StepCall, result: StepResult) -> None:
    """What one Step did to its requests."""
    for seq_id in call.abort_request_ids:
        log.info("request_aborted", pool_id=pool_id, **_ids(seq_id))
    for preemption in result.preempted:
        log.info("request_preempted", pool_id=pool_id, mode=preemption.mode.value,
                 **_ids(preemption.request_id))
    for seq_id in result.swapped_in:
        log.info("request_swapped_in", pool_id=pool_id, **_ids(seq_id))
    if not debug_enabled():
        return
    for seq_id in call.free_request_ids:
        log.debug("request_freed", pool_id=pool_id, **_ids(seq_id))
    for grant in result.grants:
        if grant.new_request:
            log.debug("request_admitted", pool_id=pool_id,
                      num_cached_tokens=grant.num_cached_tokens,
                      num_cpu_cached_tokens=grant.num_cpu_cached_tokens,
                      num_scheduled_tokens=grant.num_scheduled, block_ids=grant.block_ids,
                      **_ids(grant.request_id))
        elif grant.block_ids:
            log.debug("blocks_allocated", pool_id=pool_id, start_index=grant.delta_start,
                      block_ids=grant.block_ids, **_ids(grant.request_id))
    for seq_id, block_id, index in zip(result.appended_request_ids, result.appended_block_ids,
                                       result.appended_indexes, strict=True):
        log.debug("blocks_allocated", pool_id=pool_id, start_index=index, block_ids=[block_id],
                  **_ids(seq_id))
    if result.deferred:  # every step while they wait: one line, not one per request
        log.debug("requests_deferred", pool_id=pool_id, seq_ids=result.deferred)


def freed(pool_id: str, seq_ids: Iterable[str]) -> None:
    if debug_enabled():
        for seq_id in seq_ids:
            log.debug("request_freed", pool_id=pool_id, **_ids(seq_id))


def aborted(pool_id: str, seq_ids: Iterable[str]) -> None:
    for seq_id in seq_ids:
        log.info("request_aborted", pool_id=pool_id, **_ids(seq_id))


def forked(pool_id: str, parent_id: str, child_ids: list[str]) -> None:
    log.info("request_forked", pool_id=pool_id, child_seq_ids=child_ids, **_ids(parent_id))


def handed_off(pool_id: str, request: Request) -> None:
    log.info("request_handed_off", pool_id=pool_id, num_tokens=len(request.token_ids),
             num_cached_tokens=request.num_cached_tokens,
             block_ids=[b.block_id for b in request.blocks], **_ids(request.request_id))


def swapped_out(pool_id: str, seq_id: str, num_blocks: int) -> None:
    log.info("request_swapped_out", pool_id=pool_id, num_blocks=num_blocks, **_ids(seq_id))


def expired(seq_ids: Iterable[str]) -> None:
    for seq_id in seq_ids:
        log.info("request_expired", **_ids(seq_id))
