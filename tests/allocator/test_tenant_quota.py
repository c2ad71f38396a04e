"""Per-tenant block quota at admission (core/step.py TenantQuota), in the core and over gRPC:
a tenant at its quota waits, another tenant's request behind it is admitted, one holding
nothing always gets in, and freeing makes room again."""

from __future__ import annotations

import pytest

from allocator_svc.core.allocator import Allocator, Limits
from allocator_svc.core.pool import PoolConfig
from common.step_records import StepCall, StepItem
from pagedkv.allocator.v1 import allocator_pb2 as pb
from pagedkv.allocator.v1 import allocator_pb2_grpc
from tests.allocator.conftest import AUTH, start_allocator, stop_process


def _allocator(quota: int) -> tuple[Allocator, int, str]:
    allocator = Allocator(Limits(max_batch_items=64, max_blocks_per_tenant=quota))
    pool, _ = allocator.register_pool(PoolConfig("p", 32, 4, 0, "fp", "i", True))
    return allocator, pool.epoch, allocator.create_lease(60.0).lease_id


def _new(request_id: str, tenant: str, num_tokens: int) -> StepItem:
    prompt = [hash((request_id, i)) % 500 + 3 for i in range(num_tokens)]
    return StepItem(request_id, num_tokens, prompt, "", tenant=tenant)


def test_a_tenant_at_its_quota_waits_while_another_is_admitted_behind_it():
    allocator, epoch, lease = _allocator(quota=4)
    # a1 (2 blocks), a2 (2 blocks: a at 4), a3 (over: waits), b1 (behind a3: admitted).
    result = allocator.step("p", epoch, lease, StepCall([
        _new("a1", "a", 8), _new("a2", "a", 8), _new("a3", "a", 8), _new("b1", "b", 8)]))
    allocator.check_invariants()
    assert {g.request_id for g in result.grants} == {"a1", "a2", "b1"}
    assert result.deferred == ["a3"]
    # Still at its quota: a3 waits again; once a1 is freed, it gets in.
    assert allocator.step("p", epoch, lease, StepCall([_new("a3", "a", 8)])).deferred == ["a3"]
    result = allocator.step(
        "p", epoch, lease,
        StepCall([_new("a3", "a", 8)], free_request_ids=["a1"]))
    assert [g.request_id for g in result.grants] == ["a3"] and not result.deferred
    allocator.check_invariants()


def test_a_tenant_holding_nothing_is_admitted_even_past_its_quota_and_no_tenant_no_quota():
    allocator, epoch, lease = _allocator(quota=2)
    result = allocator.step("p", epoch, lease, StepCall([
        _new("big", "a", 20), _new("free-rider", "", 20), _new("next", "a", 4)]))
    assert {g.request_id for g in result.grants} == {"big", "free-rider"}
    assert result.deferred == ["next"]


def test_forked_children_count_against_their_parents_tenant():
    # n > 1: the children share the parent's blocks and keep counting once it is freed.
    allocator, epoch, lease = _allocator(quota=4)
    allocator.step("p", epoch, lease, StepCall([_new("parent", "a", 16)]))
    allocator.fork("p", epoch, "parent", ["c0", "c1"], lease)
    allocator.step(
        "p", epoch, lease,
        StepCall(free_request_ids=["parent"], commits=[], abort_request_ids=[],
            items=[_new("b1", "b", 4)]))
    assert {r.tenant for r in allocator.pools["p"].requests.values()} == {"a", "b"}
    assert allocator.step("p", epoch, lease, StepCall([_new("a2", "a", 4)])).deferred == ["a2"]


def test_without_a_quota_tenants_change_nothing():
    allocator, epoch, lease = _allocator(quota=0)
    result = allocator.step("p", epoch, lease, StepCall([_new(f"a{i}", "a", 8) for i in range(4)]))
    assert len(result.grants) == 4 and not result.deferred


@pytest.mark.e2e  # (a Python subprocess)
def test_over_grpc_the_items_tenant_reaches_the_quota(tmp_path):
    # A real allocator with --max-blocks-per-tenant 4: the proto's StepItem.tenant counts.
    server = start_allocator(tmp_path, "--max-blocks-per-tenant", "4")
    try:
        with AUTH.channel(server.address) as channel:
            stub = allocator_pb2_grpc.AllocatorServiceStub(channel)
            pool = stub.RegisterPool(pb.RegisterPoolRequest(
                pool_id="p", num_blocks=32, block_size=4, model_fingerprint="fp",
                executor_instance_id="i", enable_prefix_caching=True)).pool
            lease = stub.CreateLease(pb.CreateLeaseRequest(ttl_ms=60_000)).lease_id
            items = [pb.StepItem(request_id=r, prompt_token_ids=[5 + i] * 8, num_tokens=8,
                                 tenant=t)
                     for i, (r, t) in enumerate([("a1", "a"), ("a2", "a"), ("a3", "a"),
                                                 ("b1", "b")])]
            response = stub.Step(pb.StepRequest(pool_id="p", epoch=pool.epoch, lease_id=lease,
                                                items=items))
        assert {g.request_id for g in response.grants} == {"a1", "a2", "b1"}
        assert list(response.deferred_request_ids) == ["a3"]
    finally:
        assert stop_process(server) == 0
