"""bfloat16 on CPU (`--dtype bfloat16`): an option with its own tolerance.

fp32 stays the default and its tests stay token-exact; here the executor in bf16 is held to
transformers' own model in bf16 (same weights, sdpa attention, dense cache), which rounds the
same weights and activations, within bf16's resolution.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from executor_svc.runner import ModelRunner
from executor_svc.step import StepRequest

from .oracle import Driver, random_prompts, reference_logits, reference_model


@pytest.mark.parametrize(("preset", "backend", "lengths"), [
    ("tiny-llama", "cpu", [5, 33, 20]), ("tiny-llama", "torch", [5, 33, 20]),
    ("tiny-qwen2", "cpu", [5, 33, 20]), ("tiny-llama", "cpu", [29]),
])
def test_bfloat16_decode_logits_track_transformers_in_bfloat16(
    make_runner: Callable[..., ModelRunner], preset: str, backend: str, lengths: list[int]
) -> None:
    # Prompts prefilled, then four decode steps fed transformers' own greedy tokens: at every
    # step each row's logits are within bf16 rounding of the dense bf16 forward. (Qwen2: q/k/v
    # biases, concatenated into the fused q/k/v projection's. One prompt: its decode steps'
    # single row takes small_rows_linear in the layer stack.)
    runner = make_runner(preset, dtype="bfloat16", backend=backend)
    reference = reference_model(runner).to(torch.bfloat16)
    prompts = random_prompts(runner.info.vocab_size, lengths, seed=2)
    driver = Driver.scattered(runner)
    seqs = tuple(driver.work(f"r{i}", p, sample=True) for i, p in enumerate(prompts))
    logits = runner.run_forward(StepRequest(seqs=seqs)).logits  # [prompts, V] bf16
    histories = [list(p) for p in prompts]
    for _ in range(4):
        for row, history in enumerate(histories):
            expected = reference_logits(reference, history)[-1].float()  # [V]
            got = logits[row].float()
            torch.testing.assert_close(got, expected, atol=0.05, rtol=0.02)
            history.append(int(expected.argmax()))
        seqs = tuple(driver.work(f"r{i}", [h[-1]], sample=True) for i, h in enumerate(histories))
        logits = runner.run_forward(StepRequest(seqs=seqs)).logits
