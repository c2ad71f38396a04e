"""The servicer's heap management: frozen pools must not leak when a pool is replaced."""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest

from allocator_svc.core.allocator import Allocator, Limits
from allocator_svc.service import AllocatorServicer
from common.errors import AlreadyExists
from pagedkv.allocator.v1 import allocator_pb2 as pb

# Frozen objects of other tests that reference counting may free while one runs: far fewer
# than a thawed pool's 4,096 blocks.
UNRELATED_FREES = 1000


def _register(servicer: AllocatorServicer, instance: str) -> None:
    request = pb.RegisterPoolRequest(
        pool_id="p",
        num_blocks=4096,
        block_size=16,
        model_fingerprint="m",
        executor_instance_id=instance,
    )
    asyncio.run(servicer.RegisterPool(request, None))  # type: ignore[arg-type]


def test_a_replaced_pool_is_freed_although_its_blocks_were_frozen():
    # A new executor instance resets the pool: the old pool (cyclic through its free queue,
    # frozen out of the collector's sight at registration) must still be reclaimed.
    servicer = AllocatorServicer(Allocator(Limits()))
    _register(servicer, "first")
    old_pool = weakref.ref(servicer.allocator.pools["p"])
    frozen = gc.get_freeze_count()
    _register(servicer, "second")
    assert servicer.allocator.pools["p"] is not old_pool()
    assert old_pool() is None
    # The new pool's 4,096 blocks replace the old ones in the frozen heap; they do not add up.
    assert gc.get_freeze_count() < frozen + 1000


def test_a_refused_or_repeated_registration_leaves_the_heap_frozen():
    # Re-registering the same pool, or a refused one (same instance, another shape), must not
    # thaw the frozen pools: their blocks would be rescanned by every full collection.
    servicer = AllocatorServicer(Allocator(Limits()))
    _register(servicer, "first")
    frozen = gc.get_freeze_count()
    _register(servicer, "first")
    # Thawed, the pool's 4,096 blocks would leave the frozen heap; an unrelated frozen object
    # freed meanwhile (by reference count) may take the count down by a few.
    assert gc.get_freeze_count() > frozen - UNRELATED_FREES
    refused = pb.RegisterPoolRequest(
        pool_id="p", num_blocks=8, block_size=16, model_fingerprint="m",
        executor_instance_id="first",
    )
    with pytest.raises(AlreadyExists):
        asyncio.run(servicer.RegisterPool(refused, None))  # type: ignore[arg-type]
    assert gc.get_freeze_count() > frozen - UNRELATED_FREES
