"""The aio server lifecycle shared by the services.

Standard gRPC health service, reflection (names from the descriptors), guarded handlers
(request ids, error statuses: common.interceptor),
a bound port (0 picks a free one: tests), and graceful shutdown on SIGTERM/SIGINT.
"""

from __future__ import annotations

import asyncio
import gc
import signal
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common.interceptor import guard

log = structlog.get_logger(__name__)

# A servicer registration: (add_XServicer_to_server, servicer, full service name).
Registration = tuple[Callable[..., None], object, str]

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
    registrations: Sequence[Registration], host: str, port: int, serving: bool = True
) -> Server:
    """Build, bind and start the server; health says SERVING unless `serving` is False."""
    server = grpc.aio.server(
        options=[
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),
        ],
    )
    names = []
    for add, servicer, name in registrations:
        add(guard(servicer, name), server)
        names.append(name)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [
            *names,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ],
        server,
    )
    bound = server.add_insecure_port(f"{host}:{port}")
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
    server: Server, grace: float = 5.0, on_stop: Callable[[], Awaitable[None]] | None = None
) -> None:
    """Serve until SIGTERM or SIGINT, then stop gracefully (health NOT_SERVING first)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("server_stopping", grace_s=grace)
    if on_stop is not None:
        await on_stop()
    await server.stop(grace)
    log.info("server_stopped")
