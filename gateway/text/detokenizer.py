"""Incremental detokenization with stop strings, one per completion.

Text is released only when it is stable: never half of a multi-byte character, and never the
first characters of what could still become a stop string (the last `max(len(stop)) - 1`
characters are held back until the completion finishes).

Two text streams turn tokens into text pieces:
- `RustStream`: the tokenizers library's DecodeStream (about 1 us a token), primed with the
  prompt's last tokens; it holds bytes back until they form whole characters;
- `WindowStream`: any tokenizer with `decode`, by decoding a short window of tokens twice
  (vLLM's method): the window starts a few tokens before the unreleased ones, so that
  tokenizers which strip or merge leading spaces decode the same text as a full decode.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

REPLACEMENT_CHAR = "\ufffd"
CONTEXT_TOKENS = 5


class Decoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class TextStream(Protocol):
    def step(self, token_id: int) -> str: ...
    def flush(self) -> str: ...


@dataclass(slots=True)
class RustStream:
    stream: Any      # tokenizers.decoders.DecodeStream
    tokenizer: Any   # tokenizers.Tokenizer
    decoder: Decoder
    skip_special_tokens: bool = True
    held: list[int] = field(default_factory=list)  # tokens of an unfinished character

    def step(self, token_id: int) -> str:
        piece = self.stream.step(self.tokenizer, token_id)
        if piece is None:
            self.held.append(token_id)
            return ""
        self.held.clear()
        return str(piece)

    def flush(self) -> str:
        """An unfinished character at the end decodes as U+FFFD, like a full decode."""
        text = (self.decoder.decode(self.held, skip_special_tokens=self.skip_special_tokens)
                if self.held else "")
        self.held.clear()
        return text


@dataclass(slots=True)
class WindowStream:
    decoder: Decoder
    token_ids: list[int]   # prompt context, then every output token
    prefix_offset: int     # start of the decoding window
    read_offset: int       # tokens before this one are already decoded
    skip_special_tokens: bool = True

    def step(self, token_id: int) -> str:
        self.token_ids.append(token_id)
        return self._decode(final=False)

    def flush(self) -> str:
        return self._decode(final=True) if self.read_offset < len(self.token_ids) else ""

    def _decode(self, final: bool) -> str:
        skip = self.skip_special_tokens
        prefix = self.decoder.decode(
            self.token_ids[self.prefix_offset : self.read_offset], skip_special_tokens=skip
        )
        full = self.decoder.decode(self.token_ids[self.prefix_offset :], skip_special_tokens=skip)
        if len(full) > len(prefix) and (final or not full.endswith(REPLACEMENT_CHAR)):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.token_ids)
            return full[len(prefix) :]
        return ""


def text_stream(
    decoder: Any, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True
) -> TextStream:
    """The fastest stream the tokenizer allows, primed with the end of the prompt."""
    context = list(prompt_token_ids[-CONTEXT_TOKENS:])
    fast = getattr(decoder, "fast", None)
    if fast is None:
        return WindowStream(decoder, context, prefix_offset=0, read_offset=len(context),
                            skip_special_tokens=skip_special_tokens)
    from tokenizers.decoders import DecodeStream

    # NOTE: DecodeStream re-emits its priming text when that text ends in an unfinished
    # character; prime it with the longest clean tail of the prompt (or nothing).
    while context and REPLACEMENT_CHAR in decoder.decode(context, skip_special_tokens=True):
        context = context[1:]
    stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
    return RustStream(stream, fast, decoder, skip_special_tokens)


@dataclass(frozen=True, slots=True)
class StopStrings:
    """Stop strings indexed by their last character: new text is checked only against the
    strings that can end at each of its characters, not against the whole list."""

    by_last_char: dict[str, tuple[str, ...]]
    longest: int

    @classmethod
    def of(cls, stop: Sequence[str]) -> StopStrings:
        index: dict[str, list[str]] = {}
        for s in dict.fromkeys(stop):  # distinct, in order
            index.setdefault(s[-1], []).append(s)
        return cls({c: tuple(v) for c, v in index.items()}, max(map(len, stop), default=0))

    def earliest_match(self, text: str, new_from: int) -> tuple[int, int]:
        """Start and length of the earliest stop string that ends at or after `new_from`
        ((-1, 0): none)."""
        best, length = -1, 0
        for end in range(max(new_from, 0), len(text)):
            for s in self.by_last_char.get(text[end], ()):
                start = end + 1 - len(s)
                if start >= 0 and (best < 0 or start < best) and text.startswith(s, start):
                    best, length = start, len(s)
        return best, length


@dataclass(slots=True)
class Detokenizer:
    stream: TextStream
    stop: tuple[str, ...]
    include_stop: bool = False        # a stop string that ends the text stays in it
    text: str = ""                    # all decoded output text (stable part)
    num_released_chars: int = 0       # how much of `text` the client has seen
    stopped: bool = False
    hold_back: int = field(init=False)
    stops: StopStrings = field(init=False)

    def __post_init__(self) -> None:
        self.stops = StopStrings.of(self.stop)
        self.hold_back = max(self.stops.longest, 1) - 1

    @classmethod
    def for_prompt(
        cls, decoder: Any, prompt_token_ids: Sequence[int], stop: Sequence[str] = (), *,
        include_stop: bool = False, skip_special_tokens: bool = True,
    ) -> Detokenizer:
        stream = text_stream(decoder, prompt_token_ids, skip_special_tokens)
        return cls(stream=stream, stop=tuple(stop), include_stop=include_stop)

    def add(self, token_id: int, find_stop: bool = True) -> str:
        """Append one output token; returns the newly releasable text. `stopped` tells
        whether a stop string ended the completion (the text is then cut before it, or after
        it with `include_stop`). `find_stop` False: its text ends nothing (min_tokens)."""
        assert not self.stopped, "token added after a stop string ended the completion"
        piece = self.stream.step(token_id)
        if piece:
            previous_len = len(self.text)
            self.text += piece
            if self.stop and find_stop and self._cut_at_stop(previous_len):
                return self._release(len(self.text))
        return self._release(len(self.text) - self.hold_back)

    def flush(self) -> str:
        """The completion is over: release everything held back, even an unfinished char."""
        if not self.stopped:
            previous_len = len(self.text)
            self.text += self.stream.flush()
            self._cut_at_stop(previous_len)
        return self._release(len(self.text))

    def _cut_at_stop(self, previous_len: int) -> bool:
        # The text before `previous_len` held no stop string: a new one ends in the new text.
        if not self.stop:
            return False
        start, length = self.stops.earliest_match(self.text, previous_len)
        if start < 0:
            return False
        self.text = self.text[: start + length if self.include_stop else start]
        self.stopped = True
        return True

    def _release(self, upto: int) -> str:
        upto = min(upto, len(self.text))
        if upto <= self.num_released_chars:
            return ""
        delta = self.text[self.num_released_chars : upto]
        self.num_released_chars = upto
        return delta
