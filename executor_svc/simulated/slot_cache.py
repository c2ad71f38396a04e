"""The simulated KV cache: one 64-bit digest per slot (token_model.py), device and host pools.

Slots are addressed as in the real cache (slot = block_id * block_size + offset), so block
tables, copies and swaps move the same state a real KV cache would, at 8 bytes a slot
instead of 2 x layers x kv_heads x head_dim x dtype (128 KiB a token for Llama-3-8B). A slot
never written holds 0, as the real cache holds zeros.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Callable, Sequence

from executor_svc.step import BlockCopy


class SlotCache:
    def __init__(self, num_blocks: int, num_cpu_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.device = array("Q", bytes(8 * num_blocks * block_size))  # [num_blocks * block_size]
        self.host = array("Q", bytes(8 * num_cpu_blocks * block_size))  # [num_cpu_blocks * bs]

    def slot(self, block_table: Sequence[int], position: int) -> int:
        block_size = self.block_size
        return block_table[position // block_size] * block_size + position % block_size

    def read(self, block_table: Sequence[int], position: int) -> int:
        return self.device[self.slot(block_table, position)]

    def write(self, block_table: Sequence[int], position: int, digest: int) -> None:
        self.device[self.slot(block_table, position)] = digest

    def copy_blocks(self, copies: tuple[BlockCopy, ...]) -> None:
        """Device -> device. NOTE: every source is read before any destination is written."""
        _move(self.device, self.device, copies, self.block_size)

    def swap_out(self, copies: tuple[BlockCopy, ...]) -> None:
        _move(self.device, self.host, copies, self.block_size)

    def swap_in(self, copies: tuple[BlockCopy, ...]) -> None:
        _move(self.host, self.device, copies, self.block_size)


def _move(src: array[int], dst: array[int], copies: tuple[BlockCopy, ...],
          block_size: int) -> None:
    blocks = [src[c.src_block_id * block_size:(c.src_block_id + 1) * block_size]
              for c in copies]
    for copy, block in zip(copies, blocks, strict=True):
        dst[copy.dst_block_id * block_size:(copy.dst_block_id + 1) * block_size] = block


class SlotBlocks:
    """The device blocks as bytes, for KV hand-off (layout format simulated-slot-digest-v1):
    a block's block_size digests, little-endian uint64 each. Array slices are atomic under
    the GIL, and the blocks moved belong to no running step (kv_blocks.py says why)."""

    def __init__(self, cache: SlotCache, transfer_s: Callable[[int], float] | None = None
                 ) -> None:
        self.cache = cache
        # The modelled time to move n blocks between two executors (None: none), which an
        # import sleeps before writing them: a hand-off costs what the real KV would.
        self._transfer_s = transfer_s

    def transfer_s(self, num_blocks: int) -> float:
        return self._transfer_s(num_blocks) if self._transfer_s is not None else 0.0

    def read(self, block_ids: Sequence[int]) -> list[bytes]:
        size, device, out = self.cache.block_size, self.cache.device, []
        for block_id in block_ids:
            block = device[block_id * size:(block_id + 1) * size]
            if sys.byteorder != "little":
                block.byteswap()
            out.append(block.tobytes())
        return out

    def write(self, block_ids: Sequence[int], data: Sequence[bytes]) -> None:
        size, device = self.cache.block_size, self.cache.device
        for block_id, raw in zip(block_ids, data, strict=True):
            block = array("Q")
            block.frombytes(raw)
            if sys.byteorder != "little":
                block.byteswap()
            device[block_id * size:(block_id + 1) * size] = block
