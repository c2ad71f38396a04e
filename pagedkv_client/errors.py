"""The one exception the client raises: a gRPC status code with the gateway's message."""

from __future__ import annotations

import grpc


class PagedkvError(Exception):
    """A call to the gateway failed.

    `code` is the gRPC status (`grpc.StatusCode`), `details` the gateway's message: for a
    caller's mistake (INVALID_ARGUMENT, ALREADY_EXISTS, ...) it names the field and what to
    change. `attempts` counts the tries made, retries included (UNAVAILABLE, see RetryPolicy).
    """

    def __init__(self, code: grpc.StatusCode, details: str, attempts: int = 1) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.attempts = attempts

    def __reduce__(self) -> tuple[type[PagedkvError], tuple[grpc.StatusCode, str, int]]:
        return type(self), (self.code, self.details, self.attempts)


def from_rpc_error(error: grpc.RpcError, attempts: int = 1) -> PagedkvError:
    """The typed error for a failed call (blocking or asyncio)."""
    code = error.code() if hasattr(error, "code") else None
    details = error.details() if hasattr(error, "details") else None
    return PagedkvError(code if isinstance(code, grpc.StatusCode) else grpc.StatusCode.UNKNOWN,
                        details or str(error), attempts)
