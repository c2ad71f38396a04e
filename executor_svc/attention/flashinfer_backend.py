"""FlashInfer backend (CUDA only): paged prefill and decode kernels fed from the block tables.

Per step, `plan()` (once, before the forward) builds CSR page tables on the host:

    kv_indptr [B + 1]    kv_indices [sum(num_pages)]    kv_last_page_len [B] in 1..block_size

for each of the two subsets: decode spans (one new token) run the decode wrapper
(`use_tensor_cores=True`, right for grouped-query attention), the others the prefill wrapper
(`causal=True`, bottom-right aligned, so a chunk after a cached prefix sees the whole prefix).
Both wrappers are planned there from pinned host tables, which they copy to the device
themselves without waiting (given device tables, `plan()` would read them back and wait for
the queue); the tables of every sequence, which `append_paged_kv_cache` writes the new K/V
through, and the rows of each subset go with the step's other arrays in its one copy
(step_arrays.py). The cache is the KVCache's (k, v) pair, NHD: `[num_blocks, block_size, Hkv,
D]` each. `flashinfer` is imported here only, on demand.

NOTE: `plan()` rewrites each wrapper's own page-locked workspace and queues its copy to the
device; that is safe because every step ends with the host waiting for its sampled tokens.
Steps planned ahead of the device (overlapped scheduling, CUDA graphs) need a wrapper, and
its buffers, per step in flight.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from executor_svc.attention.metadata import AttentionShape, SeqSpan, StepMetadata
from executor_svc.attention.step_arrays import DeviceArray, StepArrays
from executor_svc.kv_cache import KVCache

WORKSPACE_BYTES = 256 * 2**20


def _import_flashinfer() -> Any:
    try:
        import flashinfer
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise RuntimeError(
            "--backend flashinfer needs the flashinfer-python package and a CUDA device; "
            "install it with `pip install flashinfer-python` or use --backend torch"
        ) from exc
    return flashinfer


@dataclass(frozen=True, slots=True)
class HostPageTable:
    """CSR page tables for a subset of the step's sequences, as host lists."""

    rows: list[int]  # packed-row indices of this subset's new tokens
    qo_indptr: list[int]  # [B + 1]
    kv_indptr: list[int]  # [B + 1]
    kv_indices: list[int]  # [num_pages]
    kv_last_page_len: list[int]  # [B]

    @classmethod
    def build(cls, spans: list[SeqSpan], block_size: int) -> HostPageTable:
        rows: list[int] = []
        qo, kv, last = [0], [0], []
        indices: list[int] = []
        for span in spans:
            num_pages = -(-span.context_len // block_size)
            rows.extend(range(span.query_start, span.query_start + span.query_len))
            indices.extend(span.block_ids[:num_pages])
            qo.append(qo[-1] + span.query_len)
            kv.append(kv[-1] + num_pages)
            last.append(span.context_len - (num_pages - 1) * block_size)
        return cls(rows, qo, kv, indices, last)

    def pinned(self) -> tuple[torch.Tensor, ...]:
        """(qo_indptr, kv_indptr, kv_indices, kv_last_page_len): int32, pinned, for plan()."""
        return tuple(
            torch.tensor(values, dtype=torch.int32).pin_memory()
            for values in (self.qo_indptr, self.kv_indptr, self.kv_indices, self.kv_last_page_len)
        )


@dataclass(frozen=True, slots=True)
class AppendTables:
    """Where `append_paged_kv_cache` writes each new token: its sequence, its position, and
    every sequence's page table (device arrays of the step)."""

    batch_indices: DeviceArray  # [T] int32: sequence of each new token
    positions: DeviceArray  # [T] int32: its position in that sequence
    kv_indptr: DeviceArray  # [B + 1] int32
    kv_indices: DeviceArray  # [num_pages] int32
    kv_last_page_len: DeviceArray  # [B] int32

    @classmethod
    def add(cls, spans: list[SeqSpan], table: HostPageTable, arrays: StepArrays) -> AppendTables:
        batch_indices: list[int] = []
        positions: list[int] = []
        for index, span in enumerate(spans):
            batch_indices.extend([index] * span.query_len)
            positions.extend(range(span.start_position, span.context_len))
        i32 = torch.int32
        return cls(
            batch_indices=arrays.add(batch_indices, i32),
            positions=arrays.add(positions, i32),
            kv_indptr=arrays.add(table.kv_indptr, i32),
            kv_indices=arrays.add(table.kv_indices, i32),
            kv_last_page_len=arrays.add(table.kv_last_page_len, i32),
        )


@dataclass(frozen=True, slots=True)
class FlashInferStepAttention:
    backend: FlashInferBackend
    cache: KVCache
    append: AppendTables
    scale: float  # the planned softmax scale
    decode_rows: DeviceArray | None  # [Bd] long: packed rows of the decode spans
    prefill_rows: DeviceArray | None  # [Np] long: packed rows of the other spans

    def forward(
        self,
        layer_idx: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scaling: float,
    ) -> torch.Tensor:
        assert scaling == self.scale, "every layer of a step must share its planned scale"
        paged = self.cache.layer(layer_idx)  # ([NB, S, Hkv, D], [NB, S, Hkv, D])
        append = self.append
        self.backend.flashinfer.append_paged_kv_cache(
            key[0].transpose(0, 1).contiguous(),  # [T, Hkv, D]
            value[0].transpose(0, 1).contiguous(),  # [T, Hkv, D]
            append.batch_indices.tensor,
            append.positions.tensor,
            paged,
            append.kv_indices.tensor,
            append.kv_indptr.tensor,
            append.kv_last_page_len.tensor,
            kv_layout="NHD",
        )
        q = query[0].transpose(0, 1)  # [T, Hq, D]
        out = torch.empty_like(q)  # [T, Hq, D]
        for rows, wrapper in ((self.decode_rows, self.backend.decode_wrapper),
                              (self.prefill_rows, self.backend.prefill_wrapper)):
            if rows is not None:
                index = rows.tensor
                out.index_copy_(0, index, wrapper.run(q.index_select(0, index), paged))
        return out.unsqueeze(0)  # [1, T, Hq, D]


class FlashInferBackend:
    name = "flashinfer"

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise RuntimeError("--backend flashinfer runs on CUDA only; use --backend torch")
        self.flashinfer = _import_flashinfer()
        # One workspace per wrapper: both are planned before either runs.
        self.decode_wrapper = self.flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device),
            "NHD",
            use_tensor_cores=True,
        )
        self.prefill_wrapper = self.flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device), "NHD"
        )

    def plan(
        self, metadata: StepMetadata, cache: KVCache, shape: AttentionShape
    ) -> FlashInferStepAttention:
        spec, size = cache.spec, metadata.block_size
        spans = list(metadata.spans)
        decode = [s for s in spans if s.query_len == 1]
        prefill = [s for s in spans if s.query_len > 1]
        common: dict[str, Any] = dict(
            q_data_type=spec.dtype, kv_data_type=spec.dtype, sm_scale=shape.scale,
            non_blocking=True,
        )
        heads = (shape.num_q_heads, spec.num_kv_heads, spec.head_dim, spec.block_size)
        decode_rows = prefill_rows = None
        if decode:
            table = HostPageTable.build(decode, size)
            _, kv_indptr, kv_indices, last_page_len = table.pinned()
            self.decode_wrapper.plan(kv_indptr, kv_indices, last_page_len, *heads, **common)
            decode_rows = metadata.arrays.add(table.rows)
        if prefill:
            table = HostPageTable.build(prefill, size)
            self.prefill_wrapper.plan(*table.pinned(), *heads, causal=True, **common)
            prefill_rows = metadata.arrays.add(table.rows)
        return FlashInferStepAttention(
            backend=self,
            cache=cache,
            append=AppendTables.add(spans, HostPageTable.build(spans, size), metadata.arrays),
            scale=shape.scale,
            decode_rows=decode_rows,
            prefill_rows=prefill_rows,
        )
