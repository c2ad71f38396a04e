"""FlashInfer against the torch reference: page tables on CPU, kernels where CUDA exists.

GPU tests skip with a message where no CUDA device is present. On a CUDA machine with
flashinfer installed: `.venv/bin/python -m pytest -q -m gpu tests/executor`.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from executor_svc.attention import SeqSpan, StepArrays, StepMetadata
from executor_svc.attention.flashinfer_backend import AppendTables, HostPageTable
from executor_svc.runner import ModelRunner
from executor_svc.step import StepRequest

from .oracle import Driver, random_prompts

GPU_SKIP = (
    "no CUDA device here (torch.cuda.is_available() is False); run on a CUDA machine with "
    "flashinfer installed: .venv/bin/python -m pytest -q -m gpu tests/executor"
)


def _requires_flashinfer() -> None:
    if not torch.cuda.is_available():
        pytest.skip(GPU_SKIP)
    pytest.importorskip(
        "flashinfer",
        reason="flashinfer is not installed: on a CUDA machine, pip install flashinfer-python, "
        "then .venv/bin/python -m pytest -q -m gpu tests/executor",
    )


def test_flashinfer_page_table_is_csr_of_the_block_tables() -> None:
    # Spans of 1, 16 and 17 tokens in blocks of 16: pages 1, 1, 2; last page 1, 16, 1.
    spans = [
        SeqSpan(query_start=0, query_len=1, context_len=1, block_ids=(7, 99)),
        SeqSpan(query_start=1, query_len=16, context_len=16, block_ids=(3,)),
        SeqSpan(query_start=17, query_len=2, context_len=17, block_ids=(5, 2)),
    ]
    table = HostPageTable.build(spans, 16)
    assert table.kv_indptr == [0, 1, 2, 4]
    assert table.kv_indices == [7, 3, 5, 2]
    assert table.kv_last_page_len == [1, 16, 1]
    assert table.qo_indptr == [0, 1, 17, 19]
    assert table.rows == list(range(19))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(0, 70)), min_size=1, max_size=6),
       st.sampled_from([1, 4, 16]), st.randoms(use_true_random=False))
def test_flashinfer_append_tables_address_the_slots_the_torch_backend_writes(
    shapes: list[tuple[int, int]], block_size: int, rng: random.Random
) -> None:
    # Each new token's (sequence, position) looked up through the CSR tables that
    # append_paged_kv_cache gets names the slot the torch backend's slot_mapping writes; the
    # tables are built on the host and sent in the step's one copy (StepArrays).
    spans, start, free = [], 0, list(range(1000))
    rng.shuffle(free)
    for query_len, cached in shapes:
        context = cached + query_len
        blocks = tuple(free.pop() for _ in range(-(-context // block_size)))
        spans.append(SeqSpan(start, query_len, context, blocks))
        start += query_len
    arrays = StepArrays(torch.device("cpu"))
    metadata = StepMetadata.build(tuple(spans), block_size, arrays)
    append = AppendTables.add(spans, HostPageTable.build(spans, block_size), arrays)
    arrays.send()
    indptr, indices = append.kv_indptr.tensor.tolist(), append.kv_indices.tensor.tolist()
    addressed = [
        indices[indptr[seq] + pos // block_size] * block_size + pos % block_size
        for seq, pos in zip(append.batch_indices.tensor.tolist(),
                            append.positions.tensor.tolist(), strict=True)
    ]
    assert addressed == metadata.slot_mapping.tensor.tolist()
    assert append.batch_indices.tensor.dtype == torch.int32
    last = append.kv_last_page_len.tensor.tolist()
    for seq, span in enumerate(spans):  # the last page holds the context's tail
        pages = indptr[seq + 1] - indptr[seq]
        assert (pages - 1) * block_size + last[seq] == span.context_len


def _teacher_forced_logits(runner: ModelRunner, steps: int) -> list[torch.Tensor]:
    """Logits of every step of a fixed schedule: prefill (chunked), a late chunk, decodes.

    The decode inputs are fixed tokens, not sampled ones, so both backends see the same steps
    even where bf16 rounding would flip a near-tie.
    """
    driver = Driver.scattered(runner)
    prompts = random_prompts(runner.info.vocab_size, [40, 17, 3, 64], seed=9)
    feed = random_prompts(runner.info.vocab_size, [steps], seed=10)[0]
    schedule = [
        tuple(driver.work(f"r{i}", p[:20], sample=len(p) <= 20) for i, p in enumerate(prompts)),
        tuple(
            driver.work(f"r{i}", p[20:], sample=True) for i, p in enumerate(prompts) if len(p) > 20
        ),
    ]
    logits = [runner.run_forward(StepRequest(seqs=seqs)).logits.float().cpu() for seqs in schedule]
    for token in feed:
        seqs = tuple(driver.work(f"r{i}", [token], sample=True) for i in range(len(prompts)))
        logits.append(runner.run_forward(StepRequest(seqs=seqs)).logits.float().cpu())
    return logits


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_flashinfer_backend_matches_torch_backend(
    make_runner: Callable[..., ModelRunner], dtype: str
) -> None:
    # Mixed steps (prefill, chunk after a cached prefix, 24 decodes) through both backends on
    # CUDA, scattered blocks: every step's logits agree within half-precision tolerance.
    _requires_flashinfer()
    results = {}
    for backend in ("torch", "flashinfer"):
        runner = make_runner("tiny-llama-hd128", device="cuda", dtype=dtype, backend=backend)
        results[backend] = _teacher_forced_logits(runner, steps=24)
    for step, (got, want) in enumerate(zip(results["flashinfer"], results["torch"], strict=True)):
        torch.testing.assert_close(got, want, atol=5e-2, rtol=0, msg=f"step {step}")
