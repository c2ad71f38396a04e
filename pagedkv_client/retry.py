"""When a failed call is tried again: UNAVAILABLE only, with exponential backoff and jitter.

A call is retried only while nothing of it has reached the caller: a unary call, and a stream
that failed before its first response. A stream that has yielded is never retried (the
caller holds part of an answer that a new request would not continue); its error is raised.
Every attempt shares the call's one deadline: retries stop when the next backoff would pass it.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import grpc

RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE})


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Attempt k + 1 waits min(max_backoff_s, initial_backoff_s * multiplier ** (k - 1)),
    scaled by a random factor in [1 - jitter, 1 + jitter], after attempt k failed with
    UNAVAILABLE. The defaults ride out about 3 s of a gateway that is not up yet."""

    max_attempts: int = 6  # 1: never retry
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 2.0
    multiplier: float = 2.0
    jitter: float = 0.2

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("RetryPolicy.max_attempts must be >= 1 (1: never retry)")
        if not 0 < self.initial_backoff_s <= self.max_backoff_s:
            raise ValueError("RetryPolicy needs 0 < initial_backoff_s <= max_backoff_s")
        if self.multiplier < 1 or not 0 <= self.jitter < 1:
            raise ValueError("RetryPolicy needs multiplier >= 1 and 0 <= jitter < 1")

    def backoff_s(self, retry: int) -> float:
        """The wait before retry number `retry` (1: the first)."""
        base = min(self.max_backoff_s, self.initial_backoff_s * self.multiplier ** (retry - 1))
        return base * random.uniform(1 - self.jitter, 1 + self.jitter)

    def channel_options(self) -> tuple[tuple[str, int], ...]:
        """gRPC's own reconnect backoff, kept in step: a channel whose connection was refused
        waits this long before it tries again, and fails calls at once meanwhile."""
        return (("grpc.initial_reconnect_backoff_ms", round(self.initial_backoff_s * 1000)),
                ("grpc.max_reconnect_backoff_ms", round(self.max_backoff_s * 1000)))


DEFAULT_RETRY = RetryPolicy()
NO_RETRY = RetryPolicy(max_attempts=1)


@dataclass(slots=True)
class Attempts:
    """One call's tries so far and its deadline (time.monotonic(); None: none)."""

    policy: RetryPolicy
    deadline: float | None
    made: int = 0

    @classmethod
    def start(cls, policy: RetryPolicy, timeout: float | None) -> Attempts:
        return cls(policy, None if timeout is None else time.monotonic() + timeout)

    def next_timeout(self) -> float | None:
        """Count one more attempt; the seconds it has (what is left of the deadline)."""
        self.made += 1
        if self.deadline is None:
            return None
        return max(0.0, self.deadline - time.monotonic())

    def backoff_after(self, error: grpc.RpcError) -> float | None:
        """How long to wait before trying again after `error`; None: give up, raise it."""
        code = error.code() if hasattr(error, "code") else None
        if code not in RETRYABLE or self.made >= self.policy.max_attempts:
            return None
        delay = self.policy.backoff_s(self.made)
        if self.deadline is not None and time.monotonic() + delay >= self.deadline:
            return None
        return delay
