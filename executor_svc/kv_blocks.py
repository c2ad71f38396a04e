"""The KV cache's device blocks as bytes, for KV hand-off (kv_handoff.py): one block is
`kv[:, :, block_id]`, [layers, 2 (key, value), block_size, Hkv, D], contiguous, its raw
bytes (bfloat16 through a uint8 view).

`read` runs in the transfer thread while steps run in the compute thread: the blocks it
reads belong to a parked request no step writes (ExportKV). `write` runs in the compute
thread, between steps, in Execute order (ImportKV): the blocks it writes were reserved after
the Step that freed them, whose Execute may still write or copy them.

NOTE: on CPU it goes through a numpy view of the cache, no torch op: a torch op in a second
thread gives OpenMP a second thread team, and every step slows down (compute_thread.py). On
CUDA it uses a stream of its own, synchronised before it returns. That stream first waits for
the work queued on the steps' stream so far (the runner does not wait for its steps: a read
must see the blocks the last step wrote, a write must land after the Step that freed its
blocks has copied them); the steps queued after the write returns come after it anyway.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from executor_svc.kv_cache import KVCache


class TorchKVBlocks:
    def __init__(self, cache: KVCache) -> None:
        self.cache = cache
        on_cpu = cache.kv.device.type == "cpu"
        # [L, 2, num_blocks, block_size, Hkv, D * element size]: the cache's own memory
        self._host = cache.kv.view(torch.uint8).numpy() if on_cpu else None
        self._stream = None if on_cpu else torch.cuda.Stream(cache.kv.device)

    def transfer_s(self, num_blocks: int) -> float:
        return 0.0  # the real transfer is its own time

    def read(self, block_ids: Sequence[int]) -> list[bytes]:
        if self._host is not None:
            return [self._host[:, :, b].tobytes() for b in block_ids]  # a C-order copy each
        assert self._stream is not None
        kv = self.cache.kv
        self._stream.wait_stream(torch.cuda.default_stream(kv.device))
        with torch.cuda.stream(self._stream):
            index = torch.tensor(list(block_ids), dtype=torch.long, device=kv.device)
            blocks = kv[:, :, index].movedim(2, 0).contiguous()  # [n, L, 2, bs, Hkv, D]
            host = blocks.view(torch.uint8).cpu()  # [n, L, 2, bs, Hkv, D * element size]
        self._stream.synchronize()
        return [host[i].numpy().tobytes() for i in range(len(block_ids))]

    def write(self, block_ids: Sequence[int], data: Sequence[bytes]) -> None:
        if self._host is not None:
            host = self._host
            shape = (*host.shape[:2], *host.shape[3:])  # [L, 2, bs, Hkv, D * element size]
            for block_id, block in zip(block_ids, data, strict=True):
                host[:, :, block_id] = np.frombuffer(block, dtype=np.uint8).reshape(shape)
            return
        assert self._stream is not None
        kv = self.cache.kv
        joined = torch.frombuffer(bytearray(b"".join(data)), dtype=torch.uint8)
        shape = (len(block_ids), kv.shape[0], kv.shape[1], *kv.shape[3:])  # [n, L, 2, bs, H, D]
        self._stream.wait_stream(torch.cuda.default_stream(kv.device))
        with torch.cuda.stream(self._stream):
            blocks = joined.to(kv.device).view(kv.dtype).view(shape)
            index = torch.tensor(list(block_ids), dtype=torch.long, device=kv.device)
            kv[:, :, index] = blocks.movedim(0, 2)  # [L, 2, n, bs, Hkv, D]
        self._stream.synchronize()
