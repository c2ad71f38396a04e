"""One server interceptor per service: binds the request id and maps errors to statuses.

Domain exceptions (common.errors) become their precise status with their message; anything
else is a bug: logged with its traceback and returned as INTERNAL without the stack trace.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import structlog

from common.errors import ServiceError

REQUEST_ID_KEY = "x-request-id"

log = structlog.get_logger(__name__)


def _request_id(context: grpc.aio.ServicerContext) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == REQUEST_ID_KEY:
            return str(value)
    return uuid.uuid4().hex[:16]


async def _abort(context: grpc.aio.ServicerContext, method: str, exc: BaseException) -> None:
    if isinstance(exc, ServiceError):
        log.info("rpc_rejected", method=method, code=exc.code.name, error=str(exc))
        await context.abort(exc.code, str(exc))
    log.error("rpc_failed", method=method, exc_info=exc)
    await context.abort(
        grpc.StatusCode.INTERNAL, f"internal error in {method}: {type(exc).__name__}"
    )


def _wrap_unary(method: str, fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> Any:
        with structlog.contextvars.bound_contextvars(request_id=_request_id(context)):
            try:
                return await fn(request, context)
            except grpc.aio.AbortError:
                raise
            except Exception as exc:  # noqa: BLE001 - the one place that maps every error
                await _abort(context, method, exc)

    return handler


def _wrap_stream(method: str, fn: Callable[..., AsyncIterator[Any]]) -> Callable[..., Any]:
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        with structlog.contextvars.bound_contextvars(request_id=_request_id(context)):
            try:
                async for item in fn(request, context):
                    yield item
            except grpc.aio.AbortError:
                raise
            except Exception as exc:  # noqa: BLE001
                await _abort(context, method, exc)

    return handler


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Wraps unary-unary and unary-stream handlers (the only shapes our services use)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(method, handler.unary_unary),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(method, handler.unary_stream),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler
