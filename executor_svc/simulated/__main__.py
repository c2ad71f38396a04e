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

from common.auth import split_names
from common.logging import configure_logging
from executor_svc.settings import SettingsError
from executor_svc.simulated.settings import SimulatedSettings, parse_settings

log = structlog.get_logger("executor_svc.simulated")


async def serve(settings: SimulatedSettings) -> None:
    from common.auth import internal_authenticator
    from common.metrics import RpcMetrics, service_registry, start_metrics_server
    from common.server import run_until_signal, start_server
    from executor_svc.__main__ import write_port_file
    from executor_svc.service import StepMetrics, registration
    from executor_svc.simulated.runner import build_simulated_runner

    runner = build_simulated_runner(settings)
    step_metrics = rpc_metrics = metrics_server = None
    if settings.metrics.enabled:
        registry = service_registry()
        step_metrics, rpc_metrics = StepMetrics(registry, runner), RpcMetrics(registry)
        metrics_server = start_metrics_server(registry, settings.host, settings.metrics)
    auth = settings.auth
    server = await start_server(
        [registration(runner, None, step_metrics, settings.pool_name)], settings.host,
        settings.port,
        authenticator=internal_authenticator(auth), credentials=auth.server_credentials(),
        rpc_metrics=rpc_metrics, certificate_names=_certificate_names(settings),
    )
    info = runner.info

    def ready() -> None:  # once SIGTERM stops it gracefully: whoever reads a port may signal
        if metrics_server is not None:
            metrics_server.write_port_file(settings.metrics.port_file)
        if settings.port_file:
            write_port_file(settings.port_file, server.port)
        log.info("server_started", host=settings.host, port=server.port,
                 metrics_port=metrics_server.port if metrics_server else None,
                 model=info.model_name, profile=settings.simulate_profile,
                 time_scale=settings.time_scale, num_blocks=info.num_blocks,
                 instance_id=info.instance_id,
                 auth="mutual-tls" if auth.tls else "token" if auth.token else "none (--insecure)")

    try:
        await run_until_signal(server, on_ready=ready)
    finally:
        if metrics_server is not None:
            metrics_server.close()


def _certificate_names(settings: SimulatedSettings) -> dict[str, frozenset[str]] | None:
    """As the real executor's: gateways run steps, the allocator may Describe too."""
    gateways = split_names(settings.tls_gateway_names)
    if settings.auth.tls is None or not gateways:
        return None
    return {"Execute": gateways, "Release": gateways,
            "Describe": gateways | split_names(settings.tls_allocator_names)}


def main(argv: Sequence[str] | None = None) -> int:
    try:
        settings = parse_settings(argv)
    except SettingsError as exc:
        print(f"executor_svc.simulated: {exc}", file=sys.stderr)  # before logging exists
        return 2
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
