"""Turning sampled tokens into client deltas: detokenization and stop conditions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.detokenizer import Detokenizer
from gateway.request_state import CompletionDelta, FinishReason, Sequence, Usage


@dataclass(frozen=True, slots=True)
class OutputProcessor:
    decoder: Any  # gateway.tokenizer.Tokenizer, or anything with decode()
    eos_token_ids: frozenset[int]
    max_model_len: int

    def start(self, seq: Sequence) -> None:
        seq.detokenizer = Detokenizer.for_prompt(
            self.decoder, seq.request.prompt_token_ids, seq.request.sampling.stop
        )

    def finish_without_text(self, seq: Sequence, token_id: int) -> FinishReason | None:
        """Every stop condition but stop strings: integer checks, decided the moment the
        token arrives (before the next step is scheduled), while detokenization waits."""
        options = seq.request.sampling
        if token_id in options.stop_token_ids:
            return FinishReason.STOP
        if not options.ignore_eos and token_id in self.eos_token_ids:
            return FinishReason.STOP
        if len(seq.output_token_ids) >= options.max_tokens:
            return FinishReason.LENGTH
        if seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def process(self, seq: Sequence, token_id: int) -> CompletionDelta:
        """One sampled token: its text, and the finish reason when it ends the completion."""
        detok = seq.detokenizer
        assert detok is not None, f"{seq.seq_id} has no detokenizer: call start() first"
        text = detok.add(token_id)
        reason = FinishReason.STOP if text.stopped else self.finish_without_text(seq, token_id)
        if reason is None:
            return CompletionDelta(index=seq.index, token_ids=(token_id,), text=text.text)
        seq.finish_reason = reason
        return CompletionDelta(
            index=seq.index,
            token_ids=(token_id,),
            text=text.text + detok.flush(),
            finish_reason=reason,
            usage=usage(seq),
        )


def usage(seq: Sequence) -> Usage:
    return Usage(
        prompt_tokens=len(seq.request.prompt_token_ids),
        completion_tokens=len(seq.output_token_ids),
        cached_prompt_tokens=seq.request.num_cached_tokens or 0,
    )
