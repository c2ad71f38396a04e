"""A KV cache's blocks as bytes (KV hand-off): kv[:, :, block_id] made contiguous, read and
written back into other blocks exactly, float32 and bfloat16, on CPU and (gpu marker) CUDA."""

from __future__ import annotations

import threading

import pytest
import torch

from executor_svc.kv_blocks import TorchKVBlocks
from executor_svc.kv_cache import KVCache, KVCacheSpec

NO_CUDA = ("no CUDA device here (torch.cuda.is_available() is False); run on a CUDA machine: "
           ".venv/bin/python -m pytest -q -m gpu tests/executor/test_kv_blocks.py")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _cache(device: str, dtype: torch.dtype) -> KVCache:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip(NO_CUDA)
    spec = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype=dtype)
    cache = KVCache.allocate(spec, 16, 0, torch.device(device))
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=torch.Generator().manual_seed(0))
                   .to(dtype))
    return cache


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_blocks_read_is_the_block_and_write_puts_it_back(device: str,
                                                           dtype: torch.dtype) -> None:
    # Blocks 3, 7, 1 read as bytes (bytes_per_block each, every layer's K then V) and written
    # into blocks 10, 11, 12: those equal the originals, other blocks are untouched.
    cache = _cache(device, dtype)
    blocks = TorchKVBlocks(cache)
    before = cache.kv.clone()
    data = blocks.read([3, 7, 1])
    assert [len(d) for d in data] == [cache.spec.bytes_per_block] * 3
    expected = cache.kv[:, :, 3].contiguous().view(torch.uint8).cpu().numpy().tobytes()
    assert data[0] == expected
    blocks.write([10, 11, 12], data)
    for src, dst in ((3, 10), (7, 11), (1, 12)):
        assert torch.equal(cache.kv[:, :, dst], before[:, :, src])
    untouched = [b for b in range(16) if b not in (10, 11, 12)]
    assert torch.equal(cache.kv[:, :, untouched], before[:, :, untouched])


@pytest.mark.parametrize("device", DEVICES)
def test_kv_blocks_move_while_other_blocks_are_written(device: str) -> None:
    # A writer thread keeps rewriting blocks 0-7 (a step's work) while blocks 8-15 move:
    # the moved blocks come out exact.
    cache = _cache(device, torch.float32)
    blocks, before, stop = TorchKVBlocks(cache), cache.kv.clone(), threading.Event()

    def steps() -> None:
        while not stop.is_set():
            cache.kv[:, :, :8] += 1.0

    writer = threading.Thread(target=steps)
    writer.start()
    try:
        for _ in range(20):
            blocks.write([12, 13, 14, 15], blocks.read([8, 9, 10, 11]))
    finally:
        stop.set()
        writer.join()
    assert torch.equal(cache.kv[:, :, 12:], before[:, :, 8:12])
