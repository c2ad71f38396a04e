"""Validate a step against the executor's request state, without changing anything.

`plan_step` either raises a domain exception (the caller's mistake, with a remedy) or returns a
StepPlan that the runner applies. Nothing is mutated before the whole step has been checked, so
a rejected Execute leaves every request, block table and KV block as it was.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.errors import FailedPrecondition, InvalidArgument, NotFound, Unimplemented
from common.step_records import MAX_LOOKAHEAD_TOKENS
from executor_svc.sampling_checks import check_history, check_prompt, check_sampling
from executor_svc.step import (
    BlockCopy,
    BlockTableDelta,
    SamplingParams,
    SequenceWork,
    StepRequest,
)

if TYPE_CHECKING:  # annotations only: the simulated executor plans steps without torch
    import torch

    from executor_svc.logits_processor import LogitsProcessor


@dataclass(slots=True)
class RequestState:
    """What the executor holds for one request between steps."""

    request_id: str
    sampling: SamplingParams
    generator: torch.Generator | None  # seeded: reproducible sampling; None: shared RNG
    block_table: list[int]
    num_tokens: int  # tokens whose K/V are in the cache
    # The token sampled in the request's last step (its position is num_tokens), until a step
    # uses it: what a use_sampled_token row stands for. None when the last step sampled none.
    sampled_token: int | None = None
    last_used: float = 0.0  # when a step last computed tokens for it (ModelRunner's clock)
    # min_tokens, logit_bias, penalties and the token history they read; None (most
    # requests) when the request uses none of them.
    processor: LogitsProcessor | None = None
    # With SamplingParams.prompt_logprobs: the whole prompt, whose log-probabilities the
    # steps that compute it report.
    prompt_token_ids: tuple[int, ...] | None = None
    lora_adapter: str = ""  # the adapter all its steps compute with ("": the base model)


@dataclass(frozen=True, slots=True)
class Limits:
    num_blocks: int
    num_cpu_blocks: int
    block_size: int
    vocab_size: int
    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int
    max_draft_tokens: int = MAX_LOOKAHEAD_TOKENS  # (--max-draft-tokens; 0: no drafts)

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)


@dataclass(frozen=True, slots=True)
class PlannedSeq:
    work: SequenceWork
    block_table: tuple[int, ...]  # the table once this step's delta is applied
    is_new: bool
    token_ids: tuple[int, ...]  # work.token_ids, the sampled token in place (use_sampled_token)
    # The prompt whose log-probabilities this step reports (SamplingParams.prompt_logprobs).
    prompt_token_ids: tuple[int, ...] | None = None
    num_prompt_logprobs: int = 0  # the top entries per prompt token

    def prompt_rows(self) -> range:
        """The positions computed here whose next token is a prompt token."""
        if self.prompt_token_ids is None:
            return range(0)
        start = self.work.start_position
        return range(start, min(start + len(self.token_ids), len(self.prompt_token_ids) - 1))


@dataclass(frozen=True, slots=True)
class StepPlan:
    release_request_ids: tuple[str, ...]  # held requests to drop (unknown ids are ignored)
    seqs: tuple[PlannedSeq, ...]


def _check_copies(name: str, copies: tuple[BlockCopy, ...], src: tuple[str, int],
                  dst: tuple[str, int]) -> None:
    """`src`, `dst`: which pool each side names ("device" or "CPU") and its size."""
    (src_kind, num_src), (dst_kind, num_dst) = src, dst
    written: set[int] = set()
    for copy in copies:
        if not 0 <= copy.src_block_id < num_src:
            raise InvalidArgument(
                f"{name}: source block {copy.src_block_id} is outside [0, {num_src}) "
                f"({src_kind} blocks; see Describe)"
            )
        if not 0 <= copy.dst_block_id < num_dst:
            raise InvalidArgument(
                f"{name}: destination block {copy.dst_block_id} is outside [0, {num_dst}) "
                f"({dst_kind} blocks; see Describe)"
            )
        if copy.dst_block_id in written:
            raise InvalidArgument(
                f"{name}: destination block {copy.dst_block_id} is written twice in one step"
            )
        written.add(copy.dst_block_id)


def _check_budget(step: StepRequest, limits: Limits) -> None:
    if len(step.seqs) > limits.max_num_seqs:
        raise InvalidArgument(
            f"{len(step.seqs)} sequences in one step; this executor takes at most "
            f"max_num_seqs={limits.max_num_seqs} (see Describe)"
        )
    num_tokens = sum(len(work.token_ids) for work in step.seqs)
    if num_tokens > limits.max_num_batched_tokens:
        raise InvalidArgument(
            f"{num_tokens} tokens in one step; this executor takes at most "
            f"max_num_batched_tokens={limits.max_num_batched_tokens}: chunk the prefill"
        )
    ids = [work.request_id for work in step.seqs]
    if len(set(ids)) != len(ids):
        raise InvalidArgument("a request id appears twice in one step; send each once")


def _plan_seq(work: SequenceWork, held: RequestState | None, limits: Limits) -> PlannedSeq:
    rid = work.request_id
    if not rid:
        raise InvalidArgument("request_id is empty; give every sequence an id")
    if held is None and work.sampling is None:
        raise NotFound(f"request {rid!r} is not held here: send sampling params on its first step")
    if held is not None and work.sampling is not None:
        raise InvalidArgument(
            f"request {rid!r} is already held: send sampling params only on its first step"
        )
    if held is not None and work.lora_adapter:
        raise InvalidArgument(
            f"request {rid!r} is already held: send lora_adapter only on its first step"
        )
    if work.sampling is not None:
        try:
            check_sampling(work.sampling, limits.vocab_size, limits.max_model_len)
        except InvalidArgument as exc:
            raise InvalidArgument(f"request {rid!r}: sampling {exc}") from None
    if not work.token_ids:
        raise InvalidArgument(f"request {rid!r}: token_ids is empty; send at least one token")
    token_ids = work.token_ids
    if work.use_sampled_token:
        token_ids = (_sampled_token(rid, held), *token_ids[1:])
    bad = [t for t in work.token_ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise InvalidArgument(
            f"request {rid!r}: token id {bad[0]} is outside the vocabulary [0, {limits.vocab_size})"
        )
    if work.sampling is not None or work.history_token_ids:
        check_history(work, limits.vocab_size)
    check_prompt(work, held.prompt_token_ids if held is not None else None, limits.vocab_size)
    expected = held.num_tokens if held is not None else None
    if expected is not None and work.start_position != expected:
        raise InvalidArgument(
            f"request {rid!r}: start_position {work.start_position} does not continue the "
            f"{expected} tokens held; send start_position={expected}"
        )
    end = work.start_position + len(work.token_ids)
    if end > limits.max_model_len:
        raise InvalidArgument(
            f"request {rid!r}: {end} tokens exceed max_model_len={limits.max_model_len}"
        )
    table = held.block_table if held is not None else []
    delta = work.delta or BlockTableDelta(start_index=len(table))
    if delta.start_index > len(table):
        raise InvalidArgument(
            f"request {rid!r}: delta start_index {delta.start_index} is past the end of its "
            f"{len(table)}-block table; start at or before {len(table)}"
        )
    bad = [b for b in delta.block_ids if not 0 <= b < limits.num_blocks]
    if bad:
        raise InvalidArgument(
            f"request {rid!r}: block id {bad[0]} is outside [0, {limits.num_blocks})"
        )
    new_table = (*table[: delta.start_index], *delta.block_ids)
    if len(new_table) > limits.max_blocks_per_seq:
        raise InvalidArgument(
            f"request {rid!r}: a {len(new_table)}-block table exceeds max_model_len="
            f"{limits.max_model_len} ({limits.max_blocks_per_seq} blocks of {limits.block_size})"
        )
    capacity = len(new_table) * limits.block_size
    if capacity < end:
        raise InvalidArgument(
            f"request {rid!r}: its {len(new_table)} blocks hold {capacity} tokens but the step "
            f"reaches position {end}; send the missing blocks in delta"
        )
    sampling = work.sampling or (held.sampling if held is not None else None)
    prompt = work.prompt_token_ids or (held.prompt_token_ids if held is not None else None)
    if work.num_draft_tokens:
        _check_drafts(work, sampling, prompt, limits.max_draft_tokens)
    return PlannedSeq(work=work, block_table=new_table, is_new=held is None, token_ids=token_ids,
                      prompt_token_ids=prompt or None,
                      num_prompt_logprobs=(sampling.prompt_logprobs or 0) if sampling else 0)


def _check_drafts(work: SequenceWork, sampling: SamplingParams | None,
                  prompt: tuple[int, ...] | None, max_drafts: int) -> None:
    """Drafts are verified greedily, one sampled token per row: only where a row's token is
    its argmax and nothing else is reported per row."""
    rid, n = work.request_id, work.num_draft_tokens
    if not max_drafts:
        raise Unimplemented(
            f"request {rid!r}: this executor verifies no draft tokens (--max-draft-tokens 0 in "
            "Describe)")
    if not 0 < n <= max_drafts or n != len(work.token_ids) - 1:
        raise InvalidArgument(
            f"request {rid!r}: num_draft_tokens={n} is out of range: 1..{max_drafts} "
            f"(Describe's max_draft_tokens), and one less than its {len(work.token_ids)} "
            "token_ids (its known token, then the drafts)"
        )
    if not work.sample or work.use_sampled_token:
        raise InvalidArgument(
            f"request {rid!r}: draft tokens need sample and a known first token (not "
            "use_sampled_token)"
        )
    assert sampling is not None, "checked above: a held or new request has sampling"
    if (not sampling.greedy or sampling.edits_logits or sampling.top_logprobs
            or prompt is not None):
        raise InvalidArgument(
            f"request {rid!r}: draft tokens are verified only under greedy sampling with no "
            "logits processor, logprobs or prompt logprobs"
        )


def _sampled_token(rid: str, held: RequestState | None) -> int:
    """The token a use_sampled_token row stands for."""
    if held is None:
        raise FailedPrecondition(
            f"request {rid!r}: use_sampled_token on a request not held here (it has sampled "
            f"nothing yet): send its token id"
        )
    if held.sampled_token is None:
        raise FailedPrecondition(
            f"request {rid!r}: use_sampled_token, but its last step sampled no token here (or "
            f"a step has already used it): send its token id"
        )
    return held.sampled_token


def plan_step(step: StepRequest, requests: Mapping[str, RequestState], limits: Limits) -> StepPlan:
    """Check the whole step in the order it would apply; raise before anything changes."""
    released = tuple(dict.fromkeys(r for r in step.release_request_ids if r in requests))
    _check_budget(step, limits)
    device, cpu = ("device", limits.num_blocks), ("CPU", limits.num_cpu_blocks)
    _check_copies("swap_out", step.swap_out, device, cpu)
    _check_copies("swap_in", step.swap_in, cpu, device)
    _check_copies("copies", step.copies, device, device)
    gone = set(released)
    seqs = tuple(
        _plan_seq(work, None if work.request_id in gone else requests.get(work.request_id), limits)
        for work in step.seqs
    )
    return StepPlan(release_request_ids=released, seqs=seqs)


def idle_request_ids(requests: Mapping[str, RequestState], steps: Sequence[StepRequest],
                     now: float, idle_release_s: float) -> tuple[str, ...]:
    """The requests no step has used for idle_release_s (on the runner's clock), never one
    that `steps` name (they are alive)."""
    named = {w.request_id for step in steps for w in step.seqs}
    return tuple(rid for rid, state in requests.items()
                 if now - state.last_used >= idle_release_s and rid not in named)
