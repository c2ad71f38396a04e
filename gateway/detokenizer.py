"""Incremental detokenization with stop strings, one per completion.

Text is released only when it is stable: never half of a multi-byte character (the decoded
tail ends with U+FFFD until the character is complete), and never the first characters of
what could still become a stop string (the last `max(len(stop)) - 1` characters are held back
until the completion finishes). Each step decodes a short window of tokens, not the whole
output: the window starts a few tokens before the unreleased ones so that tokenizers which
strip or merge leading spaces decode the same text as a full decode would.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"
CONTEXT_TOKENS = 5


class Decoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


@dataclass(frozen=True, slots=True)
class TextDelta:
    """Text released by one token; `stopped` when a stop string ended the completion."""

    text: str
    stopped: bool


@dataclass(slots=True)
class Detokenizer:
    decoder: Decoder
    stop: tuple[str, ...]
    token_ids: list[int]              # prompt context, then every output token
    prefix_offset: int                # start of the decoding window
    read_offset: int                  # tokens before this one are already in `text`
    text: str = ""                    # all decoded output text (stable part)
    num_released_chars: int = 0       # how much of `text` the client has seen
    stopped: bool = False
    hold_back: int = field(init=False)

    def __post_init__(self) -> None:
        self.hold_back = max((len(s) for s in self.stop), default=1) - 1

    @classmethod
    def for_prompt(
        cls, decoder: Decoder, prompt_token_ids: Sequence[int], stop: Sequence[str] = ()
    ) -> Detokenizer:
        context = list(prompt_token_ids[-CONTEXT_TOKENS:])
        return cls(
            decoder=decoder,
            stop=tuple(stop),
            token_ids=context,
            prefix_offset=0,
            read_offset=len(context),
        )

    def add(self, token_id: int) -> TextDelta:
        """Append one output token; returns the newly releasable text."""
        assert not self.stopped, "token added after a stop string ended the completion"
        self.token_ids.append(token_id)
        window = self.token_ids[self.prefix_offset :]
        prefix = self.decoder.decode(
            self.token_ids[self.prefix_offset : self.read_offset], skip_special_tokens=True
        )
        full = self.decoder.decode(window, skip_special_tokens=True)
        if len(full) > len(prefix) and not full.endswith(REPLACEMENT_CHAR):
            previous_len = len(self.text)
            self.text += full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.token_ids)
            if self._cut_at_stop(previous_len):
                return TextDelta(self._release(len(self.text)), stopped=True)
        return TextDelta(self._release(len(self.text) - self.hold_back), stopped=False)

    def flush(self) -> str:
        """The completion is over: release everything held back, even an incomplete char."""
        if self.read_offset < len(self.token_ids) and not self.stopped:
            prefix = self.decoder.decode(
                self.token_ids[self.prefix_offset : self.read_offset], skip_special_tokens=True
            )
            full = self.decoder.decode(
                self.token_ids[self.prefix_offset :], skip_special_tokens=True
            )
            self.text += full[len(prefix) :]
            self.read_offset = len(self.token_ids)
        return self._release(len(self.text))

    def _cut_at_stop(self, previous_len: int) -> bool:
        if not self.stop:
            return False
        search_from = max(0, previous_len - self.hold_back)
        hits = [i for s in self.stop if (i := self.text.find(s, search_from)) >= 0]
        if not hits:
            return False
        self.text = self.text[: min(hits)]
        self.stopped = True
        return True

    def _release(self, upto: int) -> str:
        upto = min(upto, len(self.text))
        if upto <= self.num_released_chars:
            return ""
        delta = self.text[self.num_released_chars : upto]
        self.num_released_chars = upto
        return delta
