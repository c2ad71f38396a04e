"""Turning sampled tokens into client deltas: detokenization and stop conditions."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from gateway.core.request_state import (
    CompletionDelta,
    FinishReason,
    Request,
    Sequence,
    TokenLogprob,
    Usage,
)
from gateway.text.detokenizer import Detokenizer


@dataclass(frozen=True, slots=True)
class OutputProcessor:
    decoder: Any  # gateway.tokenizer.Tokenizer, or anything with decode()
    eos_token_ids: frozenset[int]
    max_model_len: int

    def start(self, seq: Sequence) -> None:
        options = seq.request.sampling
        seq.detokenizer = Detokenizer.for_prompt(
            self.decoder, seq.request.prompt_token_ids, options.stop,
            include_stop=options.include_stop_str_in_output,
            skip_special_tokens=options.skip_special_tokens,
        )

    def whole_text(self, request: Request, token_ids: Iterable[int]) -> str:
        """A whole completion's text, as its stream would have read (beam search's
        hypotheses, emitted at once)."""
        options = request.sampling
        detok = Detokenizer.for_prompt(self.decoder, request.prompt_token_ids,
                                       skip_special_tokens=options.skip_special_tokens)
        return "".join(detok.add(t, find_stop=False) for t in token_ids) + detok.flush()

    def process(self, seq: Sequence, token_id: int) -> CompletionDelta:
        """One sampled token: its text, and the finish reason when it ends the completion.
        Before min_tokens, only the length limits end it (the executor masks EOS and the stop
        tokens; stop strings are not looked for), as in vLLM."""
        options = seq.request.sampling
        detok = seq.detokenizer
        assert detok is not None, f"{seq.seq_id} has no detokenizer: call start() first"
        num_outputs = len(seq.output_token_ids)
        may_stop = num_outputs >= options.min_tokens
        text = detok.add(token_id, find_stop=may_stop)
        reason: FinishReason | None = None
        if may_stop and (detok.stopped or token_id in options.stop_token_ids):
            reason = FinishReason.STOP
        elif may_stop and not options.ignore_eos and token_id in self.eos_token_ids:
            reason = FinishReason.STOP
        elif num_outputs >= options.max_tokens:
            reason = FinishReason.LENGTH
        elif seq.num_tokens >= self.max_model_len:
            reason = FinishReason.LENGTH
        logprobs: tuple[TokenLogprob, ...] = ()
        if seq.last_logprob is not None:
            logprobs, seq.last_logprob = (seq.last_logprob,), None
        if reason is None:
            return CompletionDelta(index=seq.index, token_ids=(token_id,), text=text,
                                   logprobs=logprobs)
        seq.finish_reason = reason
        return CompletionDelta(
            index=seq.index,
            token_ids=(token_id,),
            text=text + detok.flush(),
            finish_reason=reason,
            usage=usage(seq),
            logprobs=logprobs,
        )


def usage(seq: Sequence) -> Usage:
    return Usage(
        prompt_tokens=len(seq.request.prompt_token_ids),
        completion_tokens=len(seq.output_token_ids),
        cached_prompt_tokens=seq.request.num_cached_tokens or 0,
    )
