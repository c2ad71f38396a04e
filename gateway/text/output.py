"""Turning sampled tokens into client deltas: detokenization and stop conditions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.core.request_state import CompletionDelta, FinishReason, Sequence, Usage
from gateway.text.detokenizer import Detokenizer


@dataclass(frozen=True, slots=True)
class OutputProcessor:
    decoder: Any  # gateway.tokenizer.Tokenizer, or anything with decode()
    eos_token_ids: frozenset[int]
    max_model_len: int

    def start(self, seq: Sequence) -> None:
        seq.detokenizer = Detokenizer.for_prompt(
            self.decoder, seq.request.prompt_token_ids, seq.request.sampling.stop
        )

    def process(self, seq: Sequence, token_id: int) -> CompletionDelta:
        """One sampled token: its text, and the finish reason when it ends the completion."""
        options = seq.request.sampling
        detok = seq.detokenizer
        assert detok is not None, f"{seq.seq_id} has no detokenizer: call start() first"
        text = detok.add(token_id)
        reason: FinishReason | None = None
        if detok.stopped or token_id in options.stop_token_ids:
            reason = FinishReason.STOP
        elif not options.ignore_eos and token_id in self.eos_token_ids:
            reason = FinishReason.STOP
        elif len(seq.output_token_ids) >= options.max_tokens:
            reason = FinishReason.LENGTH
        elif seq.num_tokens >= self.max_model_len:
            reason = FinishReason.LENGTH
        if reason is None:
            return CompletionDelta(index=seq.index, token_ids=(token_id,), text=text)
        seq.finish_reason = reason
        return CompletionDelta(
            index=seq.index,
            token_ids=(token_id,),
            text=text + detok.flush(),
            finish_reason=reason,
            usage=usage(seq),
        )


def usage(seq: Sequence) -> Usage:
    return Usage(
        prompt_tokens=len(seq.request.prompt_token_ids),
        completion_tokens=len(seq.output_token_ids),
        cached_prompt_tokens=seq.request.num_cached_tokens or 0,
    )
