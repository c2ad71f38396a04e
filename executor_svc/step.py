"""The step vocabulary, free of gRPC: what one Execute asks for and what it returns.

The servicer converts protos to these frozen records (executor_svc.convert); the runner and
everything below it speak only these.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.step_records import BlockCopy
from common.structured_output import StructuredOutput


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """vLLM's sampling parameters (the proto's SamplingParams says what each one means)."""

    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0  # (0, 1]
    top_k: int = 0  # 0: off
    seed: int | None = None
    min_p: float = 0.0  # [0, 1]; 0: off
    presence_penalty: float = 0.0  # over generated tokens
    frequency_penalty: float = 0.0  # over generated tokens
    repetition_penalty: float = 1.0  # over prompt and generated tokens; 1: off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids unique
    min_tokens: int = 0  # stop_token_ids get -inf until this many tokens are generated
    stop_token_ids: tuple[int, ...] = ()
    num_prompt_tokens: int = 0  # 0: the positions before the request's first sampled token
    top_logprobs: int = 0
    prompt_logprobs: int | None = None  # None: none; k: each prompt token's and k top ones
    structured_output: StructuredOutput | None = None  # the output's constraint (grammar.py)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """Penalties read the request's token history (logits_processor.py keeps it)."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
        )

    @property
    def edits_logits(self) -> bool:
        """A processor that can change the argmax is on: the request gets a LogitsProcessor."""
        return (
            self.has_penalties or bool(self.logit_bias)
            or (self.min_tokens > 0 and bool(self.stop_token_ids))
            or self.structured_output is not None
        )


@dataclass(frozen=True, slots=True)
class BlockTableDelta:
    """Replace the block table from `start_index` on with `block_ids`."""

    start_index: int = 0
    block_ids: tuple[int, ...] = ()


@dataclass(slots=True)
class SequenceWork:
    """One sequence's part of a step. Not frozen: one is built per decode on every step, and
    a frozen dataclass's __init__ costs 4x as much (1.16 vs 0.29 us; 0.3 ms a step at 64
    running). Treat it as read-only."""

    request_id: str
    token_ids: tuple[int, ...]
    start_position: int
    delta: BlockTableDelta | None = None  # None (or no block ids): the table stays as it is
    sampling: SamplingParams | None = None  # present exactly on a request's first step
    sample: bool = False
    # token_ids[0] is a stand-in for the token this executor sampled for the request in its
    # last step (the caller sent this step before that one returned): see plan.py.
    use_sampled_token: bool = False
    # With `sampling` only: the tokens at positions [0, start_position), which penalties
    # count (a cached prefix, a fork child); required when penalties are on and
    # start_position > 0.
    history_token_ids: tuple[int, ...] = ()
    # With sampling.prompt_logprobs only: the whole prompt (the proto says what is checked).
    prompt_token_ids: tuple[int, ...] = ()
    # Speculative decoding: the last n of token_ids are drafts to verify (plan.py checks
    # when they are allowed; the proto says what is returned).
    num_draft_tokens: int = 0
    # With `sampling` only: the LoRA adapter the request computes with ("": the base model).
    lora_adapter: str = ""
    lora_adapter_digest: str = ""  # with lora_adapter: the contents the caller expects


@dataclass(frozen=True, slots=True)
class StepRequest:
    """Applied in this order: releases, swap_out, swap_in, copies, then the forward pass."""

    seqs: tuple[SequenceWork, ...] = ()
    release_request_ids: tuple[str, ...] = ()
    swap_out: tuple[BlockCopy, ...] = ()  # device block -> CPU block
    swap_in: tuple[BlockCopy, ...] = ()  # CPU block -> device block
    copies: tuple[BlockCopy, ...] = ()  # device block -> device block (copy-on-write)


@dataclass(frozen=True, slots=True)
class SampledToken:
    request_id: str
    token_id: int
    logprob: float  # under the raw model distribution, as top_logprobs
    # SamplingParams.top_logprobs (token id, logprob) pairs, most likely first.
    top_logprobs: tuple[tuple[int, float], ...] = ()
    num_accepted_draft_tokens: int = 0  # of SequenceWork.num_draft_tokens, before token_id


@dataclass(frozen=True, slots=True)
class PromptLogprobs:
    """One request's prompt tokens at positions [first_position, first_position + n): each
    one's log-probability given the tokens before it, its rank, and the k most likely."""

    request_id: str
    first_position: int
    logprobs: tuple[float, ...]
    ranks: tuple[int, ...]
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...]  # per token: k (id, logprob)


@dataclass(frozen=True, slots=True)
class Timings:
    forward_ms: float
    sample_ms: float
    total_ms: float


@dataclass(frozen=True, slots=True)
class StepResult:
    tokens: tuple[SampledToken, ...]
    timings: Timings
    num_tokens: int
    prompt_logprobs: tuple[PromptLogprobs, ...] = ()  # in step order
