"""Argument validation for the allocator's calls: a caller's mistake raises a domain error
with a remedy, before anything is mutated."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from collections.abc import Set as AbstractSet

from allocator_svc.core.limits import Limits
from allocator_svc.core.pool import Pool, PoolConfig
from allocator_svc.core.request import Request
from allocator_svc.core.step import Appends
from common.credentials import lease_tag
from common.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
)
from common.step_records import MAX_LOOKAHEAD_TOKENS, MAX_WAITING_TENANTS, Commit, StepItem


def check_pool_config(config: PoolConfig, limits: Limits) -> None:
    if not config.pool_id:
        raise InvalidArgument("pool_id is required")
    for name in ("pool_id", "model_fingerprint", "executor_instance_id"):
        check_length(name, getattr(config, name), limits.max_id_chars)
    if not 1 <= config.num_blocks <= limits.max_blocks_per_pool:
        raise InvalidArgument(
            f"num_blocks={config.num_blocks} is out of range: 1..{limits.max_blocks_per_pool}"
        )
    if not 1 <= config.block_size <= limits.max_block_size:
        raise InvalidArgument(
            f"block_size={config.block_size} is out of range: 1..{limits.max_block_size}"
        )
    if config.num_cpu_blocks > limits.max_cpu_blocks_per_pool:
        raise InvalidArgument(
            f"num_cpu_blocks={config.num_cpu_blocks} is out of range: "
            f"0..{limits.max_cpu_blocks_per_pool}"
        )
    if config.num_cpu_cache_blocks > config.num_cpu_blocks:
        raise InvalidArgument(
            f"num_cpu_cache_blocks={config.num_cpu_cache_blocks} is more than the pool's "
            f"num_cpu_blocks={config.num_cpu_blocks}: the CPU tier lives in its CPU blocks"
        )


def check_length(name: str, value: str, limit: int) -> None:
    if len(value) > limit:
        raise InvalidArgument(f"{name} has {len(value)} characters; at most {limit} are allowed")


def check_waiting_tenants(tenants: Sequence[str], limits: Limits) -> None:
    """A Step's waiting_tenants: distinct, non-empty, bounded ids, MAX_WAITING_TENANTS at most."""
    if len(tenants) > MAX_WAITING_TENANTS:
        raise InvalidArgument(f"waiting_tenants names {len(tenants)} tenants; at most "
                              f"{MAX_WAITING_TENANTS} are allowed")
    seen: set[str] = set()
    for index, tenant in enumerate(tenants):
        if not tenant or tenant in seen:
            raise InvalidArgument(f"waiting_tenants[{index}] is {tenant!r}: name each waiting "
                                  "tenant once, none empty")
        check_length(f"waiting_tenants[{index}]", tenant, limits.max_id_chars)
        seen.add(tenant)


def check_owner(pool: Pool, request_ids: Iterable[str], lease_id: str | None) -> None:
    """Under a lease, a call may touch only that lease's requests: request ids are the
    clients' own, and two clients (gateways) may pick the same one. Unknown ids are left to
    the other checks; with no lease, nothing is checked (operator tools)."""
    if lease_id is None:
        return
    requests = pool.requests
    for request_id in request_ids:
        request = requests.get(request_id)
        if request is not None and request.lease_id != lease_id:
            raise PermissionDenied(
                f"request {request_id!r} in pool {pool.config.pool_id!r} belongs to another "
                f"lease than {lease_tag(lease_id)}: a client may touch only the requests it "
                "admitted"
            )


def check_releases(pool: Pool, free_ids: Sequence[str], abort_ids: Sequence[str]) -> set[str]:
    released = set()
    for request_id in (*free_ids, *abort_ids):
        if request_id not in pool.requests:
            raise NotFound(f"unknown request {request_id!r} in pool {pool.config.pool_id!r}")
        if request_id in released:
            raise InvalidArgument(f"request {request_id!r} is freed twice in one call")
        released.add(request_id)
    return released


def check_commits(pool: Pool, commits: Sequence[Commit]) -> None:
    for commit in commits:
        request = pool.requests.get(commit.request_id)
        if request is None:
            raise NotFound(f"commit for unknown request {commit.request_id!r}")
        if commit.num_computed_tokens > request.num_computed:
            raise InvalidArgument(
                f"commit of {commit.num_computed_tokens} tokens for {commit.request_id!r}, which "
                f"was granted only {request.num_computed}"
            )


def check_items(
    pool: Pool, items: Sequence[StepItem], released: AbstractSet[str], limits: Limits
) -> None:
    seen = {item.request_id for item in items}
    if len(seen) != len(items) or "" in seen:
        _raise_bad_ids(item.request_id for item in items)
    if released and not released.isdisjoint(seen):
        # Freed and scheduled again in one call: only as a new admission (the free applies
        # first), as when a client reuses the id of a request that has just finished.
        running = {item.request_id for item in items if not item.prompt_token_ids}
        if not released.isdisjoint(running):
            raise InvalidArgument(
                f"requests {sorted(released & running)} are both freed and scheduled"
            )
    requests = pool.requests
    for item in items:
        request_id = item.request_id
        known = request_id in requests and request_id not in released
        if item.num_lookahead:
            _check_lookahead(pool, item, requests.get(request_id) if known else None)
        if known and not item.prompt_token_ids:
            continue
        if item.prompt_token_ids:
            if known:
                raise AlreadyExists(f"request {request_id!r} is already admitted")
            check_length("request_id", request_id, limits.max_id_chars)
            check_length("cache_salt", item.cache_salt, limits.max_salt_chars)
            check_length("tenant", item.tenant, limits.max_id_chars)
            check_token_ids(request_id, item.prompt_token_ids)
            needed = pool.blocks_for(len(item.prompt_token_ids))
            if needed > pool.config.num_blocks:
                raise ResourceExhausted(
                    f"request {request_id!r} needs {needed} blocks; pool "
                    f"{pool.config.pool_id!r} has {pool.config.num_blocks} in all"
                )
        elif not known:
            raise NotFound(
                f"unknown request {request_id!r}: a new request must carry prompt_token_ids"
            )


def _check_lookahead(pool: Pool, item: StepItem, request: Request | None) -> None:
    """Lookahead slots go to a running request's item, bounded, within the pool."""
    if item.num_lookahead > MAX_LOOKAHEAD_TOKENS:
        raise InvalidArgument(
            f"request {item.request_id!r}: num_lookahead={item.num_lookahead} is out of range: "
            f"0..{MAX_LOOKAHEAD_TOKENS}"
        )
    if request is None or item.prompt_token_ids or request.swapped:
        raise InvalidArgument(
            f"request {item.request_id!r}: num_lookahead is for a running request's item, not "
            "a new or swapped-out one"
        )
    end = request.num_computed + item.num_tokens + item.num_lookahead
    if pool.blocks_for(end) > pool.config.num_blocks:
        raise InvalidArgument(
            f"request {item.request_id!r}: its lookahead reaches position {end}, past the "
            f"{pool.config.num_blocks * pool.block_size} slots of pool {pool.config.pool_id!r}"
        )


def check_accepts(pool: Pool, ids: Sequence[str], counts: Sequence[int], lease_id: str | None,
                  appends: Appends | None) -> list[tuple[Request, int]]:
    """Each accept names a request of the lease holding lookahead once, with at most that
    many drafts, whose values it knows once this call's appends apply."""
    if len(ids) != len(counts):
        raise InvalidArgument(
            f"accept_request_ids has {len(ids)} entries but accept_counts has {len(counts)}"
        )
    if len(set(ids)) != len(ids):
        raise InvalidArgument("a request is accepted twice in one call: send each once")
    check_owner(pool, ids, lease_id)
    appended: dict[str, int] = {}
    if appends is not None:
        for request_id in appends.request_ids:
            appended[request_id] = appended.get(request_id, 0) + 1
    out = []
    for request_id, count in zip(ids, counts, strict=True):
        request = pool.requests.get(request_id)
        if request is None:
            raise NotFound(f"accept for unknown request {request_id!r}")
        if count > request.num_lookahead:
            raise InvalidArgument(
                f"request {request_id!r}: {count} drafts accepted, but its lookahead held "
                f"{request.num_lookahead}"
            )
        known = len(request.token_ids) + appended.get(request_id, 0)
        if request.num_computed + count > known:
            raise InvalidArgument(
                f"request {request_id!r}: {count} drafts accepted, but only "
                f"{known - request.num_computed} of their values are known: append the "
                "accepted tokens in this call"
            )
        out.append((request, count))
    return out


def check_decodes(
    pool: Pool,
    ids: Sequence[str],
    items: Sequence[StepItem],
    released: AbstractSet[str],
    lease_id: str | None,
    one_value_each: bool,
) -> list[Request]:
    """Each names a known, running request of the lease once, not otherwise scheduled or
    freed in the call. `one_value_each`: the call appends one value to each, in this order
    (the common step), and each must have room for it. Returns the requests, in column
    order (the step then looks nothing up).

    Every step runs this over every running request: one set, one map and one pass."""
    seen = set(ids)
    if len(seen) != len(ids) or "" in seen:
        _raise_bad_ids(ids)
    if items and not seen.isdisjoint(item.request_id for item in items):
        _raise_bad_ids([*ids, *(item.request_id for item in items)])
    if released and not released.isdisjoint(seen):
        raise InvalidArgument(f"requests {sorted(released & seen)} are both freed and scheduled")
    requests = pool.requests
    if not requests.keys() >= seen:
        unknown = next(i for i in ids if i not in requests)
        raise NotFound(f"unknown request {unknown!r}: a new request must carry prompt_token_ids")
    batch: list[Request] = list(map(requests.__getitem__, ids))
    # Room for one value: at most the pool's slots, and one sampled token past them.
    full = pool.config.num_blocks * pool.block_size if one_value_each else 1 << 62
    for request in batch:
        if (request.lease_id != lease_id or request.cpu_block_ids is not None
                or len(request.token_ids) > full):
            _refuse_decode(pool, request, lease_id, full)
    return batch


def _refuse_decode(pool: Pool, request: Request, lease_id: str | None, full: int) -> None:
    """Raise what is wrong with this decode (nothing: another lease's check is skipped
    without a lease)."""
    check_owner(pool, [request.request_id], lease_id)
    if request.cpu_block_ids is not None:
        raise InvalidArgument(
            f"request {request.request_id!r} is swapped out: swap it in with an item, "
            "not a decode"
        )
    if len(request.token_ids) > full:
        _raise_too_long(pool, request, len(request.token_ids) + 1, full + 1)


def check_appends(
    pool: Pool, appends: Appends, lease_id: str | None, one_value_each: bool,
    decodes: list[Request],
) -> list[Request]:
    """The columns must be aligned and name known requests of the lease, with valid values
    that keep each request within the pool. Returns the requests, in row order.

    `one_value_each`: the rows are the decodes' (`decodes`, checked with room for them), and
    only the values are left to check."""
    ids, tokens = appends.request_ids, appends.token_ids
    if len(ids) != len(tokens):
        raise InvalidArgument(
            f"append_request_ids has {len(ids)} entries but append_token_ids has {len(tokens)}"
        )
    if one_value_each:
        requests = decodes
    else:
        requests = _appended(pool, ids, lease_id)
    if min(tokens) < 0:
        index = next(i for i, token in enumerate(tokens) if token < 0)
        raise InvalidArgument(f"{ids[index]}: append token ids must be >= 0, got {tokens[index]}")
    return requests


def _appended(pool: Pool, ids: Sequence[str], lease_id: str | None) -> list[Request]:
    """The requests of appends not one a decode: known, of the lease, within the pool."""
    requests = pool.requests
    if not requests.keys() >= set(ids):
        if "" in ids:
            raise InvalidArgument("every append needs a request_id")
        unknown = next(i for i in ids if i not in requests)
        raise NotFound(f"append for unknown request {unknown!r}")
    appended: list[Request] = list(map(requests.__getitem__, ids))
    check_owner(pool, ids, lease_id)
    # A request computes at most the pool's slots, and holds one sampled token past them.
    capacity = pool.config.num_blocks * pool.block_size + 1
    held: dict[str, int] = {}
    for request in appended:
        count = held.get(request.request_id, len(request.token_ids)) + 1
        held[request.request_id] = count
        if count > capacity:
            _raise_too_long(pool, request, count, capacity)
    return appended


def _raise_too_long(pool: Pool, request: Request, count: int, capacity: int) -> None:
    raise InvalidArgument(
        f"request {request.request_id!r} would hold {count} tokens, more than a request of "
        f"pool {pool.config.pool_id!r} can ({capacity}: its slots and one sampled token): "
        "append each value once"
    )


def check_values_known(decodes: list[Request], appended: list[Request] | None,
                       one_value_each: bool) -> None:
    """A decode's earlier computed tokens all have values (this call's appends count): a
    request's computed tokens run at most one past its known ones. Nothing to look at when
    every decode appends one value (the common step)."""
    if one_value_each:
        return
    filled: set[str] | None = None
    for request in decodes:
        if request.num_computed > len(request.token_ids):
            if filled is None:
                filled = {r.request_id for r in appended} if appended else set()
            if request.request_id not in filled:
                raise InvalidArgument(
                    f"request {request.request_id!r} has a computed token whose value is "
                    "unknown: append its value before decoding the next one"
                )


def _raise_bad_ids(request_ids: Iterable[str]) -> None:
    seen: set[str] = set()
    for request_id in request_ids:
        if not request_id:
            raise InvalidArgument("every item needs a request_id")
        if request_id in seen:
            raise InvalidArgument(f"request {request_id!r} appears twice in one step")
        seen.add(request_id)


def check_token_ids(owner: str, token_ids: Sequence[int]) -> None:
    if token_ids and min(token_ids) < 0:
        raise InvalidArgument(f"{owner}: token ids must be >= 0, got {min(token_ids)}")


def check_pin(pool: Pool, token_ids: list[int], cache_salt: str, name: str,
              limits: Limits) -> None:
    """A pin's arguments, before its chain is hashed (the work is bounded by the budget)."""
    pool_id = pool.config.pool_id
    if not pool.config.enable_prefix_caching:
        raise FailedPrecondition(
            f"pool {pool_id!r} runs without prefix caching: it caches no block to pin"
        )
    check_length("cache_salt", cache_salt, limits.max_salt_chars)
    check_length("name", name, limits.max_id_chars)
    check_token_ids("pin", token_ids)
    num_blocks = len(token_ids) // pool.block_size
    if num_blocks == 0:
        raise InvalidArgument(
            f"a pin needs at least one full block: {len(token_ids)} token ids, pool "
            f"{pool_id!r} has blocks of {pool.block_size} (only full blocks are pinned)"
        )
    if num_blocks > pool.pins.budget:
        _raise_over_budget(pool, f"the prefix has {num_blocks} full blocks, more than the "
                           "whole budget")


def check_pin_budget(pool: Pool, block_hashes: list[bytes]) -> None:
    """Only the chain's hashes no pin names yet count: a prefix of a pinned one is free."""
    num_new = pool.pins.num_new(block_hashes)
    if pool.pins.num_blocks + num_new > pool.pins.budget:
        _raise_over_budget(pool, f"the prefix has {len(block_hashes)} full blocks, {num_new} "
                           "of them not pinned yet")


def _raise_over_budget(pool: Pool, asked: str) -> None:
    pins = pool.pins
    raise ResourceExhausted(
        f"over the pin budget of pool {pool.config.pool_id!r}: {asked}; {len(pins.pins)} "
        f"pins hold {pins.num_blocks} of its {pins.budget} blocks. Unpin some (ListPins, "
        "UnpinPrefix), pin a shorter prefix, or raise the allocator's --max-pinned-fraction"
    )
