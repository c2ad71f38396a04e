"""The reference backend (CPU and GPU): gather whole blocks by block table, then SDPA.

Per layer: the step's new K/V are written into their slots first; then
- decode spans (one new token) are grouped by similar context length, and each group runs as
  one padded SDPA call over its gathered blocks (a key-padding mask hides the padding);
- prompts with no cached prefix are grouped by length (on CPU equal lengths, elsewhere
  similar ones) and each group runs as one causal SDPA call over their own new K/V,
  right-padded to the group's longest (exact under a causal mask: a real query row never
  sees a later, padded key);
- spans with a cached prefix (chunked prefill, prefix hits) run one at a time: on CPU as two
  unmasked flash-attention calls (over the prefix, and causal over the span's own keys)
  merged by log-sum-exp; elsewhere as one SDPA call under a bottom-right aligned causal mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from executor_svc.attention.gather_buffer import GatherBuffer
from executor_svc.attention.metadata import AttentionShape, SeqSpan, StepMetadata
from executor_svc.attention.step_arrays import DeviceArray
from executor_svc.kv_cache import KVCache

# A decode group's padded key count may exceed its real key count by this factor plus a fixed
# allowance. One more group (gather + SDPA call) costs about as much as a few hundred padded
# keys, and padded keys are read twice (gather, attention) and need a mask: so pad little.
PAD_FACTOR = 1.05
PAD_ALLOWANCE_TOKENS = 256
# Prompts without a cached prefix share one SDPA call when padding them to the longest adds at
# most (factor x their tokens + allowance), by device type. On CUDA that saves launches. On CPU
# only prompts of equal length share a call: the padding and its copies cost more than the
# calls they saved (SmolLM2 bf16, the mixed workload's prefill steps: 16% less time without;
# bench/README.md, "Fresh prompts unpadded on CPU").
FRESH_PADDING: dict[str, tuple[float, int]] = {"cpu": (1.0, 0), "cuda": (1.25, 64)}
# On CPU a group's gathered K and V stay under this size, so that SDPA reads them from the
# cache the gather just wrote.
CPU_MAX_GROUP_BYTES = 2 * 2**20
# Torch's CPU flash attention, which unlike SDPA returns each row's log-sum-exp (so two calls
# over disjoint keys can be merged) and takes fewer query heads than key heads natively.
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


@dataclass(frozen=True, slots=True)
class DecodeGroup:
    rows: slice  # the group's rows in DecodeBatch.token_index
    blocks: slice  # the group's padded block tables in DecodeBatch.block_index
    max_blocks: int
    key_len: int  # keys each row attends over: the group's longest context
    key_mask: torch.Tensor | None  # [B, 1, 1, key_len] additive: 0 attend, -inf pad; None: equal


class DecodeAttention(Protocol):
    """The step's decode rows (one new token each), attended over their cached blocks."""

    def run(
        self, layer_kv: torch.Tensor, q: torch.Tensor, out: torch.Tensor, scaling: float
    ) -> None:
        """Write each decode row's attention output into `out` ([T, Hq, D])."""
        ...


@dataclass(frozen=True, slots=True)
class DecodeBatch:
    """The step's decode spans in group order: one query gather and one output scatter per layer.

    The reference decode: gather each group's blocks, one padded SDPA call per group.
    """

    token_index: torch.Tensor  # [N] long: each decode row's index in the packed step
    block_index: torch.Tensor  # [sum of B * max_blocks] long: padded block tables
    groups: tuple[DecodeGroup, ...]
    gather: GatherBuffer  # the backend's: one step runs at a time

    def run(
        self, layer_kv: torch.Tensor, q: torch.Tensor, out: torch.Tensor, scaling: float
    ) -> None:
        """All decode rows, one gather and one SDPA call per group of similar lengths."""
        _, _, block_size, num_kv_heads, head_dim = layer_kv.shape
        num_groups = q.shape[1] // num_kv_heads  # query heads per KV head
        qd = q.index_select(0, self.token_index)  # [N, Hq, D] in group order
        outs = []
        for group in self.groups:
            # NOTE: a gather per group, not one for the whole step: SDPA then reads blocks
            # that are still in the CPU's cache (one big gather was 10% slower at batch 64).
            kv = self.gather.gather(layer_kv, self.block_index[group.blocks])
            padded = (2, -1, group.max_blocks * block_size, num_kv_heads, head_dim)
            kv = kv.view(padded)[:, :, : group.key_len].transpose(2, 3)  # [2, B, Hkv, L, D]
            # One new token per sequence: a KV head's query heads are just rows attending to
            # the same keys, so plain SDPA over [B, Hkv, G, D] is exact grouped-query attention
            # (and faster than enable_gqa, which expands K/V on CPU).
            o = F.scaled_dot_product_attention(
                qd[group.rows].view(-1, num_kv_heads, num_groups, head_dim),  # [B, Hkv, G, D]
                kv[0],
                kv[1],
                attn_mask=group.key_mask,
                scale=scaling,
            )  # [B, Hkv, G, D]
            outs.append(o.reshape(-1, num_kv_heads * num_groups, head_dim))  # [B, Hq, D]
        out.index_copy_(0, self.token_index, torch.cat(outs) if len(outs) > 1 else outs[0])


def _gathered_keys(
    layer_kv: torch.Tensor, gather: GatherBuffer, block_index: torch.Tensor, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `length` keys and values held by the indexed blocks: two [length, Hkv, D]."""
    _, _, _, num_kv_heads, head_dim = layer_kv.shape
    kv = gather.gather(layer_kv, block_index)  # [2, n, S, Hkv, D]
    kv = kv.view(2, -1, num_kv_heads, head_dim)[:, :length]  # [2, length, Hkv, D]
    return kv[0], kv[1]


@dataclass(frozen=True, slots=True)
class MaskedPrefillSpan:
    """A span after a cached prefix, in one SDPA call over the prefix's and its own keys under
    a bottom-right aligned causal mask (the reference, and the path off CPU)."""

    query_start: int
    query_len: int
    context_len: int
    block_index: torch.Tensor  # [num_blocks] long: the blocks of the prefix and the span
    # [query_len, context_len] additive, in the model's dtype (0 attend, -inf not):
    # bottom-right aligned causal. SDPA converts a bool mask on every call (5% of the call
    # on CPU, 208 queries over 2,048 keys).
    mask: torch.Tensor

    def run(
        self, layer_kv: torch.Tensor, gather: GatherBuffer, q: torch.Tensor, new_k: torch.Tensor,
        new_v: torch.Tensor, out: torch.Tensor, scaling: float,
    ) -> None:
        rows = slice(self.query_start, self.query_start + self.query_len)
        k, v = _gathered_keys(layer_kv, gather, self.block_index, self.context_len)  # [K, Hkv, D]
        o = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1).unsqueeze(0),  # [1, Hq, Q, D]
            k.transpose(0, 1).unsqueeze(0),  # [1, Hkv, K, D]
            v.transpose(0, 1).unsqueeze(0),  # [1, Hkv, K, D]
            attn_mask=self.mask,
            scale=scaling,
            enable_gqa=True,
        )  # [1, Hq, Q, D]
        out[rows] = o[0].transpose(0, 1)


@dataclass(frozen=True, slots=True)
class SplitPrefillSpan:
    """A span after a cached prefix, on CPU: two flash-attention calls merged by their
    log-sum-exp, neither with a mask.

    - Over the prefix every query sees every key, so a KV head's query heads are just more
      rows over the same keys: one call of [Hkv, G * Q] rows, each key read once per KV head.
    - Over the span's own new K/V (from the step, not gathered) the causal mask is square, so
      it is the kernel's own `is_causal`.
    The merged rows equal one softmax over both (exact up to rounding).
    """

    query_start: int
    query_len: int
    prefix_len: int
    prefix_blocks: torch.Tensor  # [num_blocks] long: the blocks that hold the prefix

    def run(
        self, layer_kv: torch.Tensor, gather: GatherBuffer, q: torch.Tensor, new_k: torch.Tensor,
        new_v: torch.Tensor, out: torch.Tensor, scaling: float,
    ) -> None:
        flash = _FLASH_CPU
        assert flash is not None  # planned only where it exists
        num_kv_heads, head_dim = layer_kv.shape[3:]
        rows = slice(self.query_start, self.query_start + self.query_len)
        num_heads, query_len = q.shape[1], self.query_len
        k, v = _gathered_keys(layer_kv, gather, self.prefix_blocks, self.prefix_len)  # [P, Hkv, D]
        qs = q[rows]  # [Q, Hq, D]
        folded = qs.unflatten(1, (num_kv_heads, -1)).permute(1, 2, 0, 3)  # [Hkv, G, Q, D]
        o_prefix, lse_prefix = flash(
            folded.reshape(1, num_kv_heads, -1, head_dim),  # [1, Hkv, G * Q, D]
            k.transpose(0, 1).unsqueeze(0),  # [1, Hkv, P, D]
            v.transpose(0, 1).unsqueeze(0),
            scale=scaling,
        )
        o_new, lse_new = flash(
            qs.transpose(0, 1).unsqueeze(0),  # [1, Hq, Q, D]
            new_k[rows].transpose(0, 1).unsqueeze(0),  # [1, Hkv, Q, D]: GQA in the kernel
            new_v[rows].transpose(0, 1).unsqueeze(0),
            is_causal=True,
            scale=scaling,
        )
        # softmax over both key sets = the two partial outputs weighted by their shares of
        # the total exp-sum: w_prefix = 1 / (1 + exp(lse_new - lse_prefix)).
        weight = torch.sigmoid(lse_prefix.reshape(num_heads, query_len) - lse_new.reshape(
            num_heads, query_len)).unsqueeze(-1)  # [Hq, Q, 1] float32
        merged = torch.lerp(
            o_new.reshape(num_heads, query_len, head_dim).float(),
            o_prefix.reshape(num_heads, query_len, head_dim).float(),
            weight,
        )  # [Hq, Q, D]
        out[rows] = merged.transpose(0, 1)


class FreshAttention(Protocol):
    """Prompts with no cached prefix, each attending causally to its own new K/V."""

    def run(
        self, q: torch.Tensor, new_k: torch.Tensor, new_v: torch.Tensor, out: torch.Tensor,
        scaling: float,
    ) -> None:
        """q, out [T, Hq, D] and new_k, new_v [T, Hkv, D] hold the whole step's rows."""


@dataclass(frozen=True, slots=True)
class FreshPrefillGroup:
    """Prompts with no cached prefix, attended in one causal SDPA call over their new K/V."""

    count: int
    length: int  # the longest prompt's: every prompt is right-padded to it
    rows: slice | torch.Tensor  # the prompts' packed rows: a slice when back to back and equal
    padded_rows: torch.Tensor | None  # [rows] each row's index in [count * length]; None: slice

    def run(
        self, q: torch.Tensor, new_k: torch.Tensor, new_v: torch.Tensor, out: torch.Tensor,
        scaling: float,
    ) -> None:
        """q, out [T, Hq, D] and new_k, new_v [T, Hkv, D] hold the whole step's rows."""
        batch = (self.count, self.length)
        if self.padded_rows is None:  # back to back, equal: views of the packed rows
            qg, kg, vg = (t[self.rows].unflatten(0, batch) for t in (q, new_k, new_v))
        else:
            qg, kg, vg = (self._padded(t) for t in (q, new_k, new_v))
        o = F.scaled_dot_product_attention(
            qg.transpose(1, 2),  # [B, Hq, L, D]
            kg.transpose(1, 2),  # [B, Hkv, L, D]
            vg.transpose(1, 2),
            is_causal=True,
            scale=scaling,
            enable_gqa=True,
        ).transpose(1, 2)  # [B, L, Hq, D]
        if self.padded_rows is None:
            out[self.rows] = o.flatten(0, 1)
        else:
            out[self.rows] = o.flatten(0, 1).index_select(0, self.padded_rows)

    def _padded(self, t: torch.Tensor) -> torch.Tensor:  # [T, H, D] -> [B, L, H, D]
        assert self.padded_rows is not None
        padded = t.new_zeros((self.count * self.length, *t.shape[1:]))
        padded.index_copy_(0, self.padded_rows, t[self.rows])
        return padded.unflatten(0, (self.count, self.length))


def _fresh_prefill_groups(
    spans: list[SeqSpan], device: torch.device, padding: tuple[float, int]
) -> list[FreshPrefillGroup]:
    """Group prompts without a cached prefix, longest first, while padding stays within
    `padding` (factor, allowance)."""
    factor, allowance = padding
    groups: list[list[SeqSpan]] = []
    real = 0
    for span in sorted(spans, key=lambda s: s.query_len, reverse=True):
        if groups:
            padded = (len(groups[-1]) + 1) * groups[-1][0].query_len
            if padded <= factor * (real + span.query_len) + allowance:
                groups[-1].append(span)
                real += span.query_len
                continue
        groups.append([span])
        real = span.query_len
    return [_fresh_group(group, device) for group in groups]


def _fresh_group(group: list[SeqSpan], device: torch.device) -> FreshPrefillGroup:
    length = group[0].query_len
    in_order = sorted(group, key=lambda s: s.query_start)
    first = in_order[0].query_start
    if all(s.query_len == length for s in group) and all(
        s.query_start == first + i * length for i, s in enumerate(in_order)
    ):
        rows = slice(first, first + len(group) * length)
        return FreshPrefillGroup(len(group), length, rows, None)
    packed: list[int] = []
    padded: list[int] = []
    for i, span in enumerate(in_order):
        packed.extend(range(span.query_start, span.query_start + span.query_len))
        padded.extend(range(i * length, i * length + span.query_len))
    return FreshPrefillGroup(
        count=len(group),
        length=length,
        rows=torch.tensor(packed, dtype=torch.long, device=device),
        padded_rows=torch.tensor(padded, dtype=torch.long, device=device),
    )


def _group_by_length(spans: list[SeqSpan], max_keys: int | None) -> list[list[SeqSpan]]:
    groups: list[list[SeqSpan]] = []
    real = 0  # keys the last group really holds
    for span in sorted(spans, key=lambda s: s.context_len, reverse=True):
        if groups:
            padded = (len(groups[-1]) + 1) * groups[-1][0].context_len
            fits = max_keys is None or padded <= max_keys
            if fits and padded <= PAD_FACTOR * (real + span.context_len) + PAD_ALLOWANCE_TOKENS:
                groups[-1].append(span)
                real += span.context_len
                continue
        groups.append([span])
        real = span.context_len
    return groups


def _decode_batch(
    spans: list[SeqSpan],
    block_size: int,
    max_keys: int | None,  # padded keys per group; None: no limit
    dtype: torch.dtype,
    device: torch.device,
    gather: GatherBuffer | None = None,
) -> DecodeBatch:
    rows: list[int] = []
    flat: list[int] = []
    groups: list[DecodeGroup] = []
    for group in _group_by_length(spans, max_keys):
        key_len = group[0].context_len
        max_blocks = -(-key_len // block_size)
        first_row, first_block = len(rows), len(flat)
        for span in group:
            table = list(span.block_ids[:max_blocks])
            flat.extend(table + [0] * (max_blocks - len(table)))  # pad: masked out below
            rows.append(span.query_start)
        mask = None
        if group[-1].context_len != key_len:
            lengths = torch.tensor([s.context_len for s in group], device=device)  # [B]
            positions = torch.arange(key_len, device=device)  # [L]
            pad = positions[None, :] >= lengths[:, None]  # [B, L]
            # Additive, in the model's dtype: SDPA would otherwise convert a bool mask per call.
            mask = torch.zeros(pad.shape, dtype=dtype, device=device).masked_fill_(
                pad, float("-inf")
            )[:, None, None, :]  # [B, 1, 1, L]
        groups.append(
            DecodeGroup(
                rows=slice(first_row, len(rows)),
                blocks=slice(first_block, len(flat)),
                max_blocks=max_blocks,
                key_len=key_len,
                key_mask=mask,
            )
        )
    return DecodeBatch(
        token_index=torch.tensor(rows, dtype=torch.long, device=device),
        block_index=torch.tensor(flat, dtype=torch.long, device=device),
        groups=tuple(groups),
        gather=gather or GatherBuffer(),
    )


def _prefill_span(
    span: SeqSpan, block_size: int, dtype: torch.dtype, device: torch.device, split: bool
) -> MaskedPrefillSpan | SplitPrefillSpan:
    """A span after a cached prefix: its queries attend over the prefix's blocks too."""
    if split:
        prefix_blocks = -(-span.start_position // block_size)
        return SplitPrefillSpan(
            query_start=span.query_start,
            query_len=span.query_len,
            prefix_len=span.start_position,
            prefix_blocks=torch.tensor(span.block_ids[:prefix_blocks], dtype=torch.long),
        )
    num_blocks = -(-span.context_len // block_size)
    rows = torch.arange(span.query_len, device=device)[:, None]  # [Q, 1]
    cols = torch.arange(span.context_len, device=device)[None, :]  # [1, K]
    future = cols > rows + span.start_position  # [Q, K] past the bottom-right diagonal
    return MaskedPrefillSpan(
        query_start=span.query_start,
        query_len=span.query_len,
        context_len=span.context_len,
        block_index=torch.tensor(span.block_ids[:num_blocks], dtype=torch.long, device=device),
        mask=torch.zeros(future.shape, dtype=dtype, device=device).masked_fill_(
            future, float("-inf")),
    )


@dataclass(frozen=True, slots=True)
class TorchStepAttention:
    cache: KVCache
    gather: GatherBuffer  # the backend's: one step runs at a time
    slot_mapping: DeviceArray  # [T] long
    decode: DecodeAttention | None
    fresh_prefills: list[FreshAttention]
    prefill_spans: list[MaskedPrefillSpan | SplitPrefillSpan]

    def forward(
        self,
        layer_idx: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scaling: float,
    ) -> torch.Tensor:
        layer_kv = self.cache.layer_kv(layer_idx)  # [2, NB, S, Hkv, D]
        _, num_blocks, block_size, num_kv_heads, head_dim = layer_kv.shape
        new_k = key[0].transpose(0, 1)  # [T, Hkv, D]
        new_v = value[0].transpose(0, 1)  # [T, Hkv, D]
        flat = (num_blocks * block_size, num_kv_heads, head_dim)
        slots = self.slot_mapping.tensor
        layer_kv[0].view(flat).index_copy_(0, slots, new_k)
        layer_kv[1].view(flat).index_copy_(0, slots, new_v)

        q = query[0].transpose(0, 1)  # [T, Hq, D]
        out = q.new_empty(q.shape)  # [T, Hq, D] contiguous: the caller reshapes it to [T, Hq * D]
        if self.decode is not None:
            self.decode.run(layer_kv, q, out, scaling)
        for group in self.fresh_prefills:
            group.run(q, new_k, new_v, out, scaling)
        for span in self.prefill_spans:
            span.run(layer_kv, self.gather, q, new_k, new_v, out, scaling)
        return out.unsqueeze(0)  # [1, T, Hq, D]


class TorchBackend:
    name = "torch"

    def __init__(self) -> None:
        self.gather = GatherBuffer()

    def plan(
        self, metadata: StepMetadata, cache: KVCache, shape: AttentionShape | None = None
    ) -> TorchStepAttention:
        """`shape` is not needed: SDPA takes the scale per call."""
        decode = [s for s in metadata.spans if s.query_len == 1]
        fresh = [s for s in metadata.spans if s.query_len > 1 and s.start_position == 0]
        after_prefix = [s for s in metadata.spans if s.query_len > 1 and s.start_position > 0]
        split = cache.device.type == "cpu" and _FLASH_CPU is not None
        return TorchStepAttention(
            cache=cache,
            gather=self.gather,
            slot_mapping=metadata.slot_mapping,
            decode=self.plan_decode(decode, metadata.block_size, cache) if decode else None,
            fresh_prefills=self.plan_fresh(fresh, cache) if fresh else [],
            prefill_spans=[
                _prefill_span(s, metadata.block_size, cache.spec.dtype, cache.device, split)
                for s in after_prefix
            ],
        )

    def plan_fresh(self, spans: list[SeqSpan], cache: KVCache) -> list[FreshAttention]:
        padding = FRESH_PADDING.get(cache.device.type, FRESH_PADDING["cuda"])
        return list(_fresh_prefill_groups(spans, cache.device, padding))

    def plan_decode(
        self, spans: list[SeqSpan], block_size: int, cache: KVCache
    ) -> DecodeAttention:
        max_keys = None  # on CUDA fewer, larger SDPA calls win
        if cache.device.type == "cpu":
            max_keys = CPU_MAX_GROUP_BYTES // cache.spec.bytes_per_token_per_layer
        return _decode_batch(
            spans, block_size, max_keys, cache.spec.dtype, cache.device, self.gather
        )
