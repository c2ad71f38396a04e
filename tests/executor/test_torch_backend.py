"""The torch reference backend: decode grouping, a batch that splits into groups, prompts
without a cached prefix grouped into one causal call, and spans after a cached prefix."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from executor_svc.attention import SeqSpan
from executor_svc.attention.gather_buffer import GatherBuffer
from executor_svc.attention.torch_backend import (
    FRESH_PADDING,
    MaskedPrefillSpan,
    SplitPrefillSpan,
    _decode_batch,
    _fresh_group,
    _fresh_prefill_groups,
    _prefill_span,
)
from executor_svc.runner import ModelRunner

from .oracle import Driver, random_prompts, reference_generate, reference_model

CPU = torch.device("cpu")


def _span(row: int, context_len: int) -> SeqSpan:
    return SeqSpan(row, 1, context_len, tuple(range(100 + row * 200, 100 + row * 200 + 200)))


def test_torch_backend_groups_decode_spans_by_similar_length() -> None:
    # Contexts 4000, 3900 share a group; the eight 20-token rows get their own (padding them
    # to 4000 would waste far more than one more SDPA call costs); masks only where unequal.
    spans = [_span(0, 4000), *(_span(i, 20) for i in range(1, 9)), _span(9, 3900)]
    batch = _decode_batch(spans, 16, None, torch.float32, torch.device("cpu"))
    assert batch.token_index.tolist() == [0, 9, 1, 2, 3, 4, 5, 6, 7, 8]
    groups = batch.groups
    assert [(g.rows, g.blocks) for g in groups] == [
        (slice(0, 2), slice(0, 500)),
        (slice(2, 10), slice(500, 516)),
    ]
    assert [(g.key_len, g.max_blocks) for g in groups] == [(4000, 250), (20, 2)]
    assert groups[0].key_mask is not None and groups[1].key_mask is None
    assert (groups[0].key_mask[1, 0, 0] == 0).sum().item() == 3900  # additive: 0 attends
    assert groups[0].key_mask[1, 0, 0, 3900:].eq(float("-inf")).all()
    assert batch.block_index.tolist()[500:504] == [300, 301, 500, 501]


def test_torch_backend_split_decode_groups_match_generate(
    make_runner: Callable[..., ModelRunner],
) -> None:
    # One 1,500-token prompt with seven short ones: two decode groups, same tokens as generate.
    runner = make_runner("tiny-llama", num_blocks=512, backend="torch")
    reference = reference_model(runner)
    prompts = random_prompts(runner.info.vocab_size, [1500, 3, 5, 8, 9, 4, 6, 7], seed=12)
    got = Driver.scattered(runner).generate({f"r{i}": p for i, p in enumerate(prompts)}, 6)
    for i, prompt in enumerate(prompts):
        assert got[f"r{i}"] == reference_generate(reference, prompt, 6), f"prompt {i}"


def test_torch_backend_decode_groups_stay_under_the_key_limit() -> None:
    # Six equal 1,000-token contexts with at most 2,500 keys per group: groups of 2, 2, 2.
    spans = [_span(i, 1000) for i in range(6)]
    batch = _decode_batch(spans, 16, 2500, torch.float32, torch.device("cpu"))
    assert [g.rows for g in batch.groups] == [slice(0, 2), slice(2, 4), slice(4, 6)]
    assert all(g.key_mask is None for g in batch.groups)


def _fresh(row: int, length: int) -> SeqSpan:
    return SeqSpan(row, length, length, tuple(range(64)))


PADDED = FRESH_PADDING["cuda"]


def test_fresh_prompts_group_by_length_and_equal_back_to_back_ones_are_views() -> None:
    equal = _fresh_prefill_groups([_fresh(0, 8), _fresh(8, 8), _fresh(16, 8)], CPU, PADDED)
    assert [(g.count, g.length, g.rows, g.padded_rows) for g in equal] == [
        (3, 8, slice(0, 24), None)
    ]
    # 300 and 280 pad to 600 (real 580): one group; a 10-token prompt padded to 300 would not
    # join them (900 padded against 590 real), so the three short ones make their own.
    spans = [_fresh(0, 10), _fresh(10, 300), _fresh(310, 10), _fresh(320, 280), _fresh(600, 10)]
    groups = _fresh_prefill_groups(spans, CPU, PADDED)
    assert [(g.count, g.length) for g in groups] == [(2, 300), (3, 10)]
    long_rows = groups[0].rows
    assert isinstance(long_rows, torch.Tensor) and groups[0].padded_rows is not None
    assert long_rows.tolist() == [*range(10, 310), *range(320, 600)]
    assert groups[0].padded_rows.tolist() == [*range(0, 300), *range(300, 580)]
    assert groups[1].rows.tolist() == [*range(0, 10), *range(310, 320), *range(600, 610)]
    # On CPU only equal lengths share a call: no padding.
    cpu_groups = _fresh_prefill_groups(spans, CPU, FRESH_PADDING["cpu"])
    assert [(g.count, g.length) for g in cpu_groups] == [(1, 300), (1, 280), (3, 10)]
    assert all(g.count * g.length == sum(
        s.query_len for s in spans if s.query_len == g.length) for g in cpu_groups)


def test_fresh_prompt_groups_equal_one_causal_call_per_prompt() -> None:
    # Packed rows: a decode row, prompts of 7, 5 and 7 tokens, another decode row. Every way
    # of grouping them gives each prompt's rows what its own causal SDPA call gives.
    gen = torch.Generator().manual_seed(3)
    lengths, starts = [7, 5, 7], [1, 8, 13]
    total, heads, kv_heads, dim = 21, 6, 2, 16
    q = torch.randn(total, heads, dim, generator=gen)
    k = torch.randn(total, kv_heads, dim, generator=gen)
    v = torch.randn(total, kv_heads, dim, generator=gen)
    want = torch.zeros(total, heads, dim)
    for start, n in zip(starts, lengths, strict=True):
        rows = slice(start, start + n)
        want[rows] = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1)[None], k[rows].transpose(0, 1)[None],
            v[rows].transpose(0, 1)[None], is_causal=True, scale=0.3, enable_gqa=True,
        )[0].transpose(0, 1)
    spans = [_fresh(s, n) for s, n in zip(starts, lengths, strict=True)]
    for groups in (_fresh_prefill_groups(spans, CPU, PADDED),
                   _fresh_prefill_groups(spans, CPU, FRESH_PADDING["cpu"]),
                   [_fresh_group(spans, CPU)]):
        got = torch.zeros(total, heads, dim)
        for group in groups:
            group.run(q, k, v, got, 0.3)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # Equal prompts back to back: the view path.
    got = torch.zeros(total, heads, dim)
    _fresh_group([_fresh(1, 7), _fresh(8, 7)], CPU).run(q, k, v, got, 0.3)
    for start in (1, 8):
        rows = slice(start, start + 7)
        ref = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1)[None], k[rows].transpose(0, 1)[None],
            v[rows].transpose(0, 1)[None], is_causal=True, scale=0.3, enable_gqa=True,
        )[0].transpose(0, 1)
        torch.testing.assert_close(got[rows], ref, rtol=1e-5, atol=1e-6)


def _attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
                         scale: float) -> torch.Tensor:
    """Bottom-right causal GQA attention in float64, spelled out: q [Q, Hq, D], k/v [K, Hkv, D]."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(group, 1).transpose(0, 1) for t in (k, v))  # [Hq, K, D]
    scores = q.double().transpose(0, 1) @ k.transpose(1, 2) * scale  # [Hq, Q, K]
    future = torch.arange(k.shape[1])[None, :] > torch.arange(q.shape[0])[:, None] + start
    probs = scores.masked_fill(future, float("-inf")).softmax(-1)
    return (probs @ v).transpose(0, 1)  # [Q, Hq, D]


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
def test_spans_after_a_cached_prefix_equal_one_softmax_over_all_their_keys(
    dtype: torch.dtype, tolerance: float
) -> None:
    # Three spans in one packed step after prefixes that end mid-block, on a block boundary
    # and after one block; blocks scattered through the cache. Both span kinds (the split
    # one CPU plans, the masked one other devices plan) against float64 attention over the
    # same (rounded) inputs.
    gen = torch.Generator().manual_seed(11)
    block, heads, kv_heads, dim, scale = 4, 6, 2, 8, 0.35
    layer_kv = torch.randn(2, 40, block, kv_heads, dim, generator=gen).to(dtype)
    spans_spec = [(13, 5), (8, 7), (4, 2)]  # (cached prefix, new tokens)
    total = sum(n for _, n in spans_spec) + 1  # one more packed row, not a span's
    q = torch.randn(total, heads, dim, generator=gen).to(dtype)
    new_k = torch.zeros(total, kv_heads, dim, dtype=dtype)
    new_v = torch.zeros(total, kv_heads, dim, dtype=dtype)
    free = torch.randperm(40, generator=gen).tolist()
    row, spans, wants = 1, [], []
    for prefix, new in spans_spec:
        blocks = tuple(free.pop() for _ in range(-(-(prefix + new) // block)))
        flat = layer_kv.view(2, -1, kv_heads, dim)
        slots = torch.tensor([blocks[p // block] * block + p % block
                              for p in range(prefix + new)])
        k, v = flat[0, slots], flat[1, slots]  # the sequence's keys, cached and new
        new_k[row:row + new], new_v[row:row + new] = k[prefix:], v[prefix:]
        spans.append(SeqSpan(row, new, prefix + new, blocks))
        wants.append((slice(row, row + new), _attention_reference(
            q[row:row + new], k, v, prefix, scale)))
        row += new
    split = [_prefill_span(s, block, dtype, CPU, split=True) for s in spans]
    masked = [_prefill_span(s, block, dtype, CPU, split=False) for s in spans]
    assert all(isinstance(p, SplitPrefillSpan) for p in split)
    assert all(isinstance(p, MaskedPrefillSpan) for p in masked)
    for kind in (split, masked):
        out = torch.full((total, heads, dim), 7.0, dtype=dtype)
        for span in kind:
            span.run(layer_kv, GatherBuffer(), q, new_k, new_v, out, scale)
        for rows, want in wants:
            torch.testing.assert_close(out[rows].double(), want, rtol=tolerance * 10,
                                       atol=tolerance)
        assert torch.equal(out[0], torch.full((heads, dim), 7.0, dtype=dtype))  # untouched
