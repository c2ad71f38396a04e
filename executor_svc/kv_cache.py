"""The paged KV cache: one device tensor for all layers, and a CPU pool for swapped-out blocks.

Layout (both pools):

    kv[layer, 0 = key | 1 = value, block_id, offset, kv_head, head_dim]

so `kv[layer, 0]` is a contiguous `[num_blocks, block_size, Hkv, D]` view: the torch backend
gathers whole blocks from it, FlashInfer reads it as an NHD paged cache (a (k, v) tuple), and a
slot (block_id * block_size + offset) indexes its `[num_blocks * block_size, Hkv, D]` view.
Block copies and swaps move a block for every layer in one indexing operation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from executor_svc.step import BlockCopy


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @classmethod
    def from_config(
        cls, config: PretrainedConfig, block_size: int, dtype: torch.dtype
    ) -> KVCacheSpec:
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        return cls(
            num_layers=int(config.num_hidden_layers),
            num_kv_heads=int(num_kv_heads),
            head_dim=int(head_dim),
            block_size=block_size,
            dtype=dtype,
        )

    @property
    def bytes_per_block(self) -> int:
        """Key and value of one block, all layers."""
        elements = self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim
        return elements * torch.empty((), dtype=self.dtype).element_size()

    @property
    def bytes_per_token_per_layer(self) -> int:
        """Key and value of one token in one layer."""
        elements = 2 * self.num_kv_heads * self.head_dim
        return elements * torch.empty((), dtype=self.dtype).element_size()

    def shape(self, num_blocks: int) -> tuple[int, ...]:
        return (self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def blocks_for(self, num_bytes: int) -> int:
        return int(num_bytes // self.bytes_per_block)


@dataclass(slots=True)
class KVCache:
    spec: KVCacheSpec
    kv: torch.Tensor  # [L, 2, num_blocks, block_size, Hkv, D] on the device
    cpu_kv: torch.Tensor  # [L, 2, num_cpu_blocks, block_size, Hkv, D] on the CPU

    @classmethod
    def allocate(
        cls, spec: KVCacheSpec, num_blocks: int, num_cpu_blocks: int, device: torch.device
    ) -> KVCache:
        # Zeros, not empty: padded attention reads masked slots, and 0 * NaN would leak.
        kv = torch.zeros(spec.shape(num_blocks), dtype=spec.dtype, device=device)
        cpu_kv = torch.zeros(
            spec.shape(num_cpu_blocks), dtype=spec.dtype, pin_memory=device.type == "cuda"
        )
        return cls(spec=spec, kv=kv, cpu_kv=cpu_kv)

    @property
    def num_blocks(self) -> int:
        return int(self.kv.shape[2])

    @property
    def num_cpu_blocks(self) -> int:
        return int(self.cpu_kv.shape[2])

    @property
    def device(self) -> torch.device:
        return self.kv.device

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(key, value) caches of one layer, each [num_blocks, block_size, Hkv, D]."""
        return self.kv[layer_idx, 0], self.kv[layer_idx, 1]

    def layer_kv(self, layer_idx: int) -> torch.Tensor:
        """Key and value caches of one layer as one [2, num_blocks, block_size, Hkv, D] view."""
        return self.kv[layer_idx]

    def copy_blocks(self, copies: tuple[BlockCopy, ...]) -> None:
        """Device -> device. NOTE: every source is read before any destination is written."""
        if not copies:
            return
        src, dst = self._indices(copies, self.device, self.device)
        self.kv[:, :, dst] = self.kv[:, :, src]

    def swap_out(self, copies: tuple[BlockCopy, ...]) -> None:
        """Device block -> CPU block."""
        if not copies:
            return
        src, dst = self._indices(copies, self.device, torch.device("cpu"))
        self.cpu_kv[:, :, dst] = self.kv[:, :, src].to("cpu")

    def swap_in(self, copies: tuple[BlockCopy, ...]) -> None:
        """CPU block -> device block."""
        if not copies:
            return
        src, dst = self._indices(copies, torch.device("cpu"), self.device)
        self.kv[:, :, dst] = self.cpu_kv[:, :, src].to(self.device, non_blocking=True)

    @staticmethod
    def _indices(
        copies: tuple[BlockCopy, ...], src_device: torch.device, dst_device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        src = torch.tensor([c.src_block_id for c in copies], dtype=torch.long, device=src_device)
        dst = torch.tensor([c.dst_block_id for c in copies], dtype=torch.long, device=dst_device)
        return src, dst
