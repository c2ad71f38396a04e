"""The records a step's calls carry between the services, declared once: the gateway sends them
(gateway/core/step.py), the allocator core applies them, the executor copies blocks by them.
Each side's codec turns them into its own proto's messages of the same fields."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


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
    # The allocator core's own: a decode row sent the general way (its token may be unknown).
    decode: bool = False

    @property
    def is_new(self) -> bool:
        return self.prompt_token_ids is not None
