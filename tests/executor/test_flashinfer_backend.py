"""FlashInfer against the torch reference: page tables on CPU, kernels where CUDA exists.

GPU tests skip with a message where no CUDA device is present. On a CUDA machine with
flashinfer installed: `.venv/bin/python -m pytest -q -m gpu tests/executor`.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from executor_svc.attention import SeqSpan
from executor_svc.attention.flashinfer_backend import PageTable
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
    table = PageTable.build(spans, 16, torch.device("cpu"))
    assert table.kv_indptr.tolist() == [0, 1, 2, 4]
    assert table.kv_indices.tolist() == [7, 3, 5, 2]
    assert table.kv_last_page_len.tolist() == [1, 16, 1]
    assert table.qo_indptr.tolist() == [0, 1, 17, 19]
    assert table.rows.tolist() == list(range(19))
    assert table.kv_indptr.dtype == torch.int32


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
