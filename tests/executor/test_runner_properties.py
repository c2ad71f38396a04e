"""Property: any chunking schedule, block size and block placement gives transformers' logits."""

from __future__ import annotations

import random

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from executor_svc.runner import ModelRunner, build_runner
from executor_svc.step import BlockTableDelta, SamplingParams, SequenceWork, StepRequest

from .oracle import make_settings, reference_logits, reference_model

RUNNERS: dict[int, ModelRunner] = {}


def _runner(block_size: int) -> ModelRunner:
    if block_size not in RUNNERS:
        RUNNERS[block_size] = build_runner(
            make_settings(block_size=block_size, num_blocks=2048 // block_size)
        )
    return RUNNERS[block_size]


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    block_size=st.sampled_from([1, 2, 8, 16, 32]),
    chunks=st.lists(st.integers(1, 24), min_size=1, max_size=5),
    placement_seed=st.integers(0, 2**16),
)
def test_runner_any_schedule_matches_dense_forward(
    block_size: int, chunks: list[int], placement_seed: int
) -> None:
    # A prompt fed in arbitrary chunks through randomly placed blocks: every chunk's last
    # logits equal the dense forward at that position.
    runner = _runner(block_size)
    reference = reference_model(runner)
    rng = random.Random(placement_seed)
    prompt = [rng.randrange(3, runner.info.vocab_size) for _ in range(sum(chunks))]
    expected = reference_logits(reference, prompt)  # [T, V]
    blocks = rng.sample(range(runner.info.num_blocks), -(-len(prompt) // block_size))
    start = 0
    for i, size in enumerate(chunks):
        end = start + size
        first, last = -(-start // block_size), -(-end // block_size)
        work = SequenceWork(
            request_id="p",
            token_ids=tuple(prompt[start:end]),
            start_position=start,
            delta=BlockTableDelta(first, tuple(blocks[first:last])) if last > first else None,
            sampling=SamplingParams() if i == 0 else None,
            sample=True,
        )
        logits = runner.run_forward(StepRequest(seqs=(work,))).logits  # [1, V]
        torch.testing.assert_close(logits[0], expected[end - 1], atol=1e-4, rtol=0)
        start = end
    runner.release(("p",))
