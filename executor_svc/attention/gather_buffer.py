"""A reusable scratch tensor that the torch backend gathers K/V blocks into.

On CPU, a fresh multi-megabyte tensor for every gather costs more than the copy itself: large
allocations go back to the OS when freed, so each step page-faults (and zero-fills) them anew.
One grow-only buffer, reused by every group, layer and step, avoids that; on CUDA the caching
allocator would reuse the memory anyway, so the buffer changes nothing there.
"""

from __future__ import annotations

import math

import torch


class GatherBuffer:
    """Holds one flat tensor; `gather` returns a view of it, valid until the next `gather`."""

    def __init__(self) -> None:
        self._flat: torch.Tensor | None = None

    def gather(self, layer_kv: torch.Tensor, block_index: torch.Tensor) -> torch.Tensor:
        """Keys and values of the indexed blocks: [2, NB, S, Hkv, D] -> [2, n, S, Hkv, D]."""
        shape = (2, block_index.numel(), *layer_kv.shape[2:])
        out = self._take(math.prod(shape), layer_kv).view(shape)
        # index_select: a plain block copy, several times faster than advanced indexing.
        return torch.index_select(layer_kv, 1, block_index, out=out)

    def _take(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        flat = self._flat
        if (
            flat is None
            or flat.numel() < numel
            or flat.dtype != like.dtype
            or flat.device != like.device
        ):
            # Made outside inference mode, so callers with or without it may write into it.
            with torch.inference_mode(False):
                flat = torch.empty(numel, dtype=like.dtype, device=like.device)
            self._flat = flat
        return flat[:numel]
