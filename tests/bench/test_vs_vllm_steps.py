"""bench.vs_vllm_steps' workload loop: the tokens it times are transformers' own greedy ones."""

from __future__ import annotations

import pytest

from bench import vs_vllm_steps
from bench.baselines import BenchRequest
from executor_svc.runner import ModelRunner, build_runner
from tests.executor.oracle import make_settings, random_prompts, reference_generate, reference_model


def test_workload_loop_continues_every_request_like_generate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    runner: ModelRunner = build_runner(make_settings())
    # A 40-token budget: prompts join over several steps, beside running decodes.
    monkeypatch.setattr(vs_vllm_steps, "STEP_TOKENS", 40)
    lengths, output_lens = [9, 30, 4, 17, 25, 11], [1, 6, 12, 3, 9, 5]
    prompts = random_prompts(runner.info.vocab_size, lengths, seed=5)
    requests = [BenchRequest(p, n) for p, n in zip(prompts, output_lens, strict=True)]
    outputs, _ = vs_vllm_steps.run_workload(runner, requests)
    model = reference_model(runner)
    assert outputs == [reference_generate(model, p, n)
                       for p, n in zip(prompts, output_lens, strict=True)]
    assert runner.requests == {}  # every finished request released
