"""Speculative decoding's drafts: prompt lookup (n-gram), proposed by the scheduler.

A running sequence whose last tokens (its suffix of `prompt_lookup_max` down to
`prompt_lookup_min` tokens) occurred earlier in its prompt or output is proposed the tokens
that followed that occurrence, the latest one, up to `num_speculative_tokens`. Outputs that
copy their input (summaries, code edits, extraction) are accepted often; elsewhere nothing
matches and nothing is proposed. The executor verifies drafts in the step that computes the
sequence's next token (executor.v1 SequenceWork.num_draft_tokens), the allocator grants their
slots as lookahead and counts only the accepted ones (allocator.v1 StepItem.num_lookahead).

Only requests whose tokens are each their row's argmax are drafted for (`may_draft`): greedy,
and nothing that edits logits or reports per-token logprobs.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from common.step_records import MAX_LOOKAHEAD_TOKENS
from gateway.core.request_state import Request

_ITEM = array("i").itemsize
_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")


@dataclass(frozen=True, slots=True)
class NgramDrafts:
    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2

    def propose(self, tokens: Sequence[int], limit: int) -> tuple[int, ...]:
        """Up to `limit` (and num_speculative_tokens) tokens that followed the latest earlier
        occurrence of the longest matching suffix; () when none matches."""
        return self.propose_packed(array("i", tokens).tobytes(), limit)

    def propose_packed(self, packed: bytes | bytearray, limit: int) -> tuple[int, ...]:
        """`propose` over the tokens packed as C ints (`pack`: a sequence keeps them)."""
        limit = min(limit, self.num_speculative_tokens)
        length = len(packed) // _ITEM
        if limit <= 0 or length <= self.prompt_lookup_min:
            return ()
        # A byte search over the packed ids runs in C: no Python loop per position.
        for n in range(min(self.prompt_lookup_max, length - 1), self.prompt_lookup_min - 1, -1):
            suffix = packed[(length - n) * _ITEM:]
            end = (length - 1) * _ITEM  # the occurrence ends before the last token
            while (found := packed.rfind(suffix, 0, end)) >= 0:
                if found % _ITEM == 0:  # (a match across id boundaries is no match)
                    start = found + n * _ITEM
                    return tuple(array("i", packed[start:start + limit * _ITEM]))
                end = found + len(suffix) - 1
        return ()


def pack(packed: bytearray, prompt: Sequence[int], outputs: Sequence[int]) -> bytearray:
    """`packed` made a sequence's tokens (prompt, then outputs) as C ints, appending only what
    is new: they only grow, or end."""
    have, total = len(packed) // _ITEM, len(prompt) + len(outputs)
    if have > total:
        del packed[total * _ITEM:]
    elif have < total:
        new = [*prompt[have:], *outputs[max(have - len(prompt), 0):]]
        packed += array("i", new).tobytes()
    return packed


def may_draft(request: Request) -> bool:
    """Its tokens are its rows' argmax and nothing is reported per row: drafts can be
    verified (executor.v1 SequenceWork.num_draft_tokens). Not one that asked for its
    prompt's logprobs, even once they have all come: the executor holds its prompt for its
    whole life, and refuses drafts for it."""
    options = request.sampling
    return (
        options.temperature == 0.0 and options.logprobs is None and options.beam is None
        and not options.has_penalties and not options.logit_bias and not options.min_tokens
        and options.structured_output is None and options.prompt_logprobs is None
    )


def parse_speculative_config(text: str) -> NgramDrafts | None:
    """vLLM's --speculative-config, as JSON: {"method": "ngram", "num_speculative_tokens": k,
    "prompt_lookup_max": 4, "prompt_lookup_min": 2}; "" is off. A ValueError says what is
    wrong."""
    if not text:
        return None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"is not JSON ({exc.msg})") from None
    if not isinstance(config, dict):
        raise ValueError("must be a JSON object")
    unknown = sorted(set(config) - set(_KEYS))
    if unknown:
        raise ValueError(f"has unknown keys {unknown}; known: {list(_KEYS)}")
    if config.get("method", "ngram") != "ngram":
        raise ValueError(f"method {config['method']!r} is not supported: only \"ngram\"")
    values = {}
    for key in _KEYS[1:]:
        if key in config:
            value = config[key]
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{key} must be an integer >= 1, got {value!r}")
            values[key] = value
    if "num_speculative_tokens" not in values:
        raise ValueError("needs num_speculative_tokens")
    if values["num_speculative_tokens"] > MAX_LOOKAHEAD_TOKENS:
        raise ValueError(f"num_speculative_tokens must be at most {MAX_LOOKAHEAD_TOKENS}")
    drafts = NgramDrafts(**values)
    if drafts.prompt_lookup_min > drafts.prompt_lookup_max:
        raise ValueError(f"prompt_lookup_min {drafts.prompt_lookup_min} is more than "
                         f"prompt_lookup_max {drafts.prompt_lookup_max}")
    return drafts
