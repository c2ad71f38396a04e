"""`python -m allocator_svc`: serve the block allocator until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import structlog

from allocator_svc.core.allocator import Allocator
from allocator_svc.service import AllocatorServicer, sweep_leases
from allocator_svc.settings import AllocatorSettings, parse_settings
from common.auth import internal_authenticator
from common.logging import configure_logging
from common.server import run_until_signal, start_server
from pagedkv.allocator.v1 import allocator_pb2

SERVICE_NAME = allocator_pb2.DESCRIPTOR.services_by_name["AllocatorService"].full_name


async def serve(settings: AllocatorSettings) -> None:
    log = structlog.get_logger("allocator_svc")
    allocator = Allocator(settings.limits)
    auth = settings.auth
    server = await start_server(
        [(AllocatorServicer(allocator), SERVICE_NAME)], settings.host, settings.port,
        authenticator=internal_authenticator(auth), credentials=auth.server_credentials(),
    )
    sweeper = asyncio.create_task(sweep_leases(allocator, settings.lease_check_interval_s))
    if settings.port_file:
        Path(settings.port_file).write_text(str(server.port))
    log.info("server_started", host=settings.host, port=server.port,
             auth="mutual-tls" if auth.tls else "token" if auth.token else "none (--insecure)")

    async def stop_sweeper() -> None:
        sweeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sweeper

    await run_until_signal(server, settings.grace_s, on_stop=stop_sweeper)


def main() -> None:
    settings = parse_settings()
    configure_logging("allocator", json=settings.log_json, level=settings.log_level)
    asyncio.run(serve(settings))


if __name__ == "__main__":
    main()
