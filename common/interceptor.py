"""Every RPC handler of our services, wrapped once at registration: binds the request id and
maps errors to statuses.

Domain exceptions (common.errors) become their precise status with their message; anything
else is a bug: logged with its traceback and returned as INTERNAL without the stack trace.

Why not a `grpc.aio.ServerInterceptor`: an interceptor runs per call (an awaited
`intercept_service`, a new handler object) and cost ~30 us a call here; so did a
`bound_contextvars` block and a uuid4 (an os.urandom syscall) for calls without an id. A
handler wrapped at start-up binds with one `bind_contextvars`, which cannot leak: grpc aio
runs each call in its own task, with its own copy of the context.
"""

from __future__ import annotations

import contextlib
import itertools
import secrets
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
import structlog
from google.protobuf import descriptor_pool

from common.errors import ServiceError

REQUEST_ID_KEY = "x-request-id"

log = structlog.get_logger(__name__)

# Ids for calls that bring none: unique per process (the prefix), cheap (a counter).
_ID_PREFIX = secrets.token_hex(8)
_next_id = itertools.count(1)

S = TypeVar("S")


def _request_id(context: grpc.aio.ServicerContext) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == REQUEST_ID_KEY:
            return str(value)
    return f"{_ID_PREFIX}-{next(_next_id):x}"


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
        structlog.contextvars.bind_contextvars(request_id=_request_id(context))
        try:
            return await fn(request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - the one place that maps every error
            await _abort(context, method, exc)

    return handler


def _wrap_stream(method: str, fn: Callable[..., AsyncGenerator[Any, None]]) -> Callable[..., Any]:
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        structlog.contextvars.bind_contextvars(request_id=_request_id(context))
        try:
            # aclosing: closing this generator (a client gone) closes the handler's at once,
            # so its cleanup (cancelling the request) does not wait for the collector.
            async with contextlib.aclosing(fn(request, context)) as items:
                async for item in items:
                    yield item
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001
            await _abort(context, method, exc)

    return handler


def guard(servicer: S, service_name: str) -> S:
    """Wrap each RPC method of `servicer` (named by the service's descriptor) in place;
    returns it, for `add_XServicer_to_server`. Wrapping twice is a no-op. In place: a
    direct call of a guarded method binds a request id into the caller's context and needs
    a real ServicerContext (tests call the core, or the servicer before registering it)."""
    service = descriptor_pool.Default().FindServiceByName(service_name)
    for method in service.methods:
        fn = getattr(servicer, method.name)
        if getattr(fn, "guarded", False):
            continue
        assert not method.client_streaming, f"{method.full_name}: client streaming is not wrapped"
        path = f"/{service.full_name}/{method.name}"
        wrap = _wrap_stream if method.server_streaming else _wrap_unary
        wrapped = wrap(path, fn)
        setattr(wrapped, "guarded", True)  # noqa: B010 - a marker on a function
        setattr(servicer, method.name, wrapped)
    return servicer
