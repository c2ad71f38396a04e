"""Structured output in the executor: each constrained request's matcher, fed its generated
tokens, masks the logits it samples from.

The constraint comes with the request's first step (SamplingParams.structured_output) and is
compiled from the model directory's tokenizer (common/structured_output.py, cached by
content). Every generated token the executor is sent, in history_token_ids, in prefill chunks
past num_prompt_tokens or as the next decode token, is checked against the matcher when the
step is planned and consumed when it commits: a recomputed, forked or handed-off request
replays its output and goes on where it was; nothing the caller sends can put the matcher in
an error state.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from common.errors import InvalidArgument, Unimplemented
from common.structured_output import Grammars, StructuredOutput, load_tokenizer

if TYPE_CHECKING:
    import llguidance

    from executor_svc.plan import PlannedSeq, RequestState

FIELD = "sampling.structured_output"
BITS = 32  # llguidance's mask: one bit a token id, in int32 words


class GrammarCompiler:
    """The model's tokenizer for llguidance, loaded at the first constrained request (~0.3 s)."""

    def __init__(self, model_dir: str | None, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.model_dir = model_dir
        self._vocab_size = vocab_size
        self._eos_token_ids = eos_token_ids
        self._grammars: Grammars | None = None
        self._lock = threading.Lock()

    @property
    def available(self) -> bool:
        return (self.model_dir is not None and bool(self._eos_token_ids)
                and (Path(self.model_dir) / "tokenizer.json").is_file())

    def matcher(self, constraint: StructuredOutput) -> llguidance.LLMatcher:
        if not self.available:
            raise Unimplemented(
                f"{FIELD}: this executor has no tokenizer.json beside its model (Describe's "
                "structured_output is false): send the request without it")
        with self._lock:
            if self._grammars is None:
                assert self.model_dir is not None, "available checked the directory"
                self._grammars = Grammars(
                    load_tokenizer(self.model_dir, self._vocab_size, self._eos_token_ids))
        return self._grammars.matcher(constraint, FIELD)


def generated_part(token_ids: Sequence[int], start_position: int,
                   num_prompt_tokens: int) -> Sequence[int]:
    """Of the tokens at [start_position, start_position + len), those at generated positions."""
    return token_ids[max(num_prompt_tokens - start_position, 0):]


class GrammarState:
    """One request's matcher: fed the generated tokens, it fills the next token's mask."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def consume(self, token_ids: Sequence[int]) -> None:
        """Tokens the plan checked (check_tokens): the matcher moves past them, up to the
        output's end (a step sent before the caller saw the EOS carries tokens past it)."""
        if not token_ids or self.matcher.is_stopped():
            return
        accepted = _accepted(self.matcher, token_ids)
        if not self.matcher.consume_tokens(list(token_ids[:accepted])):
            raise AssertionError(f"a checked token was refused: {self.matcher.get_error()}")
        assert accepted == len(token_ids) or self.matcher.is_stopped(), "checked tokens"

    def fill(self, words: torch.Tensor) -> None:  # [W] int32, contiguous, on the CPU
        self.matcher.unsafe_compute_mask_ptr(words.data_ptr(),
                                             words.numel() * words.element_size())


# Byte value -> its 8 bits as additive masks (0: allowed, -inf: not), least significant first:
# llguidance's int32 words are little-endian, so byte i of the mask holds tokens 8i..8i+7.
_BYTE_BIAS = torch.tensor([[0.0 if (byte >> bit) & 1 else float("-inf") for bit in range(8)]
                           for byte in range(256)])  # [256, 8]


def mask_bias(grammars: Sequence[GrammarState], vocab_size: int,
              device: torch.device) -> torch.Tensor:  # [R, V] float32
    """Each row's additive mask (0 where its constraint allows the token, -inf where not),
    all rows unpacked in one gather: per row, shifting bits and masked_fill cost ~170 us at
    49k ids (11 ms a 64-row step), the gather and an add a third of that
    (bench/structured_output.py)."""
    words = torch.empty(len(grammars), -(-vocab_size // BITS), dtype=torch.int32)  # [R, W]
    for row, grammar in enumerate(grammars):
        grammar.fill(words[row])
    bias = _BYTE_BIAS[words.view(torch.uint8).long()]  # [R, 4W, 8]
    return bias.view(len(grammars), -1)[:, :vocab_size].to(device)


def check_tokens(matcher: llguidance.LLMatcher, token_ids: Sequence[int], first_position: int,
                 rid: str) -> None:
    """InvalidArgument unless the matcher accepts every one of these generated tokens."""
    if not token_ids or matcher.is_stopped():
        return
    accepted = _accepted(matcher, token_ids)
    if accepted < len(token_ids) and not _stops_after(matcher, token_ids[:accepted]):
        raise InvalidArgument(
            f"request {rid!r}: generated token {token_ids[accepted]} at position "
            f"{first_position + accepted} is not allowed by {FIELD}: send the tokens the "
            "request generated under it")


def _accepted(matcher: llguidance.LLMatcher, token_ids: Sequence[int]) -> int:
    """How many of the tokens, from the first, the matcher accepts."""
    return int(matcher.validate_tokens(list(token_ids)))


def _stops_after(matcher: llguidance.LLMatcher, token_ids: Sequence[int]) -> bool:
    """The output is over after these tokens: what follows them is never shown."""
    probe = matcher.deep_copy()
    return bool(probe.consume_tokens(list(token_ids))) and probe.is_stopped()


def check_planned(planned: PlannedSeq, held: RequestState | None,
                  compiler: GrammarCompiler) -> None:
    """A constrained request's step: its constraint compiles, and the generated tokens it
    carries (history included) are ones the constraint allows, in order."""
    work = planned.work
    sampling = work.sampling if work.sampling is not None else (held and held.sampling)
    if not sampling or sampling.structured_output is None:
        return
    rid = work.request_id
    if held is not None:  # the held matcher has consumed every token before start_position
        assert held.processor is not None and held.processor.grammar is not None
        # (a use_sampled_token row's first token is the one sampled: planned.token_ids)
        tokens = generated_part(planned.token_ids, work.start_position,
                                sampling.num_prompt_tokens)
        first = max(work.start_position, sampling.num_prompt_tokens)
        check_tokens(held.processor.grammar.matcher, tokens, first, rid)
        return
    if sampling.num_prompt_tokens == 0:
        raise InvalidArgument(
            f"request {rid!r}: {FIELD} needs sampling.num_prompt_tokens (where the output "
            "starts)")
    if work.start_position > sampling.num_prompt_tokens and not work.history_token_ids:
        raise InvalidArgument(
            f"request {rid!r}: start_position {work.start_position} is past the prompt's "
            f"{sampling.num_prompt_tokens} tokens: {FIELD} needs history_token_ids to replay "
            "the generated ones")
    matcher = compiler.matcher(sampling.structured_output)
    history = generated_part(work.history_token_ids, 0, sampling.num_prompt_tokens)
    tokens = [*history, *generated_part(planned.token_ids, work.start_position,
                                        sampling.num_prompt_tokens)]
    check_tokens(matcher, tokens, sampling.num_prompt_tokens, rid)
