"""One request's output on the API's side: the engine's token deltas become text, and stop
strings end completions.

The engine posts token ids, logprobs and the finishes it decides (EOS, stop tokens, stop
strings, lengths: core/finish_rules.py). Here, on the loop that reads the request's stream,
each completion is detokenized incrementally into the client's text, cut at the stop string
the engine finished it by (the same detokenizer finds it at the same token). A completion
whose text ends otherwise ends here all the same, and whatever comes after is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from gateway.core.request_state import CompletionDelta, FinishReason, Request, Usage
from gateway.text.detokenizer import Detokenizer


@dataclass(slots=True)
class CompletionText:
    """One completion's text so far, and whether it has ended for the client."""

    detokenizer: Detokenizer
    num_tokens: int = 0  # passed on to the client
    finished: bool = False


@dataclass(frozen=True, slots=True)
class Finished:
    """A completion ended with this delta."""

    index: int


@dataclass(slots=True)
class RequestOutput:
    decoder: Any  # gateway.text.tokenizer.Tokenizer, or anything with decode()
    request: Request
    completions: dict[int, CompletionText] = field(default_factory=dict)

    def process(self, delta: CompletionDelta) -> tuple[CompletionDelta | None, Finished | None]:
        """The client's delta for the engine's (None: the completion has ended already, so
        these tokens came after its stop string), and whether it ended the completion."""
        text = self.completions.get(delta.index)
        if text is None:
            text = self.completions[delta.index] = CompletionText(self._detokenizer())
        if text.finished:
            return None, None
        options = self.request.sampling
        detok = text.detokenizer
        pieces: list[str] = []
        kept = 0
        for token_id in delta.token_ids:
            kept += 1
            text.num_tokens += 1
            # Before min_tokens no stop string is looked for, as in vLLM.
            pieces.append(detok.add(token_id, find_stop=text.num_tokens >= options.min_tokens))
            if detok.stopped:
                break
        if detok.stopped:
            text.finished = True
            out = CompletionDelta(
                index=delta.index, token_ids=delta.token_ids[:kept], text="".join(pieces),
                finish_reason=FinishReason.STOP, usage=self._usage(text.num_tokens),
                logprobs=delta.logprobs[:kept], prompt_logprobs=delta.prompt_logprobs,
            )
            return out, Finished(delta.index)
        if delta.finish_reason is None:
            return CompletionDelta(delta.index, delta.token_ids, "".join(pieces),
                                   logprobs=delta.logprobs,
                                   prompt_logprobs=delta.prompt_logprobs), None
        text.finished = True
        pieces.append(detok.flush())
        return replace(delta, text="".join(pieces)), Finished(delta.index)

    def ended(self, index: int) -> bool:
        text = self.completions.get(index)
        return text is not None and text.finished

    def _detokenizer(self) -> Detokenizer:
        return completion_detokenizer(self.decoder, self.request)

    def _usage(self, num_tokens: int) -> Usage:
        request = self.request
        return Usage(prompt_tokens=len(request.prompt_token_ids), completion_tokens=num_tokens,
                     cached_prompt_tokens=request.num_cached_tokens or 0)


def completion_detokenizer(decoder: Any, request: Request) -> Detokenizer:
    """One completion's detokenizer: the engine's stop-string search (core/finish_rules.py)
    and the client's text here are built alike, so that both stop at the same token."""
    options = request.sampling
    return Detokenizer.for_prompt(
        decoder, request.prompt_token_ids, options.stop,
        include_stop=options.include_stop_str_in_output,
        skip_special_tokens=options.skip_special_tokens,
    )
