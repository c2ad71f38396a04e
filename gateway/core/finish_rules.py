"""When a landed token ends its completion, as the engine decides it: by token id and length.

Stop strings are text, and text is the API's side (text/output.py): the engine goes on until
the API, having found one, stops the completion (Router.stop_completion), as vLLM V1's output
processor aborts a request in its engine core.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.core.request_state import (
    CompletionDelta,
    FinishReason,
    Sequence,
    TokenLogprob,
    Usage,
)


@dataclass(frozen=True, slots=True)
class FinishRules:
    eos_token_ids: frozenset[int]
    max_model_len: int

    def reason(self, seq: Sequence, token_id: int) -> FinishReason | None:
        """Whether `token_id`, just appended to `seq`, ends it. Before min_tokens only the
        length limits do (the executor masks EOS and the stop tokens), as in vLLM."""
        options = seq.request.sampling
        num_outputs = len(seq.output_token_ids)
        may_stop = num_outputs >= options.min_tokens
        if may_stop and token_id in options.stop_token_ids:
            return FinishReason.STOP
        if may_stop and not options.ignore_eos and token_id in self.eos_token_ids:
            return FinishReason.STOP
        if num_outputs >= options.max_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def delta(self, seq: Sequence, token_id: int) -> CompletionDelta:
        """One landed token as the engine posts it: ids, logprobs and its finish; no text."""
        reason = self.reason(seq, token_id)
        logprobs: tuple[TokenLogprob, ...] = ()
        if seq.last_logprob is not None:
            logprobs, seq.last_logprob = (seq.last_logprob,), None
        if reason is None:
            return CompletionDelta(index=seq.index, token_ids=(token_id,), logprobs=logprobs)
        seq.finish_reason = reason
        return CompletionDelta(index=seq.index, token_ids=(token_id,), finish_reason=reason,
                               usage=usage(seq), logprobs=logprobs)


def usage(seq: Sequence) -> Usage:
    return Usage(
        prompt_tokens=len(seq.request.prompt_token_ids),
        completion_tokens=len(seq.output_token_ids),
        cached_prompt_tokens=seq.request.num_cached_tokens or 0,
    )
