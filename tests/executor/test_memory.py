"""How many KV blocks an executor gets from its CPU budget."""

from __future__ import annotations

from executor_svc.attention import make_backend
from executor_svc.kv_cache import KVCacheSpec
from executor_svc.memory import count_blocks
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
