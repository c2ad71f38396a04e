"""The commit rule's bookkeeping: a full block enters the prefix cache only once the executor
has written its KV. The gateway confirms a whole step with one flag (commit_previous_step),
so what each step granted is kept per lease until a call commits or drops it.

Not pipelined, a Step commits what the previous Step granted, at the requests' current
counts (nothing was granted since). Pipelined (previous_step_in_flight), the previous step is
still executing: its grants are kept with each request's count at that point, and the next
Step commits them, once the gateway has seen that batch return.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING

from allocator_svc.core.free_queue import Block
from allocator_svc.core.hashing import pack_tokens
from allocator_svc.core.request import Request

if TYPE_CHECKING:
    from allocator_svc.core.pool import Pool

class ScheduledSteps:
    """Per lease (None: no lease): the requests its latest Step granted tokens, and in a
    pipeline the Step before it, with the counts it granted them. Two leases may step the
    same pool."""

    __slots__ = ("latest", "executing")

    def __init__(self) -> None:
        self.latest: dict[str | None, list[Request]] = {}
        self.executing: dict[str | None, tuple[list[Request], list[int]]] = {}

    def record(self, lease_id: str | None, requests: list[Request]) -> None:
        self.latest[lease_id] = requests

    def forget(self, lease_id: str | None) -> None:
        self.latest.pop(lease_id, None)
        self.executing.pop(lease_id, None)

    def advance(
        self,
        pool: Pool,
        lease_id: str | None,
        commit_previous: bool,
        previous_in_flight: bool,
        aborted: AbstractSet[str] = frozenset(),
    ) -> None:
        """Before a Step: commit the steps it confirms executed (commit_previous), drop the
        rest; with the previous step in flight, keep that one for the next call. A request
        the same call aborts is never committed (an abort commits nothing)."""
        latest = self.latest.pop(lease_id, None)
        executing = self.executing.pop(lease_id, None) if self.executing else None
        if aborted and commit_previous:
            if latest:
                latest = [r for r in latest if r.request_id not in aborted]
            if executing is not None:
                kept = [(r, c) for r, c in zip(*executing, strict=True)
                        if r.request_id not in aborted]
                executing = ([r for r, _ in kept], [c for _, c in kept])
        if commit_previous and executing is not None:
            commit_run(pool, *executing)
        if previous_in_flight:
            if latest:
                self.executing[lease_id] = (latest, [r.num_computed for r in latest])
        elif commit_previous and latest:
            commit_current(pool, latest)


def commit(pool: Pool, request: Request, num_computed: int) -> None:
    """KV of tokens [0, num_computed) is written: cache the full blocks among them. A pending
    token's block waits for its value."""
    if request.request_id in pool.pending:
        num_computed = min(num_computed, len(request.token_ids) - 1)
    request.num_committed = max(request.num_committed, num_computed)
    bs = pool.block_size
    num_full = num_computed // bs
    hashes = request.block_hashes
    if len(hashes) >= num_full or request.swapped:
        return
    first = len(hashes)
    tokens = request.token_ids[first * bs : num_full * bs]
    new_hashes, keys = pool.hash_block.chain_with_keys(
        hashes[-1] if hashes else request.root_hash, tokens, num_full - first
    )
    pool.blocks.cache_run(
        request.blocks[first:num_full],
        new_hashes,
        keys,
        hashes[-1] if hashes else None,
        tokens,
    )
    hashes.extend(new_hashes)


def commit_current(pool: Pool, requests: list[Request]) -> None:
    """Commit each of a step's requests at its current count (nothing was granted since).
    Most decode steps fill no block; in one of every block_size steps each request fills one,
    and those are hashed and cached together, as one event run. The hot path of a step: the
    loop of `commit_run` without the counts."""
    if pool.pending:  # no count may reach a pending token: commit_run clamps them
        commit_run(pool, requests, [r.num_computed for r in requests])
        return
    live, bs = pool.requests, pool.block_size
    filled: list[Request] = []
    tokens: list[int] = []
    for request in requests:
        if live.get(request.request_id) is not request:
            continue  # freed or preempted since
        have, num_full = len(request.block_hashes), request.num_computed // bs
        if num_full == have:  # no block filled up: nothing to hash (most decode steps)
            request.num_committed = request.num_computed
        elif _one_block_filled(pool, request, request.num_computed, have, num_full):
            filled.append(request)
            tokens.extend(request.token_ids[have * bs : num_full * bs])
    if filled:
        _cache_one_block_each(pool, filled, tokens)


def commit_run(pool: Pool, requests: list[Request], counts: Iterable[int]) -> None:
    """Commit each of a step's requests at the count it was granted then (a pipelined step,
    confirmed executed one call later)."""
    live, bs, pending = pool.requests, pool.block_size, pool.pending
    filled: list[Request] = []
    tokens: list[int] = []
    for request, count in zip(requests, counts, strict=True):
        if live.get(request.request_id) is not request:
            continue  # freed or preempted since
        have, num_full = len(request.block_hashes), count // bs
        if num_full == have:
            if pending and request.request_id in pending:
                count = min(count, len(request.token_ids) - 1)
            if count > request.num_committed:
                request.num_committed = count
        elif _one_block_filled(pool, request, count, have, num_full):
            filled.append(request)
            tokens.extend(request.token_ids[have * bs : num_full * bs])
    if filled:
        _cache_one_block_each(pool, filled, tokens)


def _one_block_filled(pool: Pool, request: Request, count: int, have: int, num_full: int) -> bool:
    """True: the request filled exactly its next block, to be hashed with the step's others.
    Anything else (a prefill chunk, a swapped request, a block holding a pending token) is
    committed on its own here."""
    holds_pending = (
        num_full * pool.block_size >= len(request.token_ids) and request.request_id in pool.pending
    )
    if num_full != have + 1 or request.cpu_block_ids is not None or holds_pending:
        commit(pool, request, count)
        return False
    request.num_committed = max(request.num_committed, count)
    return True


def _cache_one_block_each(pool: Pool, filled: list[Request], tokens: list[int]) -> None:
    """Each request filled its next block with its slice of `tokens`: packed together, each
    hashed over its parent + its slice."""
    bs = pool.block_size
    packed, stride, sha256 = pack_tokens(tokens), 4 * bs, hashlib.sha256
    blocks: list[Block] = []
    hashes: list[bytes] = []
    keys: list[bytes] = []
    parents: list[bytes | None] = []  # None: a chain's first block
    for index, request in enumerate(filled):
        have = len(request.block_hashes)
        parent = request.block_hashes[-1] if have else request.root_hash
        key = parent + packed[index * stride : (index + 1) * stride]
        block_hash = sha256(key).digest()
        request.block_hashes.append(block_hash)
        blocks.append(request.blocks[have])
        hashes.append(block_hash)
        keys.append(key)
        parents.append(parent if have else None)
    pool.blocks.cache_blocks(blocks, hashes, keys, parents, tokens)
