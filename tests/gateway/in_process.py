"""The allocator and an executor in process, for scheduler and engine unit tests.

`CorePool` is the real allocator core (`allocator_svc.core.Allocator`) behind the gateway's
plain-value calls: it maps a `StepCall` the way allocator_client.py and allocator_svc/convert.py
map it over the wire (compact decodes first, then the other items), so the scheduler meets the
real allocation, prefix caching, preemption and deferral. A domain error comes back as the
call failure the gateway's allocator client would raise for its status.

`FakeModel` checks positions like the executor does, keeps token ids in KV slots, and samples
a token that depends on every token read back through the block table.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from allocator_svc import convert
from allocator_svc.core import step as core_step
from allocator_svc.core.allocator import Allocator, Limits
from allocator_svc.core.pool import Pool, PoolConfig
from common.errors import FailedPrecondition, InvalidArgument, ServiceError
from common.step_records import Commit, StepCall
from gateway.clients import allocator_client
from gateway.clients.call_failures import CallFailed, failure
from gateway.core.step import (
    ExecuteCall,
    ExecuteResult,
    PromptLogprobRun,
    Sampled,
    SeqWork,
    StepOutcome,
    TableDelta,
)
from pagedkv.allocator.v1 import allocator_pb2 as pb

POOL_ID = "pool-0"


def rpc_error(exc: ServiceError) -> CallFailed:
    """What the gateway's client raises for the status the allocator's guarded handler sends
    for a domain error."""
    return failure(exc.code, str(exc))


def _outcome(result: core_step.StepResult, num_free_blocks: int, block_size: int) -> StepOutcome:
    # Through the real conversions on both sides of the wire (compact forms included).
    response = convert.step_response(result, num_free_blocks, block_size)
    return allocator_client._outcome(pb.StepResponse.FromString(response.SerializeToString()))


class CorePool:
    """One registered pool of the real allocator core, called like `PoolLink` calls it."""

    def __init__(
        self, num_blocks: int, block_size: int, num_cpu_blocks: int = 0,
        enable_prefix_caching: bool = True,
    ) -> None:
        self.allocator = Allocator(Limits())
        config = PoolConfig(POOL_ID, num_blocks, block_size, num_cpu_blocks, "fake-model",
                            "instance-0", enable_prefix_caching)
        pool, _ = self.allocator.register_pool(config)
        self.epoch = pool.epoch

    @property
    def pool(self) -> Pool:
        return self.allocator.pools[POOL_ID]

    @property
    def num_preemptions(self) -> int:
        return self.pool.num_preemptions

    def all_free(self) -> bool:
        """Every block back and no request held (the invariants checked on the way)."""
        pool = self.pool
        pool.check_invariants()
        return not pool.requests and pool.blocks.num_free == pool.config.num_blocks

    def step(self, call: StepCall) -> StepOutcome:
        try:
            result = self.allocator.step(POOL_ID, self.epoch, None, call)
        except ServiceError as exc:
            raise rpc_error(exc) from exc
        self.pool.check_invariants()
        return _outcome(result, self.pool.blocks.num_free, self.pool.block_size)

    def free(
        self, commits: Sequence[Commit], request_ids: Sequence[str], commit_through_step_id: int
    ) -> int:
        """The pool's free blocks once applied, as the Free response says (so does abort)."""
        try:
            self.allocator.free(POOL_ID, self.epoch, list(commits), list(request_ids), None,
                                commit_through_step_id)
        except ServiceError as exc:
            raise rpc_error(exc) from exc
        return self.pool.blocks.num_free

    def abort(self, request_ids: Sequence[str]) -> int:
        try:
            self.allocator.abort(POOL_ID, self.epoch, list(request_ids))
        except ServiceError as exc:
            raise rpc_error(exc) from exc
        return self.pool.blocks.num_free

    def fork(self, parent_id: str, child_ids: Sequence[str]) -> list[TableDelta]:
        try:
            children = self.allocator.fork(POOL_ID, self.epoch, parent_id, list(child_ids))
        except ServiceError as exc:
            raise rpc_error(exc) from exc
        return [TableDelta(0, tuple(b.block_id for b in c.blocks)) for c in children]


def _use_sampled(call: ExecuteCall) -> tuple[bool, ...]:
    """decode_use_sampled_token, one per compact decode (empty means none)."""
    return call.decode_use_sampled_token or (False,) * len(call.decode_request_ids)


@dataclass(slots=True)
class Held:
    """What the executor holds for one request: its token count and block table."""

    num_tokens: int
    table: list[int] = field(default_factory=list)
    sampled: int | None = None  # the last step's sampled token, until a step uses it
    prompt: tuple[int, ...] | None = None  # when it asked for its prompt's logprobs


@dataclass(slots=True)
class FakeModel:
    """An executor whose KV cache stores token ids in slots (block_id x block_size + offset).

    A sampled token depends on every token read back through the block table, so a wrong
    table, a missing copy or swap, or a prefix-cache hit on blocks nobody wrote (the commit
    rule) changes the output or fails an assertion.
    """

    block_size: int
    vocab_size: int = 97
    held: dict[str, Held] = field(default_factory=dict)
    gpu: dict[int, list[int | None]] = field(default_factory=dict)  # block_id -> slots
    cpu: dict[int, list[int | None]] = field(default_factory=dict)
    num_swapped_out: int = 0  # blocks
    prompt_runs: list[PromptLogprobRun] = field(default_factory=list)  # the step's
    num_accepted: int = 0  # the last row's accepted drafts (SeqWork.num_draft_tokens)
    most_drafts: int = 0  # the most drafts one row carried

    def next_token(self, tokens: list[int]) -> int:
        acc = 7
        for t in tokens:
            acc = (acc * 31 + t) % 1_000_003
        return acc % self.vocab_size

    def _block(self, block_id: int) -> list[int | None]:
        return self.gpu.setdefault(block_id, [None] * self.block_size)

    def _read(self, held: Held) -> list[int]:
        bs = self.block_size
        tokens = [self._block(held.table[p // bs])[p % bs] for p in range(held.num_tokens)]
        assert None not in tokens, "read a slot nobody wrote (a cache hit before its commit?)"
        return [t for t in tokens if t is not None]

    def execute(self, call: ExecuteCall) -> ExecuteResult:
        self._check(call)
        # The executor's order: releases, swap out, swap in, copies, then the forward pass.
        for request_id in call.release_request_ids:  # unknown ids are ignored (the contract)
            self.held.pop(request_id, None)
        self.num_swapped_out += len(call.swap_out)
        for c in call.swap_out:
            self.cpu[c.dst_block_id] = list(self._block(c.src_block_id))
        for c in call.swap_in:
            self.gpu[c.dst_block_id] = list(self.cpu.pop(c.src_block_id))
        for c in call.copies:
            self.gpu[c.dst_block_id] = list(self._block(c.src_block_id))
        use_sampled = _use_sampled(call)
        self.prompt_runs = []
        decode_tokens = [
            self._run(SeqWork(rid, (token,), position, None, True, None, chained))
            for rid, token, position, chained in zip(
                call.decode_request_ids, call.decode_token_ids, call.decode_positions,
                use_sampled, strict=True,
            )
        ]
        sampled = [Sampled(seq.request_id, token, num_accepted=self.num_accepted)
                   for seq in call.seqs if (token := self._run(seq)) is not None]
        return ExecuteResult(tokens=tuple(sampled), compute_ms=0.0,
                             decode_token_ids=tuple(t for t in decode_tokens if t is not None),
                             prompt_logprobs=tuple(self.prompt_runs))

    def prompt_logprob(self, before: list[int], token: int) -> tuple[float, int]:
        """A made-up log-probability and rank of `token` after `before` (read through the
        block table, as the sampled tokens are)."""
        rank = 1 + (token - self.next_token(before)) % self.vocab_size
        return -rank / 10, rank

    def reference_prompt_logprobs(self, prompt: list[int]) -> list[tuple[float, int]]:
        return [self.prompt_logprob(prompt[:p], prompt[p]) for p in range(1, len(prompt))]

    def _check(self, call: ExecuteCall) -> None:
        """What the executor rejects before it changes anything, as the status it sends: a
        row that does not continue what it holds, or uses a sampled token it does not have
        (a batch launched ahead of one that was rejected)."""
        gone = set(call.release_request_ids)
        rows = [(rid, position, chained) for rid, position, chained in zip(
            call.decode_request_ids, call.decode_positions,
            _use_sampled(call),
            strict=True)]
        rows += [(s.request_id, s.start_position, s.use_sampled_token) for s in call.seqs
                 if s.sampling is None]
        for request_id, position, chained in rows:
            held = None if request_id in gone else self.held.get(request_id)
            if held is None or held.num_tokens != position:
                raise rpc_error(InvalidArgument(f"{request_id}: start_position {position}"))
            if chained and held.sampled is None:
                raise rpc_error(FailedPrecondition(f"{request_id}: no sampled token"))

    def _run(self, seq: SeqWork) -> int | None:
        """Write the sequence's tokens into its slots; its sampled token, if it samples."""
        bs = self.block_size
        held = self.held.get(seq.request_id)
        if seq.sampling is not None:
            assert held is None, f"{seq.request_id} created twice"
            # A prefix-cache hit starts past 0: those tokens are in the cached blocks.
            held = self.held[seq.request_id] = Held(seq.start_position)
            if seq.sampling.prompt_logprobs is not None:
                held.prompt = seq.sampling.prompt_token_ids
        assert held is not None, f"{seq.request_id} is not held: sampling params missing"
        assert seq.start_position == held.num_tokens, (
            f"{seq.request_id}: start {seq.start_position}, executor holds {held.num_tokens}"
        )
        token_ids = seq.token_ids
        if seq.use_sampled_token:
            assert held.sampled is not None, f"{seq.request_id}: no sampled token to use"
            assert token_ids[0] == 0, f"{seq.request_id}: a stand-in sent as {token_ids[0]}"
            token_ids = (held.sampled, *token_ids[1:])
        if seq.delta is not None:
            seq.delta.apply(held.table)
        end = seq.start_position + len(token_ids)
        assert len(held.table) * bs >= end, f"{seq.request_id}: table too short"
        for position, token in enumerate(token_ids, start=seq.start_position):
            self._block(held.table[position // bs])[position % bs] = token
        held.num_tokens = end
        if held.prompt is not None:
            tokens, prompt = self._read(held), held.prompt
            rows = range(seq.start_position, min(end, len(prompt) - 1))
            scored = [self.prompt_logprob(tokens[: p + 1], prompt[p + 1]) for p in rows]
            if scored:
                self.prompt_runs.append(PromptLogprobRun(
                    seq.request_id, rows.start + 1, tuple(lp for lp, _ in scored),
                    tuple(rank for _, rank in scored), ((),) * len(scored)))
        self.num_accepted = 0
        self.most_drafts = max(self.most_drafts, seq.num_draft_tokens)
        if seq.num_draft_tokens:  # greedy verification: each draft must be the next token
            tokens, k = self._read(held), seq.num_draft_tokens
            first = seq.start_position + 1  # the known token's row samples the first draft
            while (self.num_accepted < k and tokens[first + self.num_accepted]
                   == self.next_token(tokens[:first + self.num_accepted])):
                self.num_accepted += 1
            held.num_tokens = first + self.num_accepted
        held.sampled = self.next_token(self._read(held)) if seq.sample else None
        return held.sampled

    def reference(self, prompt: list[int], max_tokens: int) -> list[int]:
        tokens = list(prompt)
        for _ in range(max_tokens):
            tokens.append(self.next_token(tokens))
        return tokens[len(prompt):]
