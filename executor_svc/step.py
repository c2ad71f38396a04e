"""The step vocabulary, free of gRPC: what one Execute asks for and what it returns.

The servicer converts protos to these frozen records (executor_svc.convert); the runner and
everything below it speak only these.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0  # (0, 1]
    top_k: int = 0  # 0: off
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


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


@dataclass(frozen=True, slots=True)
class BlockCopy:
    src_block_id: int
    dst_block_id: int


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
    logprob: float


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
