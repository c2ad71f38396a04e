"""Pipelined steps: the gateway sends step N+1's Step while step N's batch executes, so the
allocator's round trip leaves the critical path.

Decode slots depend on how many tokens a request holds, not on their values. A pending decode
grants a slot to a token still being sampled: the request's token list ends with a PENDING
placeholder until a later call brings the value (a late token). A request holds at most one,
is not scheduled again until it is filled, and no commit reaches past it. The commit rule is
kept by `previous_in_flight`: the steps it covers are committed one call later (scheduled_steps.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from allocator_svc.core.request import PENDING, Request
from allocator_svc.core.step import Decodes, StepItem
from allocator_svc.core.validation import (
    check_late_tokens,
    check_not_pending,
    check_pending_decodes,
)

if TYPE_CHECKING:
    from collections.abc import Set as AbstractSet

    from allocator_svc.core.pool import Pool


@dataclass(slots=True)
class Pipelined:
    """A Step's pipelining fields (StepRequest fields 13-16)."""

    previous_in_flight: bool = False
    late: Decodes = field(default_factory=lambda: Decodes([], []))  # values of pending tokens
    pending_decode_ids: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(
            self.previous_in_flight
            or self.late.request_ids
            or self.late.token_ids
            or self.pending_decode_ids
        )


def check_pipelined(
    pool: Pool,
    pipeline: Pipelined,
    decodes: Decodes | None,
    decode_requests: list[Request],
    items: list[StepItem],
    released: AbstractSet[str],
    lease_id: str | None,
) -> tuple[list[Request], Decodes | None, list[Request]]:
    """Validate the pipelining fields against the rest of the call. Returns the late tokens'
    requests, and the decodes and their requests with the pending decodes appended (their
    token: PENDING)."""
    late = pipeline.late
    late_requests = (
        check_late_tokens(pool, late, lease_id) if late.request_ids or late.token_ids else []
    )
    filled = set(late.request_ids)
    value_ids = decodes.request_ids if decodes is not None else []
    others = scheduled_ids(decodes, items)
    if pool.pending and others:
        # (A request freed in this call may be admitted again: its pending token goes too.)
        check_not_pending(pool, others, filled | released)
    ids = pipeline.pending_decode_ids
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
