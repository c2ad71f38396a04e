"""Requests and their sequences: the state machine the scheduler moves them through.

    WAITING --admitted--> RUNNING --finished--> FINISHED
       ^                   |   |
       +---preempted-------+   +--swapped out--> SWAPPED --swapped in--> RUNNING
           (recompute: prompt + generated tokens are recomputed on readmission)

A `Request` is what a client asked for; it owns `n` completions (one `Sequence` each; with
n > 1 a prefill-only parent sequence computes the shared prompt once and is then forked). A
beam search's sequences are its running beams (beam_search.py), forked and freed as the search
goes; its n completions are its best hypotheses, emitted when it ends.
"""

from __future__ import annotations

import asyncio
import enum
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from common.errors import ServiceError
from common.executor_description import LoraAdapterInfo
from gateway.api.sampling import SamplingOptions
from gateway.core.beam_search import BeamSearch
from gateway.core.step import ExecSampling


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    # Computed and idle, waiting for its hand-off to another executor (engine/hand_off.py).
    PARKED = "parked"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A generated token's log-probability under the model's raw distribution, and the most
    likely tokens' (as many as the request's sampling.logprobs asks for)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class PromptLogprob:
    """A prompt token's log-probability given the tokens before it, its rank (1: the most
    likely) and the most likely tokens' (as many as sampling.prompt_logprobs asks for)."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class CompletionDelta:
    """What one step produced for one completion, queued for the client's stream."""

    index: int
    token_ids: tuple[int, ...] = ()
    text: str = ""
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    error: ServiceError | None = None
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token, when the request asked
    # On a completion's first delta, when the request asked: one per prompt token (None for
    # the first, which has no predecessor).
    prompt_logprobs: tuple[PromptLogprob | None, ...] | None = None


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingOptions
    cache_salt: str
    # The gateway's namespace for this request's sequence ids at the allocator and the
    # executors (seq_ids.py): another gateway, or this one before a restart, may use the same
    # request id, and a collision there would refuse a whole step.
    id_namespace: str = ""
    tenant: str = ""  # "" when the gateway has no API keys (one tenant)
    outputs: asyncio.Queue[CompletionDelta] = field(default_factory=asyncio.Queue)
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None  # its first admission (queue time)
    num_cached_tokens: int | None = None   # from the first admission
    cancelled: bool = False
    # The loop that reads `outputs` (the API's), and its thread: an engine on another
    # thread posts deltas to it (engine/host.py).
    loop: asyncio.AbstractEventLoop | None = field(default_factory=_running_loop)
    thread_id: int = field(default_factory=threading.get_ident)
    # use_beam_search: the search over this request's sequences (engine/beams.py runs it).
    beam_search: BeamSearch[Sequence] | None = None
    # sampling.prompt_logprobs: each prompt position's entry as the executor reports it (the
    # first stays None); kept across recomputes, the first report of a position wins.
    prompt_logprobs: list[PromptLogprob | None] | None = None
    # The LoRA adapter it runs with (None: the base model); only executors that serve it
    # (ExecutorDescription.serves) take it, and its blocks hash with the adapter's digest.
    lora: LoraAdapterInfo | None = None

    @property
    def needs_prompt_logprobs(self) -> bool:
        """It asked for its prompt's logprobs and some are still to come: its prefill reads
        no cached prefix and asks the executor for them."""
        if self.sampling.prompt_logprobs is None or len(self.prompt_token_ids) < 2:
            return False
        got = self.prompt_logprobs
        return got is None or any(entry is None for entry in got[1:])

    def prompt_logprobs_out(self) -> tuple[PromptLogprob | None, ...]:
        """What a completion's first delta carries: one entry per prompt token."""
        return tuple(self.prompt_logprobs or [None] * len(self.prompt_token_ids))

    def record_prompt_logprobs(self, first_position: int, logprobs: Iterable[float],
                               ranks: Iterable[int],
                               tops: Iterable[tuple[tuple[int, float], ...]]) -> None:
        prompt = self.prompt_token_ids
        if self.prompt_logprobs is None:
            self.prompt_logprobs = [None] * len(prompt)
        got = self.prompt_logprobs
        for position, (logprob, rank, top) in enumerate(zip(logprobs, ranks, tops, strict=True),
                                                        first_position):
            if 0 < position < len(prompt) and got[position] is None:
                got[position] = PromptLogprob(prompt[position], logprob, rank, top)

    @property
    def num_seqs(self) -> int:
        """The most sequences it runs at once (n, or the beam width): what tenant quotas
        count, whichever of them are still running."""
        beam = self.sampling.beam
        return beam.beam_width if beam is not None else self.sampling.n

    def emit(self, delta: CompletionDelta) -> None:
        emit_all(((self, delta),))


def emit_all(deltas: Iterable[tuple[Request, CompletionDelta]]) -> None:
    """Every delta to its request's stream, in order; from another thread, each reading
    loop gets one callback for all of its deltas (one wake-up, not one per delta)."""
    here = threading.get_ident()
    posted: dict[asyncio.AbstractEventLoop, list[tuple[Request, CompletionDelta]]] = {}
    for request, delta in deltas:
        if request.loop is None or request.thread_id == here:
            request.outputs.put_nowait(delta)
        else:
            posted.setdefault(request.loop, []).append((request, delta))
    for loop, batch in posted.items():
        loop.call_soon_threadsafe(_put_all, batch)


def _put_all(batch: list[tuple[Request, CompletionDelta]]) -> None:
    for request, delta in batch:
        request.outputs.put_nowait(delta)


@dataclass(slots=True, eq=False)
class Sequence:
    """One completion (or the n > 1 prefill parent) as the scheduler sees it."""

    seq_id: str
    request: Request
    index: int
    is_prefill_parent: bool = False
    status: SeqStatus = SeqStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)  # sampled values only
    # Tokens sampled by a batch in flight whose values have not come back (0 or 1): they count
    # as the sequence's last tokens while the next batch is built on top of that one (the
    # executor fills the value in itself: use_sampled_token), until it lands (Scheduler.fill).
    num_placeholders: int = 0
    num_computed_tokens: int = 0
    num_allocator_tokens: int = 0  # token values the allocator holds (0: not admitted there)
    known_to_allocator: bool = False
    known_to_executor: bool = False
    # Depth 2: tokens it computes in the batch executing now, and whether that batch
    # samples its next token.
    num_in_flight: int = 0
    samples_in_flight: bool = False
    # NOTE: no copy of the block table is kept: the allocator's grants go straight to the
    # executor. A sequence new at the executor needs its whole table, and every grant that
    # starts one carries it from index 0 (admission, swap-in), except a forked child's: the
    # Fork response carries its table, and its first grant changes one block (a copy-on-write
    # or an appended block) or is absent (it writes in place). So a forked child keeps the
    # Fork's table until its first Execute has carried it (execute_call.py: _first_table).
    fork_table: tuple[int, ...] | None = None
    num_preemptions: int = 0
    seed_offset: int = 0
    finish_reason: FinishReason | None = None
    # The last landed token's logprobs, when the request asked for them (Scheduler.fill).
    last_logprob: TokenLogprob | None = None
    # One of a beam search's beams (request.beam_search): its tokens come from the search,
    # not from the executor. Once its step landed, its most likely next tokens (token id,
    # logprob) wait for its search's other beams.
    is_beam: bool = False
    beam_candidates: tuple[tuple[int, float], ...] | None = None
    # A beam the allocator pushed out or did not admit for lack of room, until admitted: its
    # siblings must not hold blocks meanwhile (SequenceQueues.set_aside_landed_beams).
    waits_for_room: bool = False
    # A move to another executor was refused or found no target: it finishes where it is.
    stays: bool = False
    # Speculative decoding: drafts its last batch accepted, until a Step has told the
    # allocator (None: nothing to tell); and tokens landed with the one being emitted that
    # follow it in output_token_ids (the engine emits them one by one: finish_rules.py).
    accepted_drafts: int | None = None
    num_unemitted: int = 0
    # Its tokens as C ints, kept up to date by the draft proposer (core/drafts.py: pack).
    packed_tokens: bytearray = field(default_factory=bytearray)
    # Its request has stop strings: the detokenizer its landed tokens go through, in order
    # (core/finish_rules.py; a text.detokenizer.Detokenizer). None until its first token.
    stop_text: Any = None

    @property
    def token_ids(self) -> list[int]:
        """Every token the sequence holds: the prompt, then the generated ones (not the
        placeholders, whose values are still in flight)."""
        if self.is_prefill_parent:
            return self.request.prompt_token_ids[:-1]
        return self.request.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, stop: int | None = None) -> list[int]:
        """token_ids[start:stop] without building the whole list (hot path); never reaches
        into the placeholders."""
        prompt = self.request.prompt_token_ids
        num_prompt = len(prompt) - 1 if self.is_prefill_parent else len(prompt)
        num_known = self.num_tokens - self.num_placeholders
        stop = num_known if stop is None else stop
        assert stop <= num_known, f"{self.seq_id}: a placeholder's value asked for"
        if stop <= num_prompt:
            return prompt[start:stop]
        outputs = self.output_token_ids
        if start >= num_prompt:
            return outputs[start - num_prompt : stop - num_prompt]
        return prompt[start:num_prompt] + outputs[: stop - num_prompt]

    def token_at(self, position: int) -> int:
        """token_ids[position] (hot path: a generated token, for the allocator's appends)."""
        num_prompt = len(self.request.prompt_token_ids)
        if position >= num_prompt and not self.is_prefill_parent:
            return self.output_token_ids[position - num_prompt]
        return self.token_slice(position, position + 1)[0]

    @property
    def last_token_id(self) -> int:
        """token_ids[-1] of a sequence that is not a prefill parent (hot path)."""
        assert not self.is_prefill_parent, f"{self.seq_id}: a prefill parent's last token"
        assert not self.num_placeholders, f"{self.seq_id}: its last token is a placeholder"
        outputs = self.output_token_ids
        return outputs[-1] if outputs else self.request.prompt_token_ids[-1]

    @property
    def num_tokens(self) -> int:
        if self.is_prefill_parent:
            return len(self.request.prompt_token_ids) - 1
        return (
            len(self.request.prompt_token_ids) + len(self.output_token_ids)
            + self.num_placeholders
        )

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def exec_sampling(self) -> ExecSampling:
        """The sampling of the sequence's first Execute, which starts at num_computed_tokens
        (a cached prefix, or an n > 1 child after its parent's prompt). A beam asks for its
        search's candidates as top logprobs (greedy: the executor's own pick is not used)."""
        options = self.request.sampling
        top_logprobs = options.logprobs or 0
        if options.beam is not None:
            top_logprobs = options.beam.num_candidates
        # Children of n > 1 use seed + index, wrapped to the proto's uint64 range.
        seed = None if options.seed is None else (options.seed + self.seed_offset) % 2**64
        start = self.num_computed_tokens
        num_prompt = len(self.request.prompt_token_ids)
        replays = options.structured_output is not None and start > num_prompt
        return ExecSampling(
            temperature=options.temperature, top_p=options.top_p, top_k=options.top_k,
            seed=seed, min_p=options.min_p, presence_penalty=options.presence_penalty,
            frequency_penalty=options.frequency_penalty,
            repetition_penalty=options.repetition_penalty, logit_bias=options.logit_bias,
            min_tokens=options.min_tokens,
            stop_token_ids=tuple(sorted(options.stop_token_ids)) if options.min_tokens else (),
            ignore_eos=options.ignore_eos,
            # After a recompute the executor is sent prompt + generated tokens as one request.
            num_prompt_tokens=num_prompt,
            top_logprobs=top_logprobs,
            history_token_ids=(
                tuple(self.token_slice(0, start))
                if (options.has_penalties and start) or replays else ()
            ),
            structured_output=options.structured_output,
            lora_adapter=self.request.lora.name if self.request.lora is not None else "",
            lora_adapter_digest=self.request.lora.digest if self.request.lora is not None else "",
            **self._prompt_logprobs_fields(),
        )

    def _prompt_logprobs_fields(self) -> dict[str, Any]:
        request = self.request
        if not request.needs_prompt_logprobs:
            return {}
        return {"prompt_logprobs": request.sampling.prompt_logprobs,
                "prompt_token_ids": tuple(request.prompt_token_ids)}

    def reset_for_recompute(self) -> None:
        """Forget everything the allocator and executor held: readmission starts over."""
        self.status = SeqStatus.WAITING
        self.num_computed_tokens = 0
        self.num_allocator_tokens = 0
        self.known_to_allocator = False
        self.num_in_flight = 0
        self.samples_in_flight = False
        self.fork_table = None
        self.accepted_drafts = None
        self.num_unemitted = 0
        self.num_preemptions += 1
        self.beam_candidates = None  # computed again, with the rest


def priority(seq: Sequence) -> tuple[int, float, int]:
    """Scheduling order: the request's priority (lower first), then FCFS: its arrival, then
    the completion's index."""
    return (seq.request.sampling.priority, seq.request.arrival_time, seq.index)
