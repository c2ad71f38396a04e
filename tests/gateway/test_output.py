"""One request's output on the API's side (gateway/text/output.py): the engine's token deltas
become text; a stop string ends its completion there, cut at the match, with its tokens, logprobs
and usage up to the token that completed it, and nothing the engine sampled after it."""

from __future__ import annotations

import pytest

from gateway.api.sampling import SamplingOptions
from gateway.core.request_state import CompletionDelta, FinishReason, Request, TokenLogprob, Usage
from gateway.text.output import Finished, RequestOutput
from gateway.text.tokenizer import Tokenizer

TEXT = "hello world, good morning"  # he|l|lo| w|or|l|d|,| g|o|o|d| m|or|n|ing


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.load("models/tiny-llama")


def output(tokenizer: Tokenizer, **options: object) -> RequestOutput:
    sampling = SamplingOptions(max_tokens=30, **options)  # type: ignore[arg-type]
    return RequestOutput(tokenizer, Request("r", [1, 5], sampling, ""))


def feed(out: RequestOutput, tokens: list[int], index: int = 0
         ) -> tuple[list[CompletionDelta], Finished | None]:
    """One engine delta per token, as the engine posts them; the client's deltas."""
    deltas: list[CompletionDelta] = []
    finished = None
    for token in tokens:
        delta, done = out.process(CompletionDelta(index=index, token_ids=(token,)))
        if delta is not None:
            deltas.append(delta)
        finished = done or finished
    return deltas, finished


def test_output_text_without_stops_is_the_whole_decode(tokenizer: Tokenizer):
    ids = tokenizer.encode(TEXT)[1:]
    out = output(tokenizer)
    deltas, finished = feed(out, ids[:-1])
    last, done = out.process(CompletionDelta(index=0, token_ids=(ids[-1],),
                                             finish_reason=FinishReason.LENGTH))
    assert last is not None and done == Finished(0)
    assert "".join(d.text for d in [*deltas, last]) == TEXT and finished is None


def test_output_stop_string_spanning_tokens_cuts_the_text_and_counts_its_last_token(
    tokenizer: Tokenizer,
):
    # "lo wo" spans three tokens (lo| w|or): the completion ends at "or", the 5th token.
    ids = tokenizer.encode(TEXT)[1:]
    out = output(tokenizer, stop=("lo wo",))
    deltas, finished = feed(out, ids)
    assert finished == Finished(0)
    assert "".join(d.text for d in deltas) == "hel"
    assert [t for d in deltas for t in d.token_ids] == ids[:5]
    assert deltas[-1].finish_reason is FinishReason.STOP
    assert deltas[-1].usage == Usage(prompt_tokens=2, completion_tokens=5,
                                     cached_prompt_tokens=0)
    assert all(d.finish_reason is None for d in deltas[:-1])


def test_output_include_stop_str_keeps_the_stop_string(tokenizer: Tokenizer):
    ids = tokenizer.encode(TEXT)[1:]
    deltas, _ = feed(output(tokenizer, stop=("lo wo",), include_stop_str_in_output=True), ids)
    assert "".join(d.text for d in deltas) == "hello wo"


def test_output_tokens_sampled_after_the_stop_never_reach_the_client(tokenizer: Tokenizer):
    # The engine sent three tokens in one delta, the stop string ends in the first ("lo"),
    # then more deltas and its own length finish: none of it leaks, logprobs cut alike.
    ids = tokenizer.encode(TEXT)[1:]
    out = output(tokenizer, stop=("llo",), logprobs=0)
    first, _ = feed(out, ids[:2])
    logprobs = tuple(TokenLogprob(t, -1.0) for t in ids[2:5])
    delta, done = out.process(CompletionDelta(index=0, token_ids=tuple(ids[2:5]),
                                              logprobs=logprobs))
    assert delta is not None and done == Finished(0)
    assert delta.token_ids == (ids[2],) and delta.logprobs == logprobs[:1]
    assert "".join(d.text for d in [*first, delta]) == "he"
    assert delta.usage is not None and delta.usage.completion_tokens == 3
    later, finished = feed(out, ids[5:8])
    assert later == [] and finished is None
    assert out.process(CompletionDelta(index=0, token_ids=(ids[8],),
                                       finish_reason=FinishReason.LENGTH)) == (None, None)
    assert out.ended(0)


def test_output_stop_in_the_engines_last_token_needs_no_stop_call(tokenizer: Tokenizer):
    ids = tokenizer.encode(TEXT)[1:]
    out = output(tokenizer, stop=("lo",))
    feed(out, ids[:2])
    delta, done = out.process(CompletionDelta(index=0, token_ids=(ids[2],),
                                              finish_reason=FinishReason.LENGTH))
    assert delta is not None and delta.finish_reason is FinishReason.STOP
    assert done == Finished(0)


def test_output_stop_strings_wait_for_min_tokens(tokenizer: Tokenizer):
    ids = tokenizer.encode("a STOP b STOP c")[1:]
    deltas, finished = feed(output(tokenizer, stop=("STOP",), min_tokens=len(ids)), ids)
    assert finished is None and len(deltas) == len(ids)  # every STOP came before min_tokens
    deltas, finished = feed(output(tokenizer, stop=("STOP",), min_tokens=1), ids)
    assert finished is not None and len(deltas) == 5  # a| S|T|O|P
    assert "".join(d.text for d in deltas) == "a "
    # min_tokens 7: the first STOP ends before it, the second after.
    deltas, _ = feed(output(tokenizer, stop=("STOP",), min_tokens=7), ids)
    assert len(deltas) == 10 and "".join(d.text for d in deltas) == "a STOP b "


def test_output_completions_stop_on_their_own(tokenizer: Tokenizer):
    # n = 2: completion 1 stops; completion 0 goes on to its engine finish.
    ids = tokenizer.encode(TEXT)[1:]
    out = output(tokenizer, stop=("wor",), n=2)
    _, finished = feed(out, ids[:6], index=1)
    assert finished == Finished(1) and out.ended(1)
    deltas, finished = feed(out, ids[7:], index=0)  # ", good morning"
    assert finished is None and not out.ended(0)
    assert "".join(d.text for d in deltas) == ", good morning"[: -len("wor") + 1]
