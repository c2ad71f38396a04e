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
        (RawSampling(min_p=-0.1), "min_p"),
        (RawSampling(min_p=1.5), "min_p"),
        (RawSampling(min_p=math.nan), "min_p"),
        (RawSampling(presence_penalty=2.5), "presence_penalty"),
        (RawSampling(frequency_penalty=-3.0), "frequency_penalty"),
        (RawSampling(repetition_penalty=0.0), "repetition_penalty"),
        (RawSampling(repetition_penalty=1e-50), "repetition_penalty"),
        (RawSampling(stop_token_ids=tuple(range(512))), "stop_token_ids"),
        (RawSampling(repetition_penalty=101.0), "repetition_penalty"),
        (RawSampling(logit_bias=((512, 1.0),)), "logit_bias"),
        (RawSampling(logit_bias=((5, 101.0),)), "logit_bias"),
        (RawSampling(logit_bias=((5, math.inf),)), "logit_bias"),
        (RawSampling(logit_bias=tuple((i, 1.0) for i in range(1025))), "logit_bias"),
        (RawSampling(logprobs=21), "logprobs"),
        (RawSampling(min_tokens=20, max_tokens=10), "min_tokens"),
        (RawSampling(min_tokens=-1), "min_tokens"),
        (RawSampling(priority=1 << 31), "priority"),
        (RawSampling(priority=-(1 << 40)), "priority"),
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


def test_validate_passes_the_processors_through():
    options = validate(RawSampling(min_p=0.1, presence_penalty=0.5, frequency_penalty=-0.5,
                                   repetition_penalty=1.2, logit_bias=((7, -100.0),),
                                   min_tokens=2, logprobs=3, include_stop_str_in_output=True,
                                   skip_special_tokens=False, priority=-4),
                       prompt_len=4, limits=LIMITS)
    assert (options.min_p, options.presence_penalty, options.frequency_penalty,
            options.repetition_penalty, options.logit_bias, options.min_tokens,
            options.logprobs, options.include_stop_str_in_output, options.skip_special_tokens,
            options.priority) == (0.1, 0.5, -0.5, 1.2, ((7, -100.0),), 2, 3, True, False, -4)
    assert options.has_penalties
    defaults = validate(RawSampling(), prompt_len=4, limits=LIMITS)
    assert (defaults.repetition_penalty, defaults.skip_special_tokens, defaults.logprobs) == (
        1.0, True, None)
    assert not defaults.has_penalties


def test_chat_default_max_tokens_fills_the_context():
    # The chat API's unset max_tokens: the rest of max_model_len (here 64 - 10), not 16.
    options = validate(RawSampling(fill_context=True), prompt_len=10, limits=LIMITS)
    assert options.max_tokens == 54
    small_pool = ModelLimits(max_model_len=64, vocab_size=512, max_n=4, pool_capacity_tokens=32)
    assert validate(RawSampling(fill_context=True), 10, small_pool).max_tokens == 22
