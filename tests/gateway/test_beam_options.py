"""Beam search's request fields (gateway/api/beam_options.py) through validation, the gRPC
conversion and the HTTP request bodies: each refusal names the field; nothing is ignored."""

from __future__ import annotations

import math

import pytest

from common.errors import InvalidArgument
from gateway.api.openai.protocol import ChatCompletionRequest, CompletionRequest
from gateway.api.sampling import ExceedsCapacity, ModelLimits, RawSampling, validate
from gateway.api.service import raw_sampling
from gateway.core.beam_search import EarlyStopping
from gateway.settings import load_settings
from pagedkv.gateway.v1 import gateway_pb2 as pb

LIMITS = ModelLimits(max_model_len=64, vocab_size=512, max_n=8, pool_capacity_tokens=1024,
                     max_beam_width=4, eos_token_ids=(2,), block_size=16)


def beam(**fields: object) -> RawSampling:
    fields.setdefault("max_tokens", 8)
    return RawSampling(use_beam_search=True, **fields)  # type: ignore[arg-type]


def test_a_search_takes_n_as_its_width_and_transformers_defaults():
    # n 3, width unset: 3 beams, 3 returned; length_penalty 1, the heuristic; EOS ends a
    # hypothesis; sampled greedily at the executor (its pick is never used).
    options = validate(beam(n=3), prompt_len=4, limits=LIMITS)
    config = options.beam
    assert config is not None and options.temperature == 0.0
    assert (config.beam_width, config.num_return, config.max_tokens) == (3, 3, 8)
    assert config.length_penalty == 1.0 and config.early_stopping is EarlyStopping.HEURISTIC
    assert config.stop_token_ids == frozenset({2}) and config.num_candidates == 6


def test_stop_token_ids_and_ignore_eos_decide_what_ends_a_hypothesis():
    # ignore_eos drops EOS; stop_token_ids add their own; max_tokens past the context is cut.
    options = validate(beam(beam_width=2, stop_token_ids=(7, 9), ignore_eos=True,
                            max_tokens=100, length_penalty=-2.0,
                            early_stopping=EarlyStopping.NEVER), prompt_len=4, limits=LIMITS)
    config = options.beam
    assert config is not None and config.stop_token_ids == frozenset({7, 9})
    assert config.max_tokens == 60 and config.num_candidates == 6  # max_model_len 64 - 4
    assert config.length_penalty == -2.0 and config.early_stopping is EarlyStopping.NEVER


@pytest.mark.parametrize(("raw", "message"), [
    (beam(beam_width=0), "sampling.beam_width (best_of over HTTP) is 0; it must be in [1, 4]"),
    (beam(beam_width=5), "is 5; it must be in [1, 4] (--max-beam-width)"),
    (beam(beam_width=2, n=3), "sampling.n is 3; beam search returns at most beam_width (2)"),
    (beam(temperature=0.5), "sampling.temperature is not supported with use_beam_search"),
    (beam(top_p=0.9), "sampling.top_p is not supported"),
    (beam(top_k=5), "sampling.top_k is not supported"),
    (beam(min_p=0.1), "sampling.min_p is not supported"),
    (beam(seed=1), "sampling.seed is not supported"),
    (beam(presence_penalty=0.5), "sampling.presence_penalty is not supported"),
    (beam(frequency_penalty=0.5), "sampling.frequency_penalty is not supported"),
    (beam(repetition_penalty=1.2), "sampling.repetition_penalty is not supported"),
    (beam(logit_bias=((5, 1.0),)), "sampling.logit_bias is not supported"),
    (beam(min_tokens=2), "sampling.min_tokens is not supported"),
    (beam(stop=("x",)), "sampling.stop is not supported"),
    (beam(logprobs=0), "sampling.logprobs is not supported"),
    (beam(length_penalty=math.nan), "sampling.length_penalty is nan"),
    (beam(length_penalty=-math.inf), "sampling.length_penalty is -inf"),
    (beam(length_penalty=10.5), "sampling.length_penalty is 10.5; it must be a finite number"),
    (beam(beam_width=4, stop_token_ids=(5, 6, 7, 8)),
     "needs the 24 most likely next tokens of each beam and executors return at most 20: use a "
     "beam_width of at most 3"),
    (RawSampling(beam_width=2), "sampling.beam_width is set without use_beam_search"),
    (RawSampling(length_penalty=2.0), "sampling.length_penalty is set without use_beam_search"),
    (RawSampling(early_stopping=EarlyStopping.NEVER), "sampling.early_stopping is set without"),
])
def test_bad_beam_fields_are_refused_naming_them(raw: RawSampling, message: str):
    with pytest.raises(InvalidArgument) as err:
        validate(raw, prompt_len=4, limits=LIMITS)
    assert message in str(err.value)


def test_no_op_values_pass_without_beam_search():
    # vLLM's server sends length_penalty 1.0 and early_stopping false with every request.
    options = validate(RawSampling(length_penalty=1.0, early_stopping=EarlyStopping.HEURISTIC,
                                   top_p=1.0), prompt_len=4, limits=LIMITS)
    assert options.beam is None


def test_a_search_that_could_not_fit_without_sharing_is_refused():
    # 4 beams x 64 tokens (4 blocks of 16 each) > 200 slots: RESOURCE_EXHAUSTED, naming the
    # remedy; 3 beams fit.
    limits = ModelLimits(max_model_len=64, vocab_size=512, max_n=8, pool_capacity_tokens=200,
                         max_beam_width=4, eos_token_ids=(2,), block_size=16)
    with pytest.raises(ExceedsCapacity, match="narrow the beam"):
        validate(beam(beam_width=4, max_tokens=60), prompt_len=4, limits=limits)
    assert validate(beam(beam_width=3, max_tokens=60), prompt_len=4, limits=limits).beam


def test_grpc_fields_convert_with_unset_distinct_from_zero():
    # beam_width and length_penalty are optional: 0 is a value (refused), unset is n / 1.0.
    raw = raw_sampling(pb.SamplingParams(use_beam_search=True, beam_width=0, length_penalty=0.0,
                                         early_stopping=pb.EARLY_STOPPING_WHEN_FULL))
    assert (raw.use_beam_search, raw.beam_width, raw.length_penalty) == (True, 0, 0.0)
    assert raw.early_stopping is EarlyStopping.WHEN_FULL
    unset = raw_sampling(pb.SamplingParams())
    assert (unset.beam_width, unset.length_penalty, unset.early_stopping) == (None, None, None)
    with pytest.raises(InvalidArgument, match="sampling.early_stopping is 7"):
        raw_sampling(pb.SamplingParams(early_stopping=7))  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", [CompletionRequest, ChatCompletionRequest])
def test_http_best_of_is_the_beam_width_and_early_stopping_is_transformers_value(kind: type):
    prompt = ({"prompt": "hi"} if kind is CompletionRequest
              else {"messages": [{"role": "user", "content": "hi"}]})
    for early, expected in ((False, EarlyStopping.HEURISTIC), (True, EarlyStopping.WHEN_FULL),
                            ("never", EarlyStopping.NEVER), (None, None)):
        body = kind(model="m", n=2, best_of=4, use_beam_search=True, length_penalty=0.5,
                    early_stopping=early, max_tokens=8, **prompt)
        raw = body.sampling()
        assert (raw.n, raw.beam_width, raw.length_penalty) == (2, 4, 0.5)
        assert raw.early_stopping is expected
    plain = kind(model="m", n=2, best_of=2, max_tokens=8, **prompt).sampling()
    assert plain.beam_width is None and not plain.use_beam_search
    with pytest.raises(InvalidArgument, match="only supported with use_beam_search"):
        kind(model="m", n=1, best_of=3, max_tokens=8, **prompt).sampling()


@pytest.mark.parametrize("value", ["0", "11"])
def test_max_beam_width_flag_is_bounded(value: str, capsys: pytest.CaptureFixture[str]):
    # Each beam needs its 2 x width best next tokens; executors return at most 20.
    with pytest.raises(SystemExit) as info:
        load_settings(["--insecure", "--max-beam-width", value])
    assert info.value.code == 2 and "--max-beam-width must be in [1, 10]" in capsys.readouterr().err
    assert load_settings(["--insecure"]).max_beam_width == 8
