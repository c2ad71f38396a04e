"""`python -m gateway`: the public gRPC API over the allocator and the executors."""

from __future__ import annotations

import asyncio
import signal

from common.logging import configure_logging
from gateway.app import start_gateway
from gateway.settings import load_settings


async def main() -> None:
    settings = load_settings()
    configure_logging("gateway", json=settings.log_json, level=settings.log_level)
    gateway = await start_gateway(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await gateway.stop()


if __name__ == "__main__":
    asyncio.run(main())
