"""`python -m gateway`: the public gRPC API over the allocator and the executors."""

from __future__ import annotations

import asyncio
import signal
import sys

import structlog

from common.cpu_priority import lower_cpu_priority
from common.credentials import CredentialsError
from common.logging import configure_logging
from gateway.app import start_gateway
from gateway.settings import load_settings
from gateway.text.tokenizer import TokenizerLoadError

log = structlog.get_logger("gateway")


async def main() -> int:
    settings = load_settings()
    configure_logging("gateway", json=settings.log_json, level=settings.log_level)
    lower_cpu_priority(settings.nice)
    try:
        gateway = await start_gateway(settings)
    except (TokenizerLoadError, CredentialsError) as exc:
        log.error("gateway_failed_to_start", error=str(exc))
        return 2
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await gateway.stop(settings.shutdown_grace_s)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
