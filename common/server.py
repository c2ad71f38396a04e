"""The aio server lifecycle shared by the services.

Standard gRPC health service (always open: probes carry no credentials), reflection (names
from the descriptors; only on a server without authentication, since it is an RPC like any
other), guarded handlers (parsing, authentication, request ids, error statuses, per-RPC
metrics when asked: common.interceptor), plaintext or TLS, a bound port (0 picks a free one:
tests), and graceful shutdown on SIGTERM/SIGINT.
"""

from __future__ import annotations

import asyncio
import gc
import signal
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common.auth import Access, Authenticator
from common.interceptor import guarded_handler
from common.metrics import RpcMetrics

log = structlog.get_logger(__name__)

# A servicer registration: (servicer, full service name).
Registration = tuple[object, str]

MAX_MESSAGE_BYTES = 64 * 1024 * 1024


@dataclass(slots=True)
class Server:
    """A started aio server with its health servicer; `port` is the bound port."""

    server: grpc.aio.Server
    health: health.aio.HealthServicer
    port: int
    service_names: list[str] = field(default_factory=list)

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ["", *self.service_names]:
            await self.health.set(name, status)

    async def stop(self, grace: float = 5.0) -> None:
        await self.set_serving(False)
        await self.server.stop(grace)


async def start_server(
    registrations: Sequence[Registration], host: str, port: int, serving: bool = True,
    *, authenticator: Authenticator | None = None, credentials: Any = None,
    max_receive_bytes: int = MAX_MESSAGE_BYTES, rpc_metrics: RpcMetrics | None = None,
    access: Access | None = None,
) -> Server:
    """Build, bind and start the server; health says SERVING unless `serving` is False.
    `authenticator` checks every call of the registered services; `credentials`
    (grpc.ServerCredentials) serves TLS instead of plaintext; `rpc_metrics` records each
    call's duration and status (health and reflection are not counted); `access` limits each
    method to the roles its table names (common.auth.Access)."""
    server = grpc.aio.server(
        options=[
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", max_receive_bytes),
            ("grpc.so_reuseport", 0),
        ],
    )
    names = []
    for servicer, name in registrations:
        handler = guarded_handler(servicer, name, authenticator, rpc_metrics, access)
        server.add_generic_rpc_handlers((handler,))
        names.append(name)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if authenticator is None and credentials is None:
        reflection.enable_server_reflection(
            [
                *names,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ],
            server,
        )
    address = f"{host}:{port}"
    if credentials is None:
        bound = server.add_insecure_port(address)
    else:
        bound = server.add_secure_port(address, credentials)
    if bound == 0:
        raise OSError(f"could not bind {host}:{port}: is the port in use?")
    await server.start()
    # Everything loaded so far (a model, a tokenizer, transformers itself: ~360k objects in
    # an executor) lives as long as the process. Frozen, it is out of the cyclic collector's
    # sight: a full collection over it took ~250 ms, a stall in whichever step it hit.
    gc.collect()
    gc.freeze()
    result = Server(server=server, health=health_servicer, port=bound, service_names=names)
    await result.set_serving(serving)
    return result


async def run_until_signal(
    server: Server, grace: float = 5.0, on_stop: Callable[[], Awaitable[None]] | None = None,
    on_ready: Callable[[], None] | None = None,
) -> None:
    """Serve until SIGTERM or SIGINT, then stop gracefully (health NOT_SERVING first).
    `on_ready` runs once the signals stop it gracefully: write port files there, so that a
    caller that signals as soon as it reads one never kills the process outright."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if on_ready is not None:
        on_ready()
    await stop.wait()
    log.info("server_stopping", grace_s=grace)
    if on_stop is not None:
        await on_stop()
    await server.stop(grace)
    log.info("server_stopped")
