"""How many KV blocks an executor gets: its CPU budget, and the GPU arithmetic with a
fake device (the profile itself runs on a lent GPU: python -m bench.gpu --stage memory)."""

from __future__ import annotations

import torch

from executor_svc.attention import make_backend
from executor_svc.kv_cache import KVCacheSpec
from executor_svc.memory import GpuMemoryProfile, count_blocks, profile_spans
from executor_svc.model_loader import load_model

from .oracle import make_settings


def test_count_blocks_fills_the_budget_up_to_what_max_num_seqs_can_use() -> None:
    # tiny-llama's 8 KiB blocks: 1 MiB holds 128 of them; 2 GiB would hold 262,144, but 4
    # sequences of 64 tokens never use more than 16 blocks of 16 tokens.
    loaded = load_model(str(make_settings().model), "dummy", "float32", "cpu", seed=0)
    spec = KVCacheSpec.from_config(loaded.config, 16, loaded.dtype)
    assert spec.bytes_per_block == 8192
    backend = make_backend("torch", loaded.device)
    small = make_settings(num_blocks=None, kv_cache_memory=2**20, max_num_seqs=4)
    assert count_blocks(small, loaded, spec, backend, max_model_len=2048)[0] == 128
    large = make_settings(num_blocks=None, kv_cache_memory=2 * 2**30, max_num_seqs=4)
    assert count_blocks(large, loaded, spec, backend, max_model_len=64)[0] == 16


def test_gpu_budget_fills_the_device_up_to_the_utilization_with_what_is_there() -> None:
    # An 80 GiB device: 20 GiB already used (CUDA context, 16 GiB of weights, another
    # process), the largest step peaks 3 GiB over what stays allocated. At 0.9 the pool gets
    # 72 - 20 - 3 = 49 GiB; at 0.25 the budget is below zero (no block: the executor refuses
    # to start, as with a CPU budget too small for one block).
    gib = 2**30
    profile = GpuMemoryProfile(total_bytes=80 * gib, used_bytes=20 * gib,
                               step_peak_bytes=3 * gib)
    assert profile.kv_budget_bytes(0.9) == 49 * gib
    assert profile.kv_budget_bytes(0.25) < 0
    spec = KVCacheSpec(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16,
                       dtype=torch.bfloat16)
    assert spec.bytes_per_block == 2 * gib // 1024  # 2 MiB: 49 GiB hold 25,088 blocks
    assert spec.blocks_for(profile.kv_budget_bytes(0.9)) == 25_088


def test_the_profiled_step_splits_its_tokens_into_prompts_the_model_can_take() -> None:
    # 16,384 batched tokens at max_model_len 8,192: two full prompts; 700 at 256: 256+256+188.
    assert [s.query_len for s in profile_spans(16_384, 8_192, 16)] == [8_192, 8_192]
    spans = profile_spans(700, 256, 16)
    assert [(s.query_start, s.query_len, s.context_len) for s in spans] == [
        (0, 256, 256), (256, 256, 256), (512, 188, 188)]
    blocks = [b for s in spans for b in s.block_ids]
    assert blocks == list(range(16 + 16 + 12))  # each prompt on blocks of its own
