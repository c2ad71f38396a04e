"""How many KV blocks fit: the CPU budget (--kv-cache-memory) or a profiled GPU budget.

On CUDA, the weights are loaded first; then one forward pass over the largest step
(max_num_batched_tokens tokens) measures the activation peak, and the blocks fill what
--gpu-memory-utilization leaves: total * utilization - peak.
"""

from __future__ import annotations

from typing import NamedTuple

import structlog
import torch

from executor_svc.attention import STEP_KWARG, AttentionBackend, SeqSpan, StepMetadata
from executor_svc.kv_cache import KVCache, KVCacheSpec
from executor_svc.model_loader import LoadedModel
from executor_svc.settings import ExecutorSettings, SettingsError

log = structlog.get_logger(__name__)


def forward_once(
    loaded: LoadedModel,
    attention_step: object,
    input_ids: torch.Tensor,  # [T] long
    positions: torch.Tensor,  # [T] long
    keep: torch.Tensor,  # [S] long: rows whose logits are returned
) -> torch.Tensor:  # [S, V]
    with torch.inference_mode():
        output = loaded.model(
            input_ids=input_ids[None],
            position_ids=positions[None],
            use_cache=False,
            logits_to_keep=keep,
            **{STEP_KWARG: attention_step},
        )
    return output.logits[0]


def _profile_peak_bytes(
    loaded: LoadedModel, spec: KVCacheSpec, backend: AttentionBackend, num_tokens: int
) -> int:
    """Peak device memory of one step of `num_tokens` prefill tokens (weights included)."""
    num_blocks = -(-num_tokens // spec.block_size)
    cache = KVCache.allocate(spec, num_blocks, 0, loaded.device)
    span = SeqSpan(0, num_tokens, num_tokens, tuple(range(num_blocks)))
    metadata = StepMetadata.build((span,), spec.block_size, loaded.device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(loaded.device)
    ids = torch.zeros(num_tokens, dtype=torch.long, device=loaded.device)  # [T]
    positions = torch.arange(num_tokens, device=loaded.device)  # [T]
    keep = torch.tensor([num_tokens - 1], device=loaded.device)  # [1]
    forward_once(loaded, backend.plan(metadata, cache), ids, positions, keep)
    torch.cuda.synchronize(loaded.device)
    peak = (
        int(torch.cuda.max_memory_allocated(loaded.device))
        - cache.kv.numel() * cache.kv.element_size()
    )
    del cache
    torch.cuda.empty_cache()
    return peak


class BlockCounts(NamedTuple):
    num_blocks: int  # on the device
    num_cpu_blocks: int  # on the CPU: swap space, then the CPU tier
    num_cpu_cache_blocks: int  # of num_cpu_blocks, the prefix cache's CPU tier


def count_blocks(
    settings: ExecutorSettings,
    loaded: LoadedModel,
    spec: KVCacheSpec,
    backend: AttentionBackend,
    max_model_len: int,
) -> BlockCounts:
    """Device blocks and CPU blocks for these settings."""
    num_cpu_cache_blocks = spec.blocks_for(int(settings.cpu_cache_space * 2**30))
    if settings.cpu_cache_space > 0 and num_cpu_cache_blocks < 1:
        raise SettingsError(
            f"--cpu-cache-space {settings.cpu_cache_space:g} GiB holds no block of "
            f"{spec.bytes_per_block} bytes: raise it, or 0 for no CPU tier"
        )
    num_cpu_blocks = spec.blocks_for(int(settings.swap_space * 2**30)) + num_cpu_cache_blocks
    if settings.num_blocks is not None:
        return BlockCounts(settings.num_blocks, num_cpu_blocks, num_cpu_cache_blocks)
    if loaded.device.type == "cuda":
        num_tokens = min(settings.max_num_batched_tokens, max_model_len)
        peak = _profile_peak_bytes(loaded, spec, backend, num_tokens)
        total = torch.cuda.get_device_properties(loaded.device).total_memory
        budget = int(total * settings.gpu_memory_utilization) - peak
        log.info("gpu_memory_profiled", total_bytes=total, peak_bytes=peak, kv_bytes=budget)
    else:
        budget = settings.kv_cache_memory
    num_blocks = spec.blocks_for(max(budget, 0))
    # A small model's blocks are small: past what max_num_seqs full-length sequences can hold
    # at once, more blocks only grow the allocator's pool.
    useful = settings.max_num_seqs * -(-max_model_len // spec.block_size)
    if num_blocks > useful:
        log.info("kv_blocks_capped", num_blocks=useful, budget_blocks=num_blocks)
        num_blocks = useful
    if num_blocks < 1:
        raise SettingsError(
            f"the KV budget ({budget} bytes) holds no block of {spec.bytes_per_block} bytes: "
            "raise --kv-cache-memory / --gpu-memory-utilization or lower --block-size"
        )
    return BlockCounts(num_blocks, num_cpu_blocks, num_cpu_cache_blocks)
