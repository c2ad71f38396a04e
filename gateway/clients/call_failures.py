"""What a failed allocator or executor call means to an engine, decided at the client edge.

The clients (allocator_client.py, executor_client.py) turn every gRPC error into one of these
(`translated`); past them nothing branches on a status code. The allocator's statuses say:

    Lost      no answer: unreachable, or past its deadline. Whether the call was applied is
              unknown (Step, Free, Fork and ReserveHandOff are not idempotent: never resend
              them; a reservation that may have landed is aborted).
    Unknown   something the call named is not known there: our pool, our lease (it expired,
              or the allocator restarted), or a request (gone already).
    Stale     the pool moved on: a new epoch (re-registered, or reset by a new executor), or
              a request in a state the call does not fit.
    Denied    a request of another lease (another gateway's, with the same id).
    Rejected  refused for anything else (a malformed call, a broken contract, a bug there):
              nothing was applied, and sending it again will not change that.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import grpc


class CallFailed(Exception):
    def __init__(self, status: str, details: str) -> None:
        super().__init__(f"{status}: {details}")
        self.status = status  # the gRPC status name, for logs and messages
        self.details = details


class Lost(CallFailed):
    pass


class Unknown(CallFailed):
    pass


class Stale(CallFailed):
    pass


class Denied(CallFailed):
    pass


class Rejected(CallFailed):
    pass


_BY_CODE: dict[grpc.StatusCode, type[CallFailed]] = {
    grpc.StatusCode.UNAVAILABLE: Lost,
    grpc.StatusCode.DEADLINE_EXCEEDED: Lost,
    grpc.StatusCode.NOT_FOUND: Unknown,
    grpc.StatusCode.FAILED_PRECONDITION: Stale,
    grpc.StatusCode.PERMISSION_DENIED: Denied,
}


def failure(code: grpc.StatusCode, details: str) -> CallFailed:
    """The outcome of a call that ended with `code`."""
    return _BY_CODE.get(code, Rejected)(code.name, details)


@contextmanager
def translated() -> Iterator[None]:
    """Around a stub call: a gRPC error leaves as its CallFailed."""
    try:
        yield
    except grpc.aio.AioRpcError as exc:
        raise failure(exc.code(), exc.details() or "") from exc
