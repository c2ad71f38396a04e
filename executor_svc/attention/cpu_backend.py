"""The CPU backend: the torch reference, with decode rows run by a C++ kernel (csrc/).

The reference decode gathers every sequence's blocks into a scratch tensor and runs SDPA over
it: each cached K/V is read, written and read again, and neither step used the second core
(SmolLM2-135M, 64 sequences at ~165 tokens: 3.4 ms a layer on one thread, 3.3 on two). The
kernel reads the blocks in place, once, on torch's threads (a task per sequence, or per KV
head when sequences are fewer than two per thread): 1.3 ms a layer on one thread and 0.7 on
two with the blocks in L3; inside the model, where each layer's K/V come from DRAM, about 2.3
and 1.3 (executor_svc/README.md).
Prompts with no cached prefix go to another kernel (prefill_attention.cpp), all of a step's
in one call over their packed rows: torch's CPU flash attention took 1.3-2x its time for
SmolLM2's prompts of 128-2,048 tokens on an AMD EPYC (bench.prefill_attention), but on CPUs
with AMX it computes bf16 on the tiles, which the kernel does not use: there bf16 prompts keep
it until measured. Spans after a cached prefix take the torch backend's path.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from executor_svc.attention.metadata import SeqSpan
from executor_svc.attention.torch_backend import DecodeAttention, FreshAttention, TorchBackend
from executor_svc.kv_cache import KVCache

# bfloat16 elements are widened to float32; every sum runs in float32.
KERNEL_DTYPES = (torch.float32, torch.bfloat16)
PREFILL_HEAD_DIMS = (64, 128)  # what prefill_attention.cpp is compiled for


def prefill_kernel_dtypes() -> tuple[torch.dtype, ...]:
    """The dtypes whose fresh prompts the kernel attends here (not bf16 where AMX serves)."""
    if torch.cpu._is_amx_tile_supported():
        return (torch.float32,)
    return KERNEL_DTYPES


@dataclass(frozen=True, slots=True)
class KernelFreshPrefill:
    kernel: ModuleType
    starts: torch.Tensor  # [P] long: each prompt's first row in the packed step
    lengths: torch.Tensor  # [P] long

    def run(
        self, q: torch.Tensor, new_k: torch.Tensor, new_v: torch.Tensor, out: torch.Tensor,
        scaling: float,
    ) -> None:
        self.kernel.prefill_attention(out, q, new_k, new_v, self.starts, self.lengths, scaling)


@dataclass(frozen=True, slots=True)
class KernelDecode:
    kernel: ModuleType
    token_index: torch.Tensor  # [N] long: each decode row's index in the packed step
    block_tables: torch.Tensor  # [N, max_blocks] int32, padded with block 0 (never read)
    context_lens: torch.Tensor  # [N] int32

    def run(
        self, layer_kv: torch.Tensor, q: torch.Tensor, out: torch.Tensor, scaling: float
    ) -> None:
        # q [T, Hq, D] is a transposed view of the model's [Hq, T, D]: the kernel reads it
        # (and writes out) by stride, so no row is copied on the way in or out.
        self.kernel.paged_decode_attention(
            out, q, self.token_index, layer_kv[0], layer_kv[1], self.block_tables,
            self.context_lens, scaling,
        )


class CpuBackend(TorchBackend):
    name = "cpu"

    def __init__(self, kernel: ModuleType,
                 prefill_dtypes: tuple[torch.dtype, ...] | None = None) -> None:
        super().__init__()
        self.kernel = kernel
        self.prefill_dtypes = prefill_kernel_dtypes() if prefill_dtypes is None else prefill_dtypes

    def plan_fresh(self, spans: list[SeqSpan], cache: KVCache) -> list[FreshAttention]:
        spec = cache.spec
        if spec.dtype not in self.prefill_dtypes or spec.head_dim not in PREFILL_HEAD_DIMS:
            return super().plan_fresh(spans, cache)
        return [KernelFreshPrefill(
            kernel=self.kernel,
            starts=torch.tensor([s.query_start for s in spans], dtype=torch.long),
            lengths=torch.tensor([s.query_len for s in spans], dtype=torch.long),
        )]

    def plan_decode(
        self, spans: list[SeqSpan], block_size: int, cache: KVCache
    ) -> DecodeAttention:
        if cache.spec.dtype not in KERNEL_DTYPES:
            return super().plan_decode(spans, block_size, cache)
        max_blocks = max(-(-s.context_len // block_size) for s in spans)
        tables = [list(s.block_ids[:max_blocks]) for s in spans]
        tables = [table + [0] * (max_blocks - len(table)) for table in tables]
        return KernelDecode(
            kernel=self.kernel,
            token_index=torch.tensor([s.query_start for s in spans], dtype=torch.long),
            block_tables=torch.tensor(tables, dtype=torch.int32),  # [N, max_blocks]
            context_lens=torch.tensor([s.context_len for s in spans], dtype=torch.int32),
        )
