"""Whom a step preempts when a running request is short of blocks, and how.

Candidates are the running requests behind it in the caller's priority order that the step
has not preempted yet. Two policies:

- `tail` (vLLM's): the last candidate, preempted in the caller's mode.
- `cost`: among the candidates of the lowest priority level (never one more urgent than
  another candidate), the one whose preemption wastes least per block it gives the step,
  preempted the cheaper way where the caller allows a swap:
  - recomputing costs the tokens it would compute again: all it holds, less its leading
    blocks that other requests share (they stay, and its prefix lookup finds them again);
  - swapping costs copying every block out and back, SWAP_TOKEN_COST a token against one
    token's forward, and needs that many free CPU blocks;
  - it gives the step its blocks no one else holds (min'd with what the step lacks: taking
    a long request to free one block wastes the rest); one that gives none is never taken.
  Ties go to the later candidate, as in `tail`.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from allocator_svc.core.pool import Pool
from allocator_svc.core.request import Request
from common.step_records import PreemptionMode, StepItem

# Copying one token's KV to CPU memory and back, against computing that token again (a
# forward pass over the whole model): a few percent on CPUs and GPUs alike.
SWAP_TOKEN_COST = 0.05


class PreemptionPolicy(enum.Enum):
    TAIL = "tail"
    COST = "cost"


@dataclass(frozen=True, slots=True)
class Victim:
    request: Request
    mode: PreemptionMode


def choose_victim(
    pool: Pool,
    running: Sequence[tuple[StepItem, Request]],
    start: int,
    preempted: set[str],
    short: int,
    mode: PreemptionMode,
    policy: PreemptionPolicy,
) -> Victim | None:
    """The request to preempt from running[start:] so that running[start - 1] gets `short`
    more blocks; None: no one left (or, by cost, no one who would free a block)."""
    if policy is PreemptionPolicy.TAIL:
        for item, request in reversed(running[start:]):
            if item.request_id not in preempted:
                return Victim(request, mode)
        return None
    urgency = running[start - 1][1].priority
    candidates = [r for item, r in running[start:]
                  if item.request_id not in preempted and r.priority >= urgency]
    for level in sorted({r.priority for r in candidates}, reverse=True):  # least urgent first
        best: tuple[float, Victim] | None = None
        for request in candidates:
            if request.priority != level:
                continue
            freed, shared = _freed_and_shared(pool, request)
            if not freed:
                continue
            cost, how = recompute_or_swap(pool, request, shared, mode)
            score = cost / min(freed, short)
            if best is None or score <= best[0]:  # `<=`: ties go to the later one
                best = (score, Victim(request, how))
        if best is not None:
            return best[1]
    return None


def recompute_or_swap(
    pool: Pool, request: Request, shared_tokens: int, mode: PreemptionMode
) -> tuple[float, PreemptionMode]:
    """What preempting the request costs (in tokens' forwards) done the cheaper way allowed."""
    recompute = float(request.num_computed - shared_tokens)
    if mode is not PreemptionMode.SWAP:
        return recompute, PreemptionMode.RECOMPUTE
    swap = SWAP_TOKEN_COST * len(request.blocks) * pool.block_size
    if swap < recompute and pool.cpu.can_take(len(request.blocks)):
        return swap, PreemptionMode.SWAP
    return recompute, PreemptionMode.RECOMPUTE


def _freed_and_shared(pool: Pool, request: Request) -> tuple[int, int]:
    """Blocks that preempting it frees (no one else holds them), and the tokens of its
    leading blocks that others hold and its readmission would find cached (hashed ones, with
    prefix caching on): computed again from the cache, not the model."""
    freed = sum(1 for block in request.blocks if block.ref_count == 1)
    if not pool.config.enable_prefix_caching:
        return freed, 0
    leading = next((i for i, b in enumerate(request.blocks) if b.ref_count == 1),
                   len(request.blocks))
    leading = min(leading, len(request.block_hashes))
    return freed, min(leading * pool.block_size, request.num_computed)
