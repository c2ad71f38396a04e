"""A pool's recorded requests as the replay serves them: prompts and outputs as token ids
(tokens.py), independent of the replayed block size, so one workload serves every probe."""

from __future__ import annotations

from dataclasses import dataclass

from tools.replay.records import PoolTrace, RecordedRequest
from tools.replay.tokens import TokenSource


class ReplayError(Exception):
    """A configuration the workload cannot be replayed at; the message says what to change."""


@dataclass(frozen=True, slots=True)
class Output:
    """One sequence: its tokens when it ended (what it samples at position p is tokens[p]),
    and how many it samples before it ends."""

    tokens: list[int]
    num_outputs: int
    aborted: bool

    def token_at(self, position: int) -> int:
        # (The last token it samples was never fed back: the recording does not have it.)
        return self.tokens[position] if position < len(self.tokens) else 0


@dataclass(frozen=True, slots=True)
class Job:
    """One request: n == 1 (one output), or n > 1 (a prompt computed once, then forked)."""

    request_id: str  # the recorded sequence id
    arrival_s: float
    prompt: list[int]
    outputs: tuple[Output, ...]

    @property
    def max_tokens(self) -> int:
        """The most tokens one of its sequences holds."""
        return max(len(o.tokens) for o in self.outputs)


@dataclass(frozen=True, slots=True)
class Workload:
    jobs: tuple[Job, ...]  # in arrival order
    start_s: float

    @classmethod
    def from_trace(cls, trace: PoolTrace) -> Workload:
        source = TokenSource(trace.shape.block_size)
        return cls(tuple(_job(r, source) for r in trace.requests), trace.start_s)

    def blocks_needed(self, block_size: int) -> tuple[int, Job | None]:
        """The blocks the largest request needs alone, and that request."""
        if not self.jobs:
            return 1, None
        job = max(self.jobs, key=lambda j: j.max_tokens)
        return max(1, -(-job.max_tokens // block_size)), job

    def check_fits(self, num_blocks: int, block_size: int) -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise ReplayError(f"block size must be a positive integer, got {block_size!r}")
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ReplayError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        need, job = self.blocks_needed(block_size)
        if job is not None and num_blocks < need:
            raise ReplayError(
                f"num_blocks={num_blocks} at block size {block_size} cannot hold request "
                f"{job.request_id!r} alone: its {job.max_tokens} tokens need {need} blocks; "
                f"use --num-blocks {need} or more")


def _job(request: RecordedRequest, source: TokenSource) -> Job:
    if not request.children:
        tokens = source.tokens(request)
        output = Output(tokens, len(tokens) - request.num_prompt_tokens + 1, request.aborted)
        return Job(request.request_id, request.arrival_s,
                   tokens[: request.num_prompt_tokens], (output,))
    # n > 1: the parent computed the prompt but its last token; each child takes it from
    # there (the last prompt token, then its own outputs).
    shared = request.num_tokens
    outputs = []
    for child in request.children:
        tokens = source.tokens(child)
        if len(tokens) <= shared:  # ended at the fork: it still holds the last prompt token
            tokens = tokens + source.tokens(_alone(shared + 1 - len(tokens)))
        outputs.append(Output(tokens, len(tokens) - shared, child.aborted))
    prompt = outputs[0].tokens[: shared + 1]
    return Job(request.request_id, request.arrival_s, prompt, tuple(outputs))


def _alone(num_tokens: int) -> RecordedRequest:
    """Tokens nobody else has."""
    return RecordedRequest("", 0.0, 0, num_tokens, b"", None, False)
