"""The paged KV cache: sizing, block copies and swaps move whole blocks for every layer."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from executor_svc.kv_cache import KVCache, KVCacheSpec, runs
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


def test_runs_are_the_consecutive_stretches_in_order() -> None:
    assert list(runs([4, 5, 6, 1, 2, 9, 3])) == [(0, 4, 3), (3, 1, 2), (5, 9, 1), (6, 3, 1)]
    assert list(runs([7])) == [(0, 7, 1)]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_kv_cache_swaps_move_every_layer_slot_and_head_of_a_block(device: str) -> None:
    # Every element distinct; swaps in scrambled order with runs of consecutive CPU blocks:
    # each device block comes back exactly, checked against a dict of block contents. On
    # CUDA the copies are queued without waiting (pinned CPU blocks): cpu_blocks() waits.
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device here (torch.cuda.is_available() is False); on a CUDA "
                    "machine: python -m pytest -q -m gpu tests/executor/test_kv_cache.py")
    cache = KVCache.allocate(SPEC, 8, 6, torch.device(device))
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=torch.Generator().manual_seed(0)))
    before = {b: cache.kv[:, :, b].clone() for b in range(8)}
    out = ((6, 2), (1, 3), (3, 4), (7, 0), (0, 5))  # CPU runs: 2-4, 0, 5
    cache.swap_out(tuple(BlockCopy(d, c) for d, c in out))
    for cpu_block, device_block in ((c, d) for d, c in out):
        assert cache.cpu_blocks()[cpu_block].equal(before[device_block].cpu())
    cache.kv.zero_()
    back = ((3, 5), (4, 0), (2, 7), (0, 2), (5, 1))  # (cpu, device): runs 3-5, 2, 0
    cache.swap_in(tuple(BlockCopy(c, d) for c, d in back))
    cpu_to_device = {c: d for d, c in out}
    for cpu_block, device_block in back:
        assert cache.kv[:, :, device_block].equal(before[cpu_to_device[cpu_block]])
    untouched = set(range(8)) - {d for _, d in back}
    assert all(cache.kv[:, :, b].abs().sum() == 0 for b in untouched)
    if device == "cuda":
        assert cache.cpu_kv.is_pinned()  # so that the copies need not wait


def test_kv_cache_sized_from_memory_budget(make_runner: Callable[..., ModelRunner]) -> None:
    # tiny-llama, block 16: 2 layers x 2 x 16 x 2 heads x 16 dims x 4 bytes = 8 KiB per block.
    runner = make_runner(num_blocks=None, kv_cache_memory=1_000_000, swap_space=64 / 1024**2)
    assert runner.info.num_blocks == 1_000_000 // 8192
    assert runner.info.num_cpu_blocks == 8
    assert runner.cache.kv.shape == (2, 2, 122, 16, 2, 16)
