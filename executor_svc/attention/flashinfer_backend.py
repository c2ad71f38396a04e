"""FlashInfer backend (CUDA only): paged prefill and decode kernels fed from the block tables.

Per step, `plan()` builds CSR page tables (int32 on the device) for the step's sequences:

    kv_indptr [B + 1]    kv_indices [sum(num_pages)]    kv_last_page_len [B] in 1..block_size

once for every sequence (used to append the new K/V with `append_paged_kv_cache`), and once for
each of the two subsets: decode spans (one new token) run the decode wrapper
(`use_tensor_cores=True`, right for grouped-query attention), the others the prefill wrapper
(`causal=True`, bottom-right aligned, so a chunk after a cached prefix sees the whole prefix).
The wrappers are planned at the first layer of the step (when the model's softmax scale is
known) and run once per layer. The cache is the KVCache's (k, v) pair, NHD:
`[num_blocks, block_size, Hkv, D]` each. `flashinfer` is imported here only, on demand.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from executor_svc.attention.metadata import SeqSpan, StepMetadata
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
class PageTable:
    """CSR page tables for a subset of the step's sequences."""

    rows: torch.Tensor  # [N] long: packed-row indices of this subset's new tokens
    qo_indptr: torch.Tensor  # [B + 1] int32
    kv_indptr: torch.Tensor  # [B + 1] int32
    kv_indices: torch.Tensor  # [num_pages] int32
    kv_last_page_len: torch.Tensor  # [B] int32

    @classmethod
    def build(cls, spans: list[SeqSpan], block_size: int, device: torch.device) -> PageTable:
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

        def i32(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=device)

        return cls(
            rows=torch.tensor(rows, dtype=torch.long, device=device),
            qo_indptr=i32(qo),
            kv_indptr=i32(kv),
            kv_indices=i32(indices),
            kv_last_page_len=i32(last),
        )


@dataclass(slots=True)
class FlashInferStepAttention:
    backend: FlashInferBackend
    cache: KVCache
    all_seqs: PageTable
    batch_indices: torch.Tensor  # [T] int32: sequence of each new token
    positions: torch.Tensor  # [T] int32: its position in that sequence
    decode: PageTable | None
    prefill: PageTable | None
    planned_scale: float | None = field(default=None)

    def _plan(self, scale: float, num_q_heads: int) -> None:
        spec = self.cache.spec
        common = dict(q_data_type=spec.dtype, kv_data_type=spec.dtype, sm_scale=scale)
        if self.decode is not None:
            self.backend.decode_wrapper.plan(
                self.decode.kv_indptr,
                self.decode.kv_indices,
                self.decode.kv_last_page_len,
                num_q_heads,
                spec.num_kv_heads,
                spec.head_dim,
                spec.block_size,
                **common,
            )
        if self.prefill is not None:
            self.backend.prefill_wrapper.plan(
                self.prefill.qo_indptr,
                self.prefill.kv_indptr,
                self.prefill.kv_indices,
                self.prefill.kv_last_page_len,
                num_q_heads,
                spec.num_kv_heads,
                spec.head_dim,
                spec.block_size,
                causal=True,
                **common,
            )
        self.planned_scale = scale

    def forward(
        self,
        layer_idx: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scaling: float,
    ) -> torch.Tensor:
        if self.planned_scale is None:
            self._plan(scaling, query.shape[1])
        assert self.planned_scale == scaling, "every layer of a step must share its softmax scale"
        paged = self.cache.layer(layer_idx)  # ([NB, S, Hkv, D], [NB, S, Hkv, D])
        self.backend.flashinfer.append_paged_kv_cache(
            key[0].transpose(0, 1).contiguous(),  # [T, Hkv, D]
            value[0].transpose(0, 1).contiguous(),  # [T, Hkv, D]
            self.batch_indices,
            self.positions,
            paged,
            self.all_seqs.kv_indices,
            self.all_seqs.kv_indptr,
            self.all_seqs.kv_last_page_len,
            kv_layout="NHD",
        )
        q = query[0].transpose(0, 1)  # [T, Hq, D]
        out = torch.empty_like(q)  # [T, Hq, D]
        if self.decode is not None:
            qd = q[self.decode.rows].contiguous()  # [Bd, Hq, D]
            out[self.decode.rows] = self.backend.decode_wrapper.run(qd, paged)
        if self.prefill is not None:
            qp = q[self.prefill.rows].contiguous()  # [Np, Hq, D]
            out[self.prefill.rows] = self.backend.prefill_wrapper.run(qp, paged)
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

    def plan(self, metadata: StepMetadata, cache: KVCache) -> FlashInferStepAttention:
        device, size = cache.device, metadata.block_size
        spans = list(metadata.spans)
        decode = [s for s in spans if s.query_len == 1]
        prefill = [s for s in spans if s.query_len > 1]
        batch_indices: list[int] = []
        positions: list[int] = []
        for index, span in enumerate(spans):
            batch_indices.extend([index] * span.query_len)
            positions.extend(range(span.start_position, span.context_len))
        return FlashInferStepAttention(
            backend=self,
            cache=cache,
            all_seqs=PageTable.build(spans, size, device),
            batch_indices=torch.tensor(batch_indices, dtype=torch.int32, device=device),
            positions=torch.tensor(positions, dtype=torch.int32, device=device),
            decode=PageTable.build(decode, size, device) if decode else None,
            prefill=PageTable.build(prefill, size, device) if prefill else None,
        )
