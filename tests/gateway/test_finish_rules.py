"""Finishes the engine decides per landed token (gateway/core/finish_rules.py): min_tokens,
EOS, stop tokens, stop strings, lengths; logprobs ride on the token's delta, which carries no
text."""

from __future__ import annotations

import structlog

from gateway.api.sampling import SamplingOptions
from gateway.core.finish_rules import FinishRules
from gateway.core.request_state import FinishReason, Request, Sequence, TokenLogprob
from gateway.text.tokenizer import Tokenizer

EOS = 2
TOKENIZER = Tokenizer.load("models/tiny-llama")
RULES = FinishRules(eos_token_ids=frozenset({EOS}), max_model_len=64, decoder=TOKENIZER)
TEXT = "hello world"


def run(options: SamplingOptions, tokens: list[int]) -> tuple[list[int], FinishReason | None]:
    """Feed tokens as the scheduler lands them until one ends the completion."""
    seq = Sequence(seq_id="r", request=Request("r", [1, 5], options, ""), index=0)
    taken: list[int] = []
    for token in tokens:
        seq.output_token_ids.append(token)
        taken.append(token)
        delta = RULES.delta(seq, token)
        assert delta.text == ""
        if delta.finish_reason is not None:
            assert delta.usage is not None and delta.usage.completion_tokens == len(taken)
            return taken, delta.finish_reason
    return taken, None


def test_finish_rules_eos_ends_nothing_before_min_tokens():
    options = SamplingOptions(max_tokens=10, min_tokens=3)
    assert run(options, [7, EOS, 8, EOS, 9]) == ([7, EOS, 8, EOS], FinishReason.STOP)
    assert run(SamplingOptions(max_tokens=10), [7, EOS, 8]) == ([7, EOS], FinishReason.STOP)


def test_finish_rules_stop_tokens_wait_for_min_tokens():
    options = SamplingOptions(max_tokens=30, stop_token_ids=frozenset({9}), min_tokens=2)
    assert run(options, [9, 9, 4]) == ([9, 9], FinishReason.STOP)


def test_finish_rules_end_at_the_token_that_completes_a_stop_string():
    # "lo wo" spans three tokens (lo| w|or): the completion ends at "or", whatever the
    # lengths say; before min_tokens a stop string ends nothing (as in vLLM).
    ids = TOKENIZER.encode(TEXT)[1:]
    at = 5  # he|l|lo| w|or|l|d: the 5th token ends "lo wo"
    options = SamplingOptions(max_tokens=30, stop=("lo wo",), ignore_eos=True)
    assert run(options, ids) == (ids[:at], FinishReason.STOP)
    late = SamplingOptions(max_tokens=30, stop=("lo wo",), ignore_eos=True, min_tokens=at + 1)
    assert run(late, ids) == (ids, None)


def test_finish_rules_a_stop_string_and_the_length_on_one_token_is_a_stop():
    ids = TOKENIZER.encode(TEXT)[1:]
    options = SamplingOptions(max_tokens=5, stop=("lo wo",), ignore_eos=True)
    assert run(options, ids) == (ids[:5], FinishReason.STOP)


def test_finish_rules_max_tokens_ends_even_before_min_tokens_is_met():
    # (validation refuses min_tokens > max_tokens; equal: length ends it)
    options = SamplingOptions(max_tokens=3, min_tokens=3)
    assert run(options, [EOS, EOS, 7, EOS]) == ([EOS, EOS, 7], FinishReason.LENGTH)


def test_finish_rules_the_landed_logprob_rides_on_its_tokens_delta():
    seq = Sequence(seq_id="r", request=Request("r", [1, 5], SamplingOptions(
        max_tokens=4, logprobs=1), ""), index=0)
    seq.output_token_ids.append(7)
    seq.last_logprob = TokenLogprob(7, -0.5, ((7, -0.5),))
    delta = RULES.delta(seq, 7)
    assert delta.logprobs == (TokenLogprob(7, -0.5, ((7, -0.5),)),)
    assert seq.last_logprob is None
    seq.output_token_ids.append(8)
    assert RULES.delta(seq, 8).logprobs == ()


def test_finish_rules_a_tokenizer_failing_on_the_text_stops_only_that_search():
    # The stop-string search of one completion fails (the tokenizer raises on its tokens):
    # it is given up for that completion alone, which goes on to its length, and the
    # engine is not interrupted.
    class Failing:
        def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
            if 13 in token_ids:
                raise ValueError("invalid prefix")
            return "x" * len(token_ids)

    rules = FinishRules(eos_token_ids=frozenset({EOS}), max_model_len=64, decoder=Failing())
    seq = Sequence(seq_id="r", request=Request("r", [1, 5], SamplingOptions(
        max_tokens=4, stop=("never",), ignore_eos=True), ""), index=0)
    reasons = []
    with structlog.testing.capture_logs() as logs:
        for token in (7, 13, 8, 9):
            seq.output_token_ids.append(token)
            reasons.append(rules.reason(seq, token))
    assert reasons == [None, None, None, FinishReason.LENGTH]
    assert [e["event"] for e in logs] == ["stop_string_search_failed"]
