"""How many KV blocks fit: the CPU budget (--kv-cache-memory) or a profiled GPU budget.

On CUDA, the weights are loaded first; then the largest step (max_num_batched_tokens tokens in
sequences of at most max_model_len, max_num_seqs rows sampled) runs once to measure its
transient peak, and the blocks fill
what --gpu-memory-utilization leaves: total * utilization - (total - free) - peak, where
total - free (the driver's count) holds the CUDA context, the weights, what is not torch's and
other processes' memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import structlog
import torch

from executor_svc.attention import STEP_KWARG, AttentionBackend, SeqSpan, plan_step
from executor_svc.kv_cache import KVCache, KVCacheSpec
from executor_svc.model_loader import LoadedModel
from executor_svc.sampler import Sampler
from executor_svc.settings import ExecutorSettings, SettingsError
from executor_svc.step import SamplingParams

log = structlog.get_logger(__name__)


def forward_once(
    loaded: LoadedModel,
    attention_step: object,
    input_ids: torch.Tensor,  # [T] long
    positions: torch.Tensor,  # [T] long
    keep: torch.Tensor,  # [S] long: rows whose logits are returned
    whole_model: bool = False,  # through transformers' forward, its hooks included
) -> torch.Tensor:  # [S, V]
    if loaded.layer_loop is not None and not whole_model:
        return loaded.layer_loop(attention_step, input_ids, positions, keep)
    with torch.inference_mode():
        output = loaded.model(
            input_ids=input_ids[None],
            position_ids=positions[None],
            use_cache=False,
            logits_to_keep=keep,
            **{STEP_KWARG: attention_step},
        )
    return output.logits[0]


@dataclass(frozen=True, slots=True)
class GpuMemoryProfile:
    """What the device holds once the weights are loaded and the largest step has run."""

    total_bytes: int  # the device's memory
    used_bytes: int  # total - free (mem_get_info): CUDA context, weights, other processes
    step_peak_bytes: int  # the largest step's transient peak over what stays allocated

    def kv_budget_bytes(self, utilization: float) -> int:
        """The pool fills the device up to `utilization` of its total, counting everything
        already there and the room the largest step needs while it runs."""
        return int(self.total_bytes * utilization) - self.used_bytes - self.step_peak_bytes


def profile_spans(num_tokens: int, max_model_len: int, block_size: int) -> tuple[SeqSpan, ...]:
    """Fresh prompts of at most max_model_len tokens filling num_tokens, on blocks 0, 1, ..."""
    spans: list[SeqSpan] = []
    start = next_block = 0
    while start < num_tokens:
        length = min(max_model_len, num_tokens - start)
        blocks = -(-length // block_size)
        spans.append(SeqSpan(start, length, length, tuple(range(next_block, next_block + blocks))))
        start, next_block = start + length, next_block + blocks
    return tuple(spans)


def profile_gpu_memory(
    loaded: LoadedModel,
    spec: KVCacheSpec,
    backend: AttentionBackend,
    num_tokens: int,
    num_seqs: int,
    max_model_len: int,
    max_draft_tokens: int = 0,
) -> GpuMemoryProfile:
    """Run the largest step: `num_tokens` prefill tokens in sequences of at most
    `max_model_len`, whose last rows keep their logits, as many as `num_seqs` sequences
    verifying `max_draft_tokens` drafts each could ask (`num_seqs` of them sampled: the
    logits of the largest batch, then the sampler's top-logprobs pass).

    NOTE: the torch backend's decode gather buffer (the reference path on CUDA) grows with the
    largest decode group, which no prefill shows: on CUDA serve with --backend flashinfer.
    """
    device = loaded.device
    spans = profile_spans(num_tokens, max_model_len, spec.block_size)
    lengths = [span.query_len for span in spans]
    num_blocks = sum(len(span.block_ids) for span in spans)
    cache = KVCache.allocate(spec, num_blocks, 0, device)
    num_rows = min(num_seqs, num_tokens)
    # Logits rows kept: one per sampled row, and one per draft token a step may verify.
    num_kept = min(num_seqs * (1 + max_draft_tokens), num_tokens)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    resident = torch.cuda.memory_allocated(device)
    ids = torch.zeros(num_tokens, dtype=torch.long, device=device)  # [T]
    positions = torch.cat([torch.arange(n, device=device) for n in lengths])  # [T]
    keep = torch.arange(num_tokens - num_kept, num_tokens, device=device)  # [K]
    attention = plan_step(backend, spans, spec.block_size, cache, loaded.attention_shape)
    logits = forward_once(loaded, attention, ids, positions, keep)  # [K, V]
    params = SamplingParams(temperature=1.0, top_p=0.9, top_logprobs=1)
    Sampler(0, device).sample(logits[:num_rows], [params] * num_rows, [None] * num_rows,
                              [None] * num_rows)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - resident
    del logits, attention, cache
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return GpuMemoryProfile(total_bytes=total, used_bytes=total - free, step_peak_bytes=peak)


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
        profile = profile_gpu_memory(loaded, spec, backend, settings.max_num_batched_tokens,
                                     settings.max_num_seqs, max_model_len,
                                     settings.max_draft_tokens)
        budget = profile.kv_budget_bytes(settings.gpu_memory_utilization)
        log.info("gpu_memory_profiled", total_bytes=profile.total_bytes,
                 used_bytes=profile.used_bytes, step_peak_bytes=profile.step_peak_bytes,
                 utilization=settings.gpu_memory_utilization, kv_bytes=budget)
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
