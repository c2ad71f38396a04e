"""When a landed token ends its completion: by token id, stop string or length, decided here
alone, as each token lands on the engine.

A completion with stop strings keeps an incremental detokenizer of its own (the API's side
makes the client's text with another, text/output.py, which cuts it at the same token); the
engine finishes the sequence at the token that completes a stop string, as at EOS, so nothing
goes back from the API to stop it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import structlog

from gateway.core.request_state import (
    CompletionDelta,
    FinishReason,
    Sequence,
    TokenLogprob,
    Usage,
)
from gateway.text.output import completion_detokenizer

log = structlog.get_logger(__name__)
# Sequence.stop_text of a completion whose text the tokenizer failed on.
_UNDECODABLE = object()


@dataclass(frozen=True, slots=True)
class FinishRules:
    eos_token_ids: frozenset[int]
    max_model_len: int
    decoder: Any  # the tokenizer (text/tokenizer.py), for stop strings

    def reason(self, seq: Sequence, token_id: int, ahead: int = 0) -> FinishReason | None:
        """Whether `token_id`, appended to `seq` with `ahead` tokens after it (landed with
        it: speculative decoding), ends it. Before min_tokens only the length limits do (the
        executor masks EOS and the stop tokens), as in vLLM; but an EOS under structured
        output ends it (the output is complete: the constraint wins over min_tokens, and
        allows nothing after it)."""
        options = seq.request.sampling
        num_outputs = len(seq.output_token_ids) - ahead
        may_stop = num_outputs >= options.min_tokens
        if may_stop and token_id in options.stop_token_ids:
            return FinishReason.STOP
        if (may_stop or options.structured_output is not None) and not options.ignore_eos \
                and token_id in self.eos_token_ids:
            return FinishReason.STOP
        if options.stop and self._completes_a_stop_string(seq, token_id, may_stop):
            return FinishReason.STOP
        if num_outputs >= options.max_tokens or seq.num_tokens - ahead >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _completes_a_stop_string(self, seq: Sequence, token_id: int, may_stop: bool) -> bool:
        """Every token of the completion goes through its detokenizer, in order; before
        min_tokens its text ends nothing, as in vLLM. A tokenizer that fails on the text
        stops the search for this completion alone (the API's side, decoding the same
        tokens, fails its request, whose cancellation then ends the sequence)."""
        text = seq.stop_text
        if text is _UNDECODABLE:
            return False
        try:
            if text is None:
                text = seq.stop_text = completion_detokenizer(self.decoder, seq.request)
            text.add(token_id, find_stop=may_stop)
        except Exception:  # noqa: BLE001 - one completion's text must not stop the engine
            log.warning("stop_string_search_failed", seq_id=seq.seq_id, exc_info=True)
            seq.stop_text = _UNDECODABLE
            return False
        return bool(text.stopped)

    def delta(self, seq: Sequence, token_id: int, ahead: int = 0) -> CompletionDelta:
        """One landed token as the engine posts it: ids, logprobs and its finish; no text.
        A finish drops the `ahead` tokens landed after it."""
        reason = self.reason(seq, token_id, ahead)
        if reason is not None and ahead:
            del seq.output_token_ids[-ahead:]
        logprobs: tuple[TokenLogprob, ...] = ()
        if seq.last_logprob is not None:
            logprobs, seq.last_logprob = (seq.last_logprob,), None
        request = seq.request
        prompt_logprobs = None  # on the completion's first token, when asked for
        if request.sampling.prompt_logprobs is not None and len(seq.output_token_ids) == 1:
            prompt_logprobs = request.prompt_logprobs_out()
        if reason is None:
            return CompletionDelta(index=seq.index, token_ids=(token_id,), logprobs=logprobs,
                                   prompt_logprobs=prompt_logprobs)
        seq.finish_reason = reason
        return CompletionDelta(index=seq.index, token_ids=(token_id,), finish_reason=reason,
                               usage=usage(seq), logprobs=logprobs,
                               prompt_logprobs=prompt_logprobs)


def usage(seq: Sequence) -> Usage:
    return Usage(
        prompt_tokens=len(seq.request.prompt_token_ids),
        completion_tokens=len(seq.output_token_ids),
        cached_prompt_tokens=seq.request.num_cached_tokens or 0,
    )
