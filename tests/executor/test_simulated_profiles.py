"""The simulated executor's cost model: monotone in every term, and the published figures it
was fitted on come back out (executor_svc/simulated/profiles.py says where they are from)."""

from __future__ import annotations

import dataclasses

import pytest

from executor_svc.simulated.profiles import (
    LLAMA2_7B_A100,
    LLAMA3_8B,
    PROFILES,
    Profile,
    StepShape,
)

BLOCK_SIZE = 16
# TensorRT-LLM's published A100 FP16 LLaMA 7B figures: (batch, input, output, out tok/s).
THROUGHPUT = [(384, 128, 128, 5586.0), (60, 128, 2048, 1928.0), (52, 2048, 128, 591.0)]
FIRST_TOKEN_MS = [(128, 16.0), (2048, 133.0)]  # batch 1
TOLERANCE = 0.02


def _static_batch_tok_s(profile: Profile, batch: int, isl: int, osl: int) -> float:
    """A static batch as the benchmark ran it: one prefill step, then osl - 1 decode steps."""
    total_ms = profile.step_ms(StepShape(batch * isl, batch * isl), BLOCK_SIZE)
    for k in range(1, osl):
        total_ms += profile.step_ms(StepShape(batch, batch * (isl + k)), BLOCK_SIZE)
    return batch * osl / (total_ms / 1e3)


@pytest.mark.parametrize(("batch", "isl", "osl", "published"), THROUGHPUT)
def test_profile_reproduces_published_throughput(batch: int, isl: int, osl: int,
                                                 published: float) -> None:
    # Replayed step by step, the fitted A100 profile gives TensorRT-LLM's numbers within 2%.
    modelled = _static_batch_tok_s(LLAMA2_7B_A100, batch, isl, osl)
    assert modelled == pytest.approx(published, rel=TOLERANCE)


@pytest.mark.parametrize(("isl", "published_ms"), FIRST_TOKEN_MS)
def test_profile_reproduces_published_first_token_latency(isl: int, published_ms: float) -> None:
    # One prefill step of a batch-1 prompt: the published first-token latency within 2%.
    modelled = LLAMA2_7B_A100.step_ms(StepShape(isl, isl), BLOCK_SIZE)
    assert modelled == pytest.approx(published_ms, rel=TOLERANCE)


@pytest.mark.parametrize("profile", list(PROFILES.values()), ids=list(PROFILES))
@pytest.mark.parametrize("term", ["num_tokens", "num_context_tokens", "num_swapped_blocks"])
def test_step_time_is_monotone_in_each_term(profile: Profile, term: str) -> None:
    # Growing one term of a step, the others fixed, never makes it faster; past the weight
    # read (the roofline's knee) more tokens make it strictly slower.
    base = StepShape(num_tokens=1, num_context_tokens=100, num_swapped_blocks=0)
    times = [profile.step_ms(dataclasses.replace(base, **{term: getattr(base, term) + n}),
                             BLOCK_SIZE) for n in (0, 1, 10, 100, 1000, 10000)]
    assert times == sorted(times)
    assert times[-1] > times[0]


def test_small_decode_steps_pay_the_weight_read_only_once() -> None:
    # Below the knee, one more decode token costs only its context's K/V read.
    profile = PROFILES["llama3-8b-h100"]
    one = profile.step_ms(StepShape(1, 1000), BLOCK_SIZE)
    eight = profile.step_ms(StepShape(8, 1000), BLOCK_SIZE)
    assert one == eight == pytest.approx(
        profile.overhead_ms + profile.weights_ms + 1000 * profile.ms_per_context_token)


def test_a_step_without_tokens_or_swaps_takes_no_time() -> None:
    # Releases and copies only: no forward pass to wait for.
    assert PROFILES["llama3-8b-h100"].step_ms(StepShape(0, 0), BLOCK_SIZE) == 0.0


def test_derived_profiles_scale_the_fit_by_datasheet_ratios() -> None:
    # Llama-3-8B on H100: weights x (16.06 / 13.48) x (2.039 / 3.35); KV a quarter (GQA).
    h100 = PROFILES["llama3-8b-h100"]
    assert h100.source == "derived" and h100.model is LLAMA3_8B
    assert h100.weights_ms == pytest.approx(8.0 * 16.06 / 13.48 * 2.039 / 3.35)
    assert h100.ms_per_token == pytest.approx(0.060 * 8.03 / 6.74 * 312 / 989)
    assert h100.ms_per_context_token == pytest.approx(0.00021 / 4 * 2.039 / 3.35)
    assert h100.num_blocks(BLOCK_SIZE) == int((72e9 - 16.06e9 - 2e9) // 131072) // BLOCK_SIZE
    h200 = PROFILES["llama3-8b-h200"]
    assert h200.weights_ms < h100.weights_ms and h200.ms_per_token == h100.ms_per_token
