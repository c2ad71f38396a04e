"""What one scheduling step sends and receives, as plain values (the protos stay at the edge).

A step is one allocator `Step` call (a `StepCall` in, declared with the allocator in
common/step_records.py; a `StepOutcome` out) followed by one executor `Execute` call (an
`ExecuteCall` in, `Sampled` tokens out). The conversion to and from protobuf lives in
allocator_client.py and executor_client.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.step_records import BlockCopy
from common.structured_output import StructuredOutput


@dataclass(frozen=True, slots=True)
class TableDelta:
    """Replace a block table from `start_index` on with `block_ids`."""

    start_index: int
    block_ids: tuple[int, ...]

    def apply(self, table: list[int]) -> None:
        assert self.start_index <= len(table), (
            f"delta starts at {self.start_index} past a table of {len(table)} blocks"
        )
        del table[self.start_index :]
        table.extend(self.block_ids)


@dataclass(frozen=True, slots=True)
class Grant:
    request_id: str
    delta: TableDelta | None
    num_cached_tokens: int
    num_scheduled_tokens: int
    start_position: int
    num_lookahead: int = 0  # slots granted for drafts (may be fewer than asked)


@dataclass(frozen=True, slots=True)
class Preemption:
    request_id: str
    swapped: bool  # False: recompute (the allocator freed it entirely)


@dataclass(frozen=True, slots=True)
class StepOutcome:
    grants: dict[str, Grant] = field(default_factory=dict)
    preempted: tuple[Preemption, ...] = ()
    deferred_request_ids: frozenset[str] = frozenset()
    copies: tuple[BlockCopy, ...] = ()
    swap_out: tuple[BlockCopy, ...] = ()
    swap_in: tuple[BlockCopy, ...] = ()
    # request id -> the one block appended to its table (a decode entering a new block, one
    # token scheduled at its next position); such requests have no entry in `grants`.
    appended: dict[str, int] = field(default_factory=dict)
    # The pool's free blocks once the step was applied (None: not reported).
    num_free_blocks: int | None = None
    # Fair share: the service of the tenants the Step named waiting (core/fair_share.py),
    # and the allocator's service per prompt token.
    tenant_service: dict[str, float] = field(default_factory=dict)
    prefill_weight: float = 0.0


@dataclass(frozen=True, slots=True)
class ExecSampling:
    """A sequence's sampling at the executor (pagedkv.executor.v1 SamplingParams says what
    each field means), sent with its first Execute."""

    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    # What min_tokens masks: the request's stop_token_ids; unless ignore_eos, the client adds
    # its executor's EOS ids (executor_client.py).
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    num_prompt_tokens: int = 0
    top_logprobs: int = 0
    # The prompt's logprobs asked for (SamplingParams.prompt_logprobs; None: not), and then the
    # whole prompt (SequenceWork.prompt_token_ids).
    prompt_logprobs: int | None = None
    prompt_token_ids: tuple[int, ...] = ()
    # The first Execute starting past position 0 (a cached prefix, an n > 1 child, a request
    # moved to another executor) with penalties on, which count the tokens before it, or a
    # structured output with generated tokens before it, which replays them. Sent in
    # SequenceWork.
    history_token_ids: tuple[int, ...] = ()
    structured_output: StructuredOutput | None = None
    lora_adapter: str = ""  # SequenceWork.lora_adapter ("": the base model)
    lora_adapter_digest: str = ""  # the contents its blocks hash under

    @property
    def has_penalties(self) -> bool:
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
        )


@dataclass(frozen=True, slots=True)
class SeqWork:
    """One sequence's part of an Execute call."""

    request_id: str
    token_ids: tuple[int, ...]
    start_position: int
    delta: TableDelta | None
    sample: bool
    sampling: ExecSampling | None  # only on the sequence's first Execute
    # token_ids[0] is the token the executor sampled for it in the batch before, not landed
    # yet (sent as 0): the executor's contract, use_sampled_token.
    use_sampled_token: bool = False
    # Speculative decoding: the last n of token_ids are drafts for the executor to verify.
    num_draft_tokens: int = 0


@dataclass(frozen=True, slots=True)
class ExecuteCall:
    release_request_ids: tuple[str, ...]
    swap_out: tuple[BlockCopy, ...]
    swap_in: tuple[BlockCopy, ...]
    copies: tuple[BlockCopy, ...]
    seqs: tuple[SeqWork, ...]
    # Plain decodes, before `seqs` in batch order, as the executor's compact columns: one
    # token at the next position, sampled, no table change, already held by the executor.
    # Row i of the three columns is one sequence (no object per sequence on the hot path).
    decode_request_ids: tuple[str, ...] = ()
    decode_token_ids: tuple[int, ...] = ()
    decode_positions: tuple[int, ...] = ()
    # Empty, or per row: its token is the one the executor sampled in the batch before (the
    # column's value is 0), as SeqWork.use_sampled_token.
    decode_use_sampled_token: tuple[bool, ...] = ()

    def is_empty(self) -> bool:
        return not (
            self.seqs or self.decode_request_ids or self.swap_out or self.swap_in or self.copies
        )

    @property
    def num_seqs(self) -> int:
        return len(self.decode_request_ids) + len(self.seqs)


@dataclass(frozen=True, slots=True)
class Sampled:
    """A sampled token, its logprob and (when the sequence asked) the most likely tokens'."""

    request_id: str
    token_id: int
    # The raw model distribution's log-softmax (before penalties, temperature, ...).
    logprob: float = 0.0
    # ExecSampling.top_logprobs (token id, logprob) pairs, most likely first.
    top_logprobs: tuple[tuple[int, float], ...] = ()
    # Of SeqWork.num_draft_tokens, how many the executor accepted: they precede token_id.
    num_accepted: int = 0


@dataclass(frozen=True, slots=True)
class PromptLogprobRun:
    """A run of one sequence's prompt logprobs: positions [first_position, + len(logprobs))."""

    request_id: str
    first_position: int
    logprobs: tuple[float, ...]
    ranks: tuple[int, ...]
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...]  # per token, (id, logprob) pairs


@dataclass(frozen=True, slots=True)
class ExecuteResult:
    tokens: tuple[Sampled, ...]  # for the sequences of `seqs` that sample
    compute_ms: float  # the executor's forward pass + sampling
    decode_token_ids: tuple[int, ...] = ()  # one per compact decode, in column order
    decode_logprobs: tuple[float, ...] = ()  # one per compact decode, as Sampled.logprob
    # Empty when no compact decode asked for top logprobs; else one per compact decode, as
    # Sampled.top_logprobs (() for a row that asked none).
    decode_top_logprobs: tuple[tuple[tuple[int, float], ...], ...] = ()
    # The executor's own report: its forward pass, sampling, whole step (ms), tokens computed.
    forward_ms: float = 0.0
    sample_ms: float = 0.0
    executor_ms: float = 0.0
    num_tokens: int = 0
    prompt_logprobs: tuple[PromptLogprobRun, ...] = ()
