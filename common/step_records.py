"""The records a step's calls carry between the services, declared once: the gateway's
scheduler plans them (gateway/core/scheduler.py), the allocator core applies them, the
executor copies blocks by them. Each side's codec (gateway/clients/allocator_client.py,
allocator_svc/convert.py) turns them into its proto's messages of the same fields."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum


class PreemptionMode(Enum):
    """What a step does to the requests it pushes out when the pool is short."""

    RECOMPUTE = "recompute"  # free everything; the gateway readmits with prompt + output
    SWAP = "swap"  # move the blocks to CPU; falls back to recompute without swap space


# Tenants one Step may name waiting (StepCall.waiting_tenants): a gateway names its first
# this many, and the allocator refuses more.
MAX_WAITING_TENANTS = 256
# Draft tokens one running request may verify in a step (speculative decoding): the slots a
# StepItem asks for beyond its tokens (num_lookahead), and an executor's num_draft_tokens.
MAX_LOOKAHEAD_TOKENS = 16


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """Copy one block's KV (copy-on-write, swap out, swap in, a CPU-tier hit)."""

    src_block_id: int
    dst_block_id: int


@dataclass(frozen=True, slots=True)
class Commit:
    """KV for tokens [0, num_computed_tokens) of the request is written (the commit rule):
    its full blocks may be hashed and shared."""

    request_id: str
    num_computed_tokens: int


@dataclass(frozen=True, slots=True)
class StepItem:
    """One request's part of a Step, past the decode column: `num_tokens` more to compute
    beyond what is computed (or cached). A request new to the allocator (admitted, or again
    after a recompute preemption) carries its prompt; the others carry none."""

    request_id: str
    num_tokens: int
    prompt_token_ids: Sequence[int] | None = None  # set exactly when the request is new
    cache_salt: str = ""
    tenant: str = ""  # a new request's, for the allocator's per-tenant block quota
    resumed: bool = False  # new again after a recompute preemption (counted apart)
    skip_prefix_lookup: bool = False  # a new request that reads no cached prefix
    # A new request's priority level (lower first, as the caller orders them): by cost, a
    # step preempts only among the least urgent (allocator_svc/core/victims.py).
    priority: int = 0
    # A running request's slots past its `num_tokens` for draft tokens the executor verifies
    # (speculative decoding): granted with the item, not counted computed. The next call's
    # `accept_*` columns count the accepted ones; the rest are given back, never hashed.
    num_lookahead: int = 0
    # The allocator core's own: a decode row sent the general way (its token may be unknown).
    decode: bool = False

    @property
    def is_new(self) -> bool:
        return self.prompt_token_ids is not None


@dataclass(slots=True)  # not frozen: one a step on the allocator's hot path, 0.8 us cheaper
class StepCall:
    """One Step: everything a caller asks of one pool in one scheduling step (the pool, its
    epoch and the caller's lease go beside it).

    Applied in this order: appends (request append_request_ids[i] learns the value
    append_token_ids[i]), accepts (then the lease's lookahead they did not name counts as
    rejected), commits through `commit_through_step_id` (the lease's numbered
    steps whose batches executed), `commits`, frees, aborts; then scheduling in priority
    order: `decode_request_ids` (one more token each, on the hot path as a column), `items`.
    The allocator's fast path compares `append_request_ids` with `decode_request_ids` whole:
    give them one type (lists from the wire, tuples from the gateway)."""

    items: Sequence[StepItem] = ()
    mode: PreemptionMode = PreemptionMode.RECOMPUTE
    commits: Sequence[Commit] = ()
    free_request_ids: Sequence[str] = ()
    abort_request_ids: Sequence[str] = ()
    decode_request_ids: Sequence[str] = ()
    append_request_ids: Sequence[str] = ()
    append_token_ids: Sequence[int] = ()
    step_id: int = 0  # increasing per lease; 0: nothing kept for commit_through_step_id
    commit_through_step_id: int = 0
    waiting_tenants: Sequence[str] = ()  # fair share: whose service to report
    # Speculative decoding: request accept_request_ids[i] verified accept_counts[i] of the
    # draft tokens its last lookahead held (their values are among this call's appends): they
    # count as computed; its other lookahead slots are given back. Applied after appends.
    accept_request_ids: Sequence[str] = ()
    accept_counts: Sequence[int] = ()

    def has_items(self) -> bool:
        return bool(self.decode_request_ids or self.items)
