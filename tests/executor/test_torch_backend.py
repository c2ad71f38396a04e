"""The torch reference backend: decode grouping, and a batch that splits into groups."""

from __future__ import annotations

from collections.abc import Callable

import torch

from executor_svc.attention import SeqSpan
from executor_svc.attention.torch_backend import _decode_batch
from executor_svc.runner import ModelRunner

from .oracle import Driver, random_prompts, reference_generate, reference_model


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
