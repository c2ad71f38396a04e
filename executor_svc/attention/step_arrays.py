"""A step's small integer arrays (token ids, positions, slots, page tables), gathered on the
host and sent to the device in one copy.

On CUDA each host-to-device copy from pageable memory is a synchronous round trip, and reading
a device array back (as FlashInfer's `plan()` does with its page tables' indptr) waits for the
whole queue: so everything a step needs is built on the host first, then copied at once from
pinned memory without waiting (torch's pinned allocator keeps the buffer until the copy has
read it). On the CPU the arrays are views of one host tensor, and nothing is copied.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class DeviceArray:
    """One array of the step; its device tensor exists once the step's arrays are sent."""

    __slots__ = ("host", "dtype", "_tensor")

    def __init__(self, host: list[int], dtype: torch.dtype) -> None:
        self.host = host
        self.dtype = dtype
        self._tensor: torch.Tensor | None = None

    @property
    def tensor(self) -> torch.Tensor:
        assert self._tensor is not None, "StepArrays.send() runs before the forward reads it"
        return self._tensor


class StepArrays:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pending: list[DeviceArray] = []
        self.sent = False

    def add(self, values: Sequence[int], dtype: torch.dtype = torch.long) -> DeviceArray:
        assert dtype in (torch.long, torch.int32), dtype
        assert not self.sent, "every array of a step is added before it is sent"
        array = DeviceArray(list(values), dtype)
        self._pending.append(array)
        return array

    def send(self) -> None:
        """One host-to-device copy for every array added; int32 ones cast on the device."""
        self.sent = True
        if not self._pending:
            return
        ordered = sorted(self._pending, key=lambda a: a.dtype == torch.int32)  # int64 first
        flat = [v for array in ordered for v in array.host]
        host = torch.tensor(flat, dtype=torch.long)
        if self.device.type == "cuda":
            host = host.pin_memory()
        on_device = host.to(self.device, non_blocking=True)
        num_long = sum(len(a.host) for a in ordered if a.dtype == torch.long)
        regions = {torch.long: on_device[:num_long], torch.int32: on_device[num_long:].int()}
        offsets = {torch.long: 0, torch.int32: 0}
        for array in ordered:
            start = offsets[array.dtype]
            array._tensor = regions[array.dtype][start:start + len(array.host)]
            offsets[array.dtype] = start + len(array.host)
        self._pending.clear()
