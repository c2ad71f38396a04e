"""The records a step's calls carry between the services, declared once: the gateway sends them
(gateway/core/step.py), the allocator core applies them, the executor copies blocks by them.
Each side's codec turns them into its own proto's messages of the same fields."""

from __future__ import annotations

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
