"""Request validation: every bad field is INVALID_ARGUMENT with a message naming it."""

from __future__ import annotations

import math

import pytest

from common.errors import InvalidArgument, ResourceExhausted
from gateway.api.sampling import ModelLimits, RawSampling, validate, validate_prompt

LIMITS = ModelLimits(max_model_len=64, vocab_size=512, max_n=4, pool_capacity_tokens=256)


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        (RawSampling(temperature=-0.5), "temperature"),
        (RawSampling(temperature=math.nan), "temperature"),
        (RawSampling(top_p=0.0), "top_p"),
        (RawSampling(top_p=1.5), "top_p"),
        (RawSampling(n=5), "n"),
        (RawSampling(stop_token_ids=(3, 512)), "stop_token_ids"),
        (RawSampling(stop=("ok", "")), "stop"),
    ],
)
def test_validate_rejects_bad_field_naming_it(raw: RawSampling, field: str):
    # Each malformed field is rejected with its name in the message.
    with pytest.raises(InvalidArgument, match=f"sampling.{field}"):
        validate(raw, prompt_len=4, limits=LIMITS)


def test_validate_applies_public_defaults():
    # Unset fields read as: max_tokens 16, temperature 1, top_p 1, n 1.
    options = validate(RawSampling(), prompt_len=4, limits=LIMITS)
    assert (options.max_tokens, options.temperature, options.top_p, options.n) == (16, 1.0, 1.0, 1)


def test_validate_keeps_greedy_and_explicit_values():
    # temperature 0 is greedy (valid); explicit values pass through.
    raw = RawSampling(max_tokens=5, temperature=0.0, top_p=0.5, top_k=3, seed=7, n=4,
                      stop=("x",), stop_token_ids=(2,), ignore_eos=True)
    options = validate(raw, prompt_len=4, limits=LIMITS)
    assert options.temperature == 0.0 and options.seed == 7 and options.n == 4
    assert options.stop_token_ids == frozenset({2}) and options.ignore_eos


def test_validate_rejects_request_that_can_never_fit_the_pool():
    # 256 tokens of KV in the smallest pool; 200 + 100 (capped at max_model_len 300) won't fit.
    limits = ModelLimits(max_model_len=300, vocab_size=512, max_n=4, pool_capacity_tokens=256)
    with pytest.raises(ResourceExhausted, match="max_tokens"):
        validate(RawSampling(max_tokens=100), prompt_len=200, limits=limits)


def test_validate_caps_need_at_max_model_len():
    # A huge max_tokens is fine when max_model_len bounds the sequence within the pool.
    options = validate(RawSampling(max_tokens=10_000), prompt_len=10, limits=LIMITS)
    assert options.max_tokens == 10_000


@pytest.mark.parametrize(
    ("prompt", "match"),
    [([], "prompt is empty"), (list(range(64)), "max_model_len"), ([1, 600], "vocabulary")],
)
def test_validate_prompt_rejects_bad_prompts(prompt: list[int], match: str):
    # Empty, too long (no room for one token) or out-of-vocabulary prompts.
    with pytest.raises(InvalidArgument, match=match):
        validate_prompt(prompt, LIMITS)


def test_sampling_explicit_zero_max_tokens_is_invalid():
    # max_tokens is optional on the wire: unset means 16, an explicit 0 is a mistake.
    with pytest.raises(InvalidArgument, match="sampling.max_tokens"):
        validate(RawSampling(max_tokens=0), prompt_len=4, limits=LIMITS)
