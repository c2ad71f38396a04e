"""The reference backend (CPU and GPU): gather whole blocks by block table, then SDPA.

Per layer: the step's new K/V are written into their slots first; then
- decode spans (one new token) are grouped by similar context length, and each group runs as
  one padded SDPA call over its gathered blocks (a key-padding mask hides the padding);
- prefill spans run one SDPA call each, causal with the bottom-right offset of their cached
  prefix (chunked prefill). A span with no cached prefix attends to its own new K/V directly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from executor_svc.attention.metadata import SeqSpan, StepMetadata
from executor_svc.kv_cache import KVCache

# A decode group's padded key length may exceed its real key count by this factor plus a fixed
# allowance: one more SDPA call costs about as much as a few thousand padded key positions.
PAD_FACTOR = 1.25
PAD_ALLOWANCE_TOKENS = 2048


@dataclass(frozen=True, slots=True)
class DecodeGroup:
    token_index: torch.Tensor  # [B] long: rows of the packed step
    block_index: torch.Tensor  # [B * max_blocks] long: block tables, padded with block 0
    max_blocks: int
    key_len: int  # keys each row attends over: the group's longest context
    key_mask: torch.Tensor | None  # [B, 1, 1, key_len] bool, True = attend; None: all equal


@dataclass(frozen=True, slots=True)
class PrefillSpan:
    query_start: int
    query_len: int
    context_len: int
    block_index: torch.Tensor | None  # [num_blocks] long; None: no cached prefix
    mask: torch.Tensor | None  # [query_len, context_len] bool; None: plain causal


def _decode_groups(
    spans: list[SeqSpan], block_size: int, device: torch.device
) -> list[DecodeGroup]:
    groups: list[list[SeqSpan]] = []
    real = 0  # keys the last group really holds
    for span in sorted(spans, key=lambda s: s.context_len, reverse=True):
        if groups:
            padded = (len(groups[-1]) + 1) * groups[-1][0].context_len
            if padded <= PAD_FACTOR * (real + span.context_len) + PAD_ALLOWANCE_TOKENS:
                groups[-1].append(span)
                real += span.context_len
                continue
        groups.append([span])
        real = span.context_len
    return [_decode_group(group, block_size, device) for group in groups]


def _decode_group(group: list[SeqSpan], block_size: int, device: torch.device) -> DecodeGroup:
    key_len = group[0].context_len
    max_blocks = -(-key_len // block_size)
    flat: list[int] = []
    for span in group:
        table = list(span.block_ids[:max_blocks])
        flat.extend(table + [0] * (max_blocks - len(table)))  # pad: masked out below
    mask = None
    if group[-1].context_len != key_len:
        lengths = torch.tensor([s.context_len for s in group], device=device)  # [B]
        positions = torch.arange(key_len, device=device)  # [L]
        mask = (positions[None, :] < lengths[:, None])[:, None, None, :]  # [B, 1, 1, L]
    return DecodeGroup(
        token_index=torch.tensor([s.query_start for s in group], dtype=torch.long, device=device),
        block_index=torch.tensor(flat, dtype=torch.long, device=device),
        max_blocks=max_blocks,
        key_len=key_len,
        key_mask=mask,
    )


def _prefill_span(span: SeqSpan, block_size: int, device: torch.device) -> PrefillSpan:
    if span.start_position == 0:
        return PrefillSpan(span.query_start, span.query_len, span.context_len, None, None)
    num_blocks = -(-span.context_len // block_size)
    rows = torch.arange(span.query_len, device=device)[:, None]  # [Q, 1]
    cols = torch.arange(span.context_len, device=device)[None, :]  # [1, K]
    return PrefillSpan(
        query_start=span.query_start,
        query_len=span.query_len,
        context_len=span.context_len,
        block_index=torch.tensor(span.block_ids[:num_blocks], dtype=torch.long, device=device),
        mask=cols <= rows + span.start_position,  # [Q, K] bottom-right aligned causal
    )


@dataclass(frozen=True, slots=True)
class TorchStepAttention:
    cache: KVCache
    slot_mapping: torch.Tensor  # [T] long
    decode_groups: list[DecodeGroup]
    prefill_spans: list[PrefillSpan]

    def forward(
        self,
        layer_idx: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scaling: float,
    ) -> torch.Tensor:
        key_cache, value_cache = self.cache.layer(layer_idx)  # [NB, S, Hkv, D] each
        num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
        new_k = key[0].transpose(0, 1)  # [T, Hkv, D]
        new_v = value[0].transpose(0, 1)  # [T, Hkv, D]
        flat = (num_blocks * block_size, num_kv_heads, head_dim)
        key_cache.view(flat).index_copy_(0, self.slot_mapping, new_k)
        value_cache.view(flat).index_copy_(0, self.slot_mapping, new_v)

        q = query[0].transpose(0, 1)  # [T, Hq, D]
        out = torch.empty_like(q)  # [T, Hq, D]
        num_groups = q.shape[1] // num_kv_heads  # query heads per KV head
        for group in self.decode_groups:
            # index_select: a plain block copy, several times faster than advanced indexing.
            padded = (-1, group.max_blocks * block_size, num_kv_heads, head_dim)
            k = key_cache.index_select(0, group.block_index).view(padded)  # [B, L', Hkv, D]
            v = value_cache.index_select(0, group.block_index).view(padded)  # [B, L', Hkv, D]
            k = k[:, : group.key_len].transpose(1, 2)  # [B, Hkv, L, D]
            v = v[:, : group.key_len].transpose(1, 2)  # [B, Hkv, L, D]
            # One new token per sequence: a KV head's query heads are just rows attending to
            # the same keys, so plain SDPA over [B, Hkv, G, D] is exact grouped-query attention
            # (and faster than enable_gqa, which expands K/V on CPU).
            qd = q[group.token_index].view(-1, num_kv_heads, num_groups, head_dim)  # [B, Hkv, G, D]
            o = F.scaled_dot_product_attention(
                qd, k, v, attn_mask=group.key_mask, scale=scaling
            )  # [B, Hkv, G, D]
            out[group.token_index] = o.reshape(-1, num_kv_heads * num_groups, head_dim)
        for span in self.prefill_spans:
            rows = slice(span.query_start, span.query_start + span.query_len)
            if span.block_index is None:
                k, v = new_k[rows], new_v[rows]  # [K, Hkv, D]
            else:
                k = key_cache.index_select(0, span.block_index).view(-1, num_kv_heads, head_dim)
                v = value_cache.index_select(0, span.block_index).view(-1, num_kv_heads, head_dim)
                k, v = k[: span.context_len], v[: span.context_len]  # [K, Hkv, D]
            o = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1).unsqueeze(0),  # [1, Hq, Q, D]
                k.transpose(0, 1).unsqueeze(0),  # [1, Hkv, K, D]
                v.transpose(0, 1).unsqueeze(0),  # [1, Hkv, K, D]
                attn_mask=span.mask,
                is_causal=span.mask is None,
                scale=scaling,
                enable_gqa=True,
            )  # [1, Hq, Q, D]
            out[rows] = o[0].transpose(0, 1)
        return out.unsqueeze(0)  # [1, T, Hq, D]


class TorchBackend:
    name = "torch"

    def plan(self, metadata: StepMetadata, cache: KVCache) -> TorchStepAttention:
        device = cache.device
        decode = [s for s in metadata.spans if s.query_len == 1]
        prefill = [s for s in metadata.spans if s.query_len > 1]
        return TorchStepAttention(
            cache=cache,
            slot_mapping=metadata.slot_mapping,
            decode_groups=_decode_groups(decode, metadata.block_size, device) if decode else [],
            prefill_spans=[_prefill_span(s, metadata.block_size, device) for s in prefill],
        )
