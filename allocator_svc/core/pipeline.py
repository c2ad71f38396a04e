"""Pending tokens: a Step sent while the caller's previous batch executes grants slots to
the tokens that batch is sampling, before their values exist.

Decode slots depend on how many tokens a request holds, not on their values. A pending decode
grants a slot to a token still being sampled: the request's token list ends with a PENDING
placeholder until a later call brings the value (a late token). A request holds at most one,
is not scheduled again until it is filled, and no commit reaches past it.
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet

from allocator_svc.core.pool import Pool
from allocator_svc.core.request import PENDING, Request
from allocator_svc.core.step import Decodes, StepCall, StepItem
from allocator_svc.core.validation import (
    check_late_tokens,
    check_not_pending,
    check_pending_decodes,
)


def check_pending(
    pool: Pool,
    call: StepCall,
    decode_requests: list[Request],
    released: AbstractSet[str],
) -> tuple[list[Request], Decodes | None, list[Request]]:
    """Validate the call's late tokens and pending decodes against the rest of it. Returns the
    late tokens' requests, and the decodes and their requests with the pending decodes
    appended (their token: PENDING)."""
    late, decodes, lease_id = call.late, call.decodes, call.lease_id
    late_requests = (
        check_late_tokens(pool, late, lease_id)
        if late is not None and (late.request_ids or late.token_ids) else []
    )
    filled = set(late.request_ids) if late is not None else set()
    value_ids = decodes.request_ids if decodes is not None else []
    others = scheduled_ids(decodes, call.items)
    if pool.pending and others:
        # (A request freed in this call may be admitted again: its pending token goes too.)
        check_not_pending(pool, others, filled | released)
    ids = call.pending_decode_ids
    if not ids:
        return late_requests, decodes, decode_requests
    pending_requests = check_pending_decodes(pool, ids, others, released, filled, lease_id)
    tokens = decodes.token_ids if decodes is not None else []
    combined = Decodes([*value_ids, *ids], [*tokens, *([PENDING] * len(ids))])
    return late_requests, combined, decode_requests + pending_requests


def scheduled_ids(decodes: Decodes | None, items: list[StepItem]) -> list[str]:
    """The ids a call schedules with a known value: its decodes', then its items'."""
    ids = list(decodes.request_ids) if decodes is not None else []
    ids.extend(item.request_id for item in items)
    return ids
