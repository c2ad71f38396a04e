"""The handler wrapping every service gets from common.server (real server on loopback):
request ids bound for the handler's logs, domain errors as their status, bugs as INTERNAL
without a traceback, a clean context for every call, and the server still serving after."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
import structlog

from allocator_svc.core.allocator import Allocator, Limits
from allocator_svc.service import AllocatorServicer
from common.auth import ApiKeyAuthenticator, caller, internal_authenticator
from common.credentials import RoleTokens
from common.errors import NotFound
from common.interceptor import REQUEST_ID_KEY, guarded_handler
from common.server import start_server
from pagedkv.allocator.v1 import allocator_pb2 as pb
from pagedkv.allocator.v1 import allocator_pb2_grpc

pytestmark = pytest.mark.service

SERVICE = "pagedkv.allocator.v1.AllocatorService"
log = structlog.get_logger(__name__)


class ProbingAllocator(AllocatorServicer):
    """GetStats logs an event, records what its context held on entry, binds a key of its
    own, and fails as asked: pool 'bug' raises a bug, pool 'gone' a domain error."""

    def __init__(self) -> None:
        super().__init__(Allocator(Limits()))
        self.entry_contexts: list[dict[str, Any]] = []
        self.callers: list[str] = []

    async def GetStats(self, request: Any, context: Any) -> Any:  # noqa: N802
        self.entry_contexts.append(dict(structlog.contextvars.get_contextvars()))
        self.callers.append(caller())
        structlog.contextvars.bind_contextvars(leaky=request.pool_id)
        log.info("probe", pool=request.pool_id)
        if request.pool_id == "bug":
            raise RuntimeError("a bug with a secret in its message")
        if request.pool_id == "gone":
            raise NotFound("pool 'gone' is unknown")
        return pb.GetStatsResponse()


async def _scenario(servicer: ProbingAllocator) -> tuple[list[Any], list[dict[str, Any]]]:
    server = await start_server(
        [(servicer, SERVICE)],
        "127.0.0.1", 0,
    )
    outcomes: list[Any] = []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = allocator_pb2_grpc.AllocatorServiceStub(channel)
            merge = [structlog.contextvars.merge_contextvars]  # as common.logging does
            with structlog.testing.capture_logs(processors=merge) as logs:
                for pool, request_id in [("a", "rid-7"), ("b", None), ("c", None),
                                         ("bug", "rid-bug"), ("gone", None), ("d", None)]:
                    metadata = ((REQUEST_ID_KEY, request_id),) if request_id else None
                    try:
                        await stub.GetStats(pb.GetStatsRequest(pool_id=pool),
                                            metadata=metadata)
                        outcomes.append("ok")
                    except grpc.aio.AioRpcError as exc:
                        outcomes.append((exc.code(), exc.details()))
    finally:
        await server.stop(0)
    return outcomes, logs


def test_guarded_handlers_bind_ids_map_errors_and_keep_serving():
    servicer = ProbingAllocator()
    outcomes, logs = asyncio.run(_scenario(servicer))
    assert outcomes[:3] == ["ok", "ok", "ok"] and outcomes[5] == "ok"
    code, details = outcomes[3]
    assert code is grpc.StatusCode.INTERNAL
    assert details == f"internal error in /{SERVICE}/GetStats: RuntimeError"
    assert outcomes[4] == (grpc.StatusCode.NOT_FOUND, "pool 'gone' is unknown")
    probes = {e["pool"]: e["request_id"] for e in logs if e["event"] == "probe"}
    assert probes["a"] == "rid-7" and probes["bug"] == "rid-bug"
    generated = [probes[p] for p in ("b", "c", "gone", "d")]
    assert len(set(generated)) == 4 and "rid-7" not in generated
    # Every call starts clean: nothing bound by an earlier call (its id, its own keys).
    assert all("leaky" not in c for c in servicer.entry_contexts)
    failed = [e for e in logs if e["event"] == "rpc_failed"]
    assert len(failed) == 1 and failed[0]["request_id"] == "rid-bug"
    assert isinstance(failed[0]["exc_info"], RuntimeError)  # the traceback goes to the log
    rejected = [e for e in logs if e["event"] == "rpc_rejected"]
    assert [e["code"] for e in rejected] == ["NOT_FOUND"]


def test_guarded_handler_refuses_an_unknown_service_name():
    with pytest.raises(KeyError):
        guarded_handler(ProbingAllocator(), "pagedkv.allocator.v1.NoSuchService")


TOKENS = RoleTokens.new()


async def _authenticated_calls(servicer: ProbingAllocator) -> list[Any]:
    """A server with role tokens and with API keys: who gets through, as whom (the scheme's
    name in any case: RFC 7235)."""
    keys = ApiKeyAuthenticator({"key-of-acme-0123456789": "acme"})
    roles = internal_authenticator(TOKENS.auth("allocator"))
    gateway, executor = TOKENS.token("gateway"), TOKENS.token("executor")
    outcomes: list[Any] = []
    for authenticator in (roles, keys):
        server = await start_server([(servicer, SERVICE)], "127.0.0.1", 0,
                                    authenticator=authenticator)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                stub = allocator_pb2_grpc.AllocatorServiceStub(channel)
                for sent in (None, f"Bearer {gateway}", f"bearer {executor}",
                             f"BEARER  {gateway} ", f"Basic {gateway}", f"Bearer {gateway}x",
                             "Bearer key-of-acme-0123456789", "bearer key-of-acme-0123456789",
                             "Bearer key-of-acme-012345678"):
                    metadata = (("authorization", sent),) if sent else None
                    try:
                        await stub.GetStats(pb.GetStatsRequest(pool_id="a"), metadata=metadata)
                        outcomes.append(("ok", servicer.callers[-1]))
                    except grpc.aio.AioRpcError as exc:
                        outcomes.append((exc.code(), exc.details()))
        finally:
            await server.stop(0)
    return outcomes


def test_an_authenticator_admits_only_its_credentials_and_names_the_caller():
    # A role token's principal is its role; lower-case `bearer` is the same scheme.
    servicer = ProbingAllocator()
    outcomes = asyncio.run(_authenticated_calls(servicer))
    unauth = grpc.StatusCode.UNAUTHENTICATED
    missing = (unauth, "this internal service requires a credential: send metadata "
                       "'authorization: Bearer <your role's token>' (or use mutual TLS)")
    invalid = (unauth, "the role token is not valid here (not among the service's "
                       "--caller-digests-file)")
    no_key = (unauth, "an API key is required: send 'authorization: Bearer <key>'")
    bad_key = (unauth, "the API key is not valid")
    assert outcomes == [
        missing, ("ok", "gateway"), ("ok", "executor"), ("ok", "gateway"), missing, invalid,
        invalid, invalid, invalid,
        no_key, bad_key, bad_key, bad_key, no_key, bad_key, ("ok", "acme"), ("ok", "acme"),
        bad_key,
    ]
