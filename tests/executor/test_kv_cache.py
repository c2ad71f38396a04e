"""The paged KV cache: sizing, block copies and swaps move whole blocks for every layer."""

from __future__ import annotations

from collections.abc import Callable

import torch

from executor_svc.kv_cache import KVCache, KVCacheSpec
from executor_svc.runner import ModelRunner
from executor_svc.step import BlockCopy

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype=torch.float32)


def _filled(num_blocks: int = 6, num_cpu_blocks: int = 3) -> KVCache:
    cache = KVCache.allocate(SPEC, num_blocks, num_cpu_blocks, torch.device("cpu"))
    for block in range(num_blocks):
        cache.kv[:, :, block] = float(block)
    return cache


def test_kv_cache_spec_bytes_per_block() -> None:
    # 2 layers x (K, V) x 4 slots x 2 heads x 4 dims x 4 bytes.
    assert SPEC.bytes_per_block == 2 * 2 * 4 * 2 * 4 * 4
    assert SPEC.blocks_for(10 * SPEC.bytes_per_block + 1) == 10


def test_kv_cache_copy_blocks_reads_every_source_first() -> None:
    # Copies 1->2 and 2->3 in one call: block 3 gets block 2's old contents.
    cache = _filled()
    cache.copy_blocks((BlockCopy(1, 2), BlockCopy(2, 3)))
    assert [cache.kv[:, :, b].unique().item() for b in range(6)] == [0, 1, 1, 2, 4, 5]


def test_kv_cache_swap_out_and_in_round_trips() -> None:
    # Blocks 4 and 5 go to CPU blocks 0 and 2, get overwritten, and come back into 1 and 0.
    cache = _filled()
    cache.swap_out((BlockCopy(4, 0), BlockCopy(5, 2)))
    cache.kv[:, :, 4:] = -1.0
    cache.swap_in((BlockCopy(0, 1), BlockCopy(2, 0)))
    assert [cache.kv[:, :, b].unique().item() for b in range(6)] == [5, 4, 2, 3, -1, -1]


def test_kv_cache_sized_from_memory_budget(make_runner: Callable[..., ModelRunner]) -> None:
    # tiny-llama, block 16: 2 layers x 2 x 16 x 2 heads x 16 dims x 4 bytes = 8 KiB per block.
    runner = make_runner(num_blocks=None, kv_cache_memory=1_000_000, swap_space=64 / 1024**2)
    assert runner.info.num_blocks == 1_000_000 // 8192
    assert runner.info.num_cpu_blocks == 8
    assert runner.cache.kv.shape == (2, 2, 122, 16, 2, 16)
