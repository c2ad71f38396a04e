"""Finishes the engine decides per landed token (gateway/core/finish_rules.py): min_tokens,
EOS, stop tokens, lengths; logprobs ride on the token's delta, which carries no text."""

from __future__ import annotations

from gateway.api.sampling import SamplingOptions
from gateway.core.finish_rules import FinishRules
from gateway.core.request_state import FinishReason, Request, Sequence, TokenLogprob

EOS = 2
RULES = FinishRules(eos_token_ids=frozenset({EOS}), max_model_len=64)


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


def test_finish_rules_ignore_stop_strings():
    # Stop strings are the API's (text/output.py): the engine runs on to its length.
    options = SamplingOptions(max_tokens=3, stop=("a",), ignore_eos=True)
    assert run(options, [7, 8, 9, 10]) == ([7, 8, 9], FinishReason.LENGTH)


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
