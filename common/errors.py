"""Domain exceptions: a caller's mistake, each mapped to one precise gRPC status code.

Raised by plain-Python cores (no gRPC inside); the guarded handlers (common.interceptor) turn
them into statuses. Messages say what was wrong and how to fix it.
"""

from __future__ import annotations

import grpc


class ServiceError(Exception):
    """Base class: a caller-visible error with a gRPC status code."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN


class InvalidArgument(ServiceError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(ServiceError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(ServiceError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(ServiceError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class PermissionDenied(ServiceError):
    code = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhausted(ServiceError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(ServiceError):
    code = grpc.StatusCode.UNAVAILABLE


class Unimplemented(ServiceError):
    code = grpc.StatusCode.UNIMPLEMENTED


class Internal(ServiceError):
    code = grpc.StatusCode.INTERNAL
