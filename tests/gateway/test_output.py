"""Stop conditions per token (gateway/text/output.py): min_tokens, EOS, stop strings and
tokens, lengths; logprobs ride on the token's delta."""

from __future__ import annotations

import pytest

from gateway.api.sampling import SamplingOptions
from gateway.core.request_state import FinishReason, Request, Sequence, TokenLogprob
from gateway.text.output import OutputProcessor
from gateway.text.tokenizer import Tokenizer

EOS = 2


@pytest.fixture(scope="module")
def processor() -> OutputProcessor:
    return OutputProcessor(decoder=Tokenizer.load("models/tiny-llama"),
                           eos_token_ids=frozenset({EOS}), max_model_len=64)


def run(processor: OutputProcessor, options: SamplingOptions, tokens: list[int]
        ) -> tuple[list[int], FinishReason | None]:
    """Feed tokens as the scheduler lands them until one ends the completion."""
    seq = Sequence(seq_id="r", request=Request("r", [1, 5], options, ""), index=0)
    processor.start(seq)
    taken: list[int] = []
    for token in tokens:
        seq.output_token_ids.append(token)
        taken.append(token)
        delta = processor.process(seq, token)
        if delta.finish_reason is not None:
            return taken, delta.finish_reason
    return taken, None


def test_eos_ends_nothing_before_min_tokens(processor: OutputProcessor):
    options = SamplingOptions(max_tokens=10, min_tokens=3)
    assert run(processor, options, [7, EOS, 8, EOS, 9]) == ([7, EOS, 8, EOS], FinishReason.STOP)
    assert run(processor, SamplingOptions(max_tokens=10), [7, EOS, 8]) == ([7, EOS],
                                                                           FinishReason.STOP)


def test_stop_tokens_and_strings_wait_for_min_tokens(processor: OutputProcessor):
    tok = processor.decoder
    ids = tok.encode("a STOP b STOP c")[1:]
    options = SamplingOptions(max_tokens=30, stop=("STOP",), min_tokens=len(ids))
    taken, reason = run(processor, options, ids)
    assert reason is None and taken == ids  # every STOP came before min_tokens
    taken, reason = run(processor, SamplingOptions(max_tokens=30, stop=("STOP",),
                                                   min_tokens=1), ids)
    assert reason is FinishReason.STOP and len(taken) < len(ids) // 2 + 1
    options = SamplingOptions(max_tokens=30, stop_token_ids=frozenset({9}), min_tokens=2)
    assert run(processor, options, [9, 9, 4]) == ([9, 9], FinishReason.STOP)


def test_max_tokens_ends_even_before_min_tokens_is_met(processor: OutputProcessor):
    # (validation refuses min_tokens > max_tokens; equal: length ends it)
    options = SamplingOptions(max_tokens=3, min_tokens=3)
    assert run(processor, options, [EOS, EOS, 7, EOS]) == ([EOS, EOS, 7], FinishReason.LENGTH)


def test_the_landed_logprob_rides_on_its_tokens_delta(processor: OutputProcessor):
    seq = Sequence(seq_id="r", request=Request("r", [1, 5], SamplingOptions(
        max_tokens=4, logprobs=1), ""), index=0)
    processor.start(seq)
    seq.output_token_ids.append(7)
    seq.last_logprob = TokenLogprob(7, -0.5, ((7, -0.5),))
    delta = processor.process(seq, 7)
    assert delta.logprobs == (TokenLogprob(7, -0.5, ((7, -0.5),)),)
    assert seq.last_logprob is None
    seq.output_token_ids.append(8)
    assert processor.process(seq, 8).logprobs == ()
