"""`python -m executor_svc.simulated`: serve the executor contract without a model.

The real executor's servicer (service.py: Describe, Execute, Release, step order, metrics)
over a SimulatedRunner, behind the same server lifecycle, credentials and health service.
torch, transformers and the model are never imported: ~50 MB a process.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence

import structlog

from common.logging import configure_logging
from executor_svc.settings import SettingsError
from executor_svc.simulated.settings import SimulatedSettings, parse_settings

log = structlog.get_logger("executor_svc.simulated")


async def serve(settings: SimulatedSettings) -> None:
    from executor_svc.serving import serve_runner
    from executor_svc.simulated.runner import build_simulated_runner

    await serve_runner(settings, build_simulated_runner(settings), None,
                       profile=settings.simulate_profile, time_scale=settings.time_scale)


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_settings(argv)  # a value that cannot work: a usage error (exit 2)
    configure_logging("executor", json=settings.log_json, level=settings.log_level)
    from common.metrics import MetricsPortError

    try:
        asyncio.run(serve(settings))
    except (SettingsError, MetricsPortError) as exc:
        log.error("executor_failed_to_start", error=str(exc))
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
