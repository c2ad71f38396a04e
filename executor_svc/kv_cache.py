"""The paged KV cache: one device tensor for all layers, and a CPU pool for swapped-out blocks.

Layouts:

    kv[layer, 0 = key | 1 = value, block_id, offset, kv_head, head_dim]      on the device
    cpu_kv[block_id, layer, 0 = key | 1 = value, offset, kv_head, head_dim]  on the CPU

so `kv[layer, 0]` is a contiguous `[num_blocks, block_size, Hkv, D]` view: the torch backend
gathers whole blocks from it, FlashInfer reads it as an NHD paged cache (a (k, v) tuple), and a
slot (block_id * block_size + offset) indexes its `[num_blocks * block_size, Hkv, D]` view.
Device copies move a block for every layer in one indexing operation.

A CPU block is contiguous, so that on CUDA a swap is a gather into a contiguous device buffer
and one copy per run of consecutive CPU blocks, to or from pinned memory: those copies are
queued on the step's stream and the host does not wait for them. The stream orders them with
the step's kernels (a swap-out reads its blocks before the step overwrites them; a swap-in
lands before the forward reads it); a host reader of the CPU pool waits for `swapped_out` first.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field

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

    def cpu_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    def blocks_for(self, num_bytes: int) -> int:
        return int(num_bytes // self.bytes_per_block)


def page_locked(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's own memory registered with CUDA as page-locked (copies from and to it need
    not wait), unregistered when the tensor goes.

    NOTE: not `pin_memory=True`: torch's pinned allocator rounds each allocation up to a power
    of two, so 20 GiB of CPU blocks would lock 32. Where registering fails, that allocator.
    """
    cudart = torch.cuda.cudart()
    ptr, size = tensor.data_ptr(), tensor.numel() * tensor.element_size()
    try:
        error = cudart.cudaHostRegister(ptr, size, 0)
    except (AttributeError, RuntimeError):
        return tensor.pin_memory()
    if int(getattr(error, "value", error)) != 0:
        return tensor.pin_memory()
    weakref.finalize(tensor, cudart.cudaHostUnregister, ptr)
    return tensor


def runs(ids: list[int]) -> Iterator[tuple[int, int, int]]:
    """(position in ids, first id, length) of each run of consecutive ids, in order."""
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[i - 1] + 1:
            yield start, ids[start], i - start
            start = i


@dataclass(slots=True)
class KVCache:
    spec: KVCacheSpec
    kv: torch.Tensor  # [L, 2, num_blocks, block_size, Hkv, D] on the device
    cpu_kv: torch.Tensor  # [num_cpu_blocks, L, 2, block_size, Hkv, D], page-locked on CUDA
    swapped_out: torch.cuda.Event | None = field(default=None)  # CUDA: after the last swap-out

    @classmethod
    def allocate(
        cls, spec: KVCacheSpec, num_blocks: int, num_cpu_blocks: int, device: torch.device
    ) -> KVCache:
        # Zeros, not empty: padded attention reads masked slots, and 0 * NaN would leak.
        kv = torch.zeros(spec.shape(num_blocks), dtype=spec.dtype, device=device)
        cpu_kv = torch.zeros(spec.cpu_shape(num_cpu_blocks), dtype=spec.dtype)
        if device.type == "cuda" and cpu_kv.numel():
            cpu_kv = page_locked(cpu_kv)
        return cls(spec=spec, kv=kv, cpu_kv=cpu_kv)

    @property
    def num_blocks(self) -> int:
        return int(self.kv.shape[2])

    @property
    def num_cpu_blocks(self) -> int:
        return int(self.cpu_kv.shape[0])

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
        src = self._device_index([c.src_block_id for c in copies])
        dst = self._device_index([c.dst_block_id for c in copies])
        self.kv[:, :, dst] = self.kv[:, :, src]

    def swap_out(self, copies: tuple[BlockCopy, ...]) -> None:
        """Device block -> CPU block."""
        if not copies:
            return
        src = self._device_index([c.src_block_id for c in copies])
        blocks = self.kv.index_select(2, src).movedim(2, 0).contiguous()  # [n, L, 2, S, H, D]
        dst = [c.dst_block_id for c in copies]
        for at, first, length in runs(dst):
            self.cpu_kv[first:first + length].copy_(blocks[at:at + length], non_blocking=True)
        if self.device.type == "cuda":
            self.swapped_out = torch.cuda.Event()
            self.swapped_out.record()

    def swap_in(self, copies: tuple[BlockCopy, ...]) -> None:
        """CPU block -> device block."""
        if not copies:
            return
        src = [c.src_block_id for c in copies]
        blocks = torch.empty(
            self.spec.cpu_shape(len(copies)), dtype=self.spec.dtype, device=self.device
        )  # [n, L, 2, S, H, D]
        for at, first, length in runs(src):
            blocks[at:at + length].copy_(self.cpu_kv[first:first + length], non_blocking=True)
        dst = self._device_index([c.dst_block_id for c in copies])
        self.kv.index_copy_(2, dst, blocks.movedim(0, 2))

    def cpu_blocks(self) -> torch.Tensor:
        """The CPU pool, once every queued swap-out has landed (for host readers)."""
        if self.swapped_out is not None:
            self.swapped_out.synchronize()
        return self.cpu_kv

    def _device_index(self, block_ids: list[int]) -> torch.Tensor:
        index = torch.tensor(block_ids, dtype=torch.long)
        return index.pin_memory().to(self.device, non_blocking=True) if (
            self.device.type == "cuda") else index
