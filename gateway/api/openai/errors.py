"""Errors in OpenAI's JSON shape, with the HTTP status of the gateway's error taxonomy.

    {"error": {"message": "...", "type": "invalid_request_error", "param": null, "code": 400}}

The same domain errors (common/errors.py) that the gRPC API turns into status codes become
HTTP statuses here, so both front doors refuse the same things the same way.
"""

from __future__ import annotations

import grpc
from fastapi.responses import JSONResponse

from common.errors import ServiceError
from gateway.api.sampling import ExceedsCapacity

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


def error_body(status: int, message: str, param: str | None = None) -> dict[str, object]:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"),
                      "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


def status_of(exc: ServiceError) -> int:
    if isinstance(exc, ExceedsCapacity):
        return 400  # the request can never fit: not a rate limit
    return HTTP_STATUS.get(exc.code, 500)


def message_of(exc: ServiceError) -> str:
    # The shared validation names gRPC's message path (sampling.top_p): here fields are flat.
    return str(exc).replace("sampling.", "")
