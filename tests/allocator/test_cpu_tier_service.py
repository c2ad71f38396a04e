"""The CPU tier on the wire and in metrics: RegisterPool's num_cpu_cache_blocks, a Step's
eviction copies (swap_out) and hit copies (swap_in), the grant and MatchPrefix naming the
tier, GetStats and the Prometheus counters by tier. The servicer is called in process."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from allocator_svc.core.allocator import Allocator, Limits
from allocator_svc.metrics import AllocatorCollector
from allocator_svc.service import AllocatorServicer
from pagedkv.allocator.v1 import allocator_pb2 as pb

A = list(range(9))


def call(coroutine: Any) -> Any:
    return asyncio.run(coroutine)


@pytest.fixture
def served() -> tuple[AllocatorServicer, str, int, Allocator]:
    allocator = Allocator(Limits())
    servicer = AllocatorServicer(allocator)
    lease = call(servicer.CreateLease(pb.CreateLeaseRequest(), None)).lease_id
    info = call(servicer.RegisterPool(pb.RegisterPoolRequest(
        pool_id="p", num_blocks=4, block_size=4, num_cpu_blocks=6, num_cpu_cache_blocks=4,
        model_fingerprint="fp", executor_instance_id="i", enable_prefix_caching=True), None))
    assert info.pool.num_cpu_cache_blocks == 4
    return servicer, lease, info.pool.epoch, allocator


def step(served, step_id: int, **fields: Any) -> pb.StepResponse:
    servicer, lease, epoch, _ = served
    return call(servicer.Step(pb.StepRequest(pool_id="p", epoch=epoch, lease_id=lease,
                                             step_id=step_id, **fields), None))


def new(request_id: str, prompt: list[int]) -> pb.StepItem:
    return pb.StepItem(request_id=request_id, prompt_token_ids=prompt, num_tokens=len(prompt))


def test_cpu_tier_service_names_the_tier_in_grants_matches_stats_and_metrics(served):
    servicer, _, _, allocator = served
    step(served, 1, items=[new("a", A)])
    step(served, 0, free_request_ids=["a"], commit_through_step_id=1)
    evicting = step(served, 2, items=[new("b", list(range(100, 116)))])
    assert [(c.src_block_id, c.dst_block_id) for c in evicting.swap_out] == [(1, 0), (0, 1)]
    step(served, 0, free_request_ids=["b"], commit_through_step_id=2)
    (match,) = call(servicer.MatchPrefix(pb.MatchPrefixRequest(token_ids=A), None)).matches
    assert (match.num_cached_tokens, match.num_cpu_cached_tokens) == (8, 8)
    hit = step(served, 3, items=[new("c", A)])
    (grant,) = hit.grants
    assert (grant.num_cached_tokens, grant.num_cpu_cached_tokens) == (8, 8)
    assert [(c.src_block_id, c.dst_block_id) for c in hit.swap_in] == [(1, 0), (0, 1)]
    (stats,) = call(servicer.GetStats(pb.GetStatsRequest(pool_id="p"), None)).pools
    assert (stats.num_cpu_cache_blocks, stats.num_prefix_hits, stats.num_prefix_cpu_hits,
            stats.num_cpu_cache_stores, stats.num_cpu_cache_loads) == (4, 8, 8, 4, 2)
    metrics = {m.name: m for m in AllocatorCollector(allocator).collect()}
    tiers = {s.labels["tier"]: s.value for s in metrics["pagedkv_allocator_prefix_cache_tier_hits"]
             .samples if s.name.endswith("_total")}
    assert tiers == {"device": 0, "cpu": 8}
    assert [s.value for s in metrics["pagedkv_allocator_cpu_cache_blocks"].samples] == [4]
