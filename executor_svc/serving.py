"""Serving a runner: the server, credentials, metrics, port files and lifecycle that the real
executor (`python -m executor_svc`) and the simulated one (`python -m executor_svc.simulated`)
share. Imports nothing heavy: the simulated executor never loads torch."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import structlog

from common.auth import Access, certificate_roles, internal_authenticator
from common.metrics import RpcMetrics, service_registry, start_metrics_server
from common.server import run_until_signal, start_server
from executor_svc.runner_api import StepRunner
from executor_svc.settings import ServingSettings

log = structlog.get_logger("executor_svc")


def write_port_file(path: str, port: int) -> None:
    tmp = Path(f"{path}.{os.getpid()}.tmp")
    tmp.write_text(f"{port}\n")
    tmp.replace(path)


# Who may call what (common.auth.Access; a token's role or a certificate's): gateways run
# steps and start hand-offs; the allocator besides them asks Describe (a pool reset's check);
# ExportKV's callers are the other executors, pulling KV for an ImportKV.
METHOD_ROLES: dict[str, frozenset[str]] = {
    "Describe": frozenset({"gateway", "allocator"}),
    "Execute": frozenset({"gateway"}),
    "Release": frozenset({"gateway"}),
    "ImportKV": frozenset({"gateway"}),
    "ExportKV": frozenset({"executor"}),
    "LoadLoraAdapter": frozenset({"gateway"}),
    "UnloadLoraAdapter": frozenset({"gateway"}),
}


def access(settings: ServingSettings) -> Access:
    """The method table; under mutual TLS, certificate names mapped to roles (no gateway
    names: every certificate of the CA passes the TLS check, as before)."""
    gateways = settings.tls_gateway_names
    names = None
    if settings.auth.tls is not None and gateways:
        names = certificate_roles(gateway=gateways,
                                  allocator=settings.tls_allocator_names,
                                  executor=frozenset({"executor"}))
    return Access(METHOD_ROLES, names)


async def serve_runner(settings: ServingSettings, runner: StepRunner,
                       worker: ThreadPoolExecutor | None, **started: Any) -> None:
    """Serve `runner` until SIGTERM/SIGINT; `started`: more fields for the start-up line."""
    from executor_svc.service import SERVICE_NAME, ExecutorServicer, StepMetrics

    step_metrics = rpc_metrics = metrics_server = None
    if settings.metrics.enabled:
        registry = service_registry()
        step_metrics, rpc_metrics = StepMetrics(registry, runner), RpcMetrics(registry)
        metrics_server = start_metrics_server(registry, settings.host, settings.metrics)
    auth = settings.auth
    servicer = ExecutorServicer(runner, worker, step_metrics, settings.pool_name, auth)
    server = await start_server(
        [(servicer, SERVICE_NAME)], settings.host, settings.port,
        authenticator=internal_authenticator(auth), credentials=auth.server_credentials(),
        rpc_metrics=rpc_metrics, access=access(settings),
    )
    info = runner.info

    def ready() -> None:  # once SIGTERM stops it gracefully: whoever reads a port may signal
        if metrics_server is not None:
            metrics_server.write_port_file(settings.metrics.port_file)
        if settings.port_file:
            write_port_file(settings.port_file, server.port)
        log.info("server_started", host=settings.host, port=server.port,
                 metrics_port=metrics_server.port if metrics_server else None,
                 model=info.model_name, num_blocks=info.num_blocks, role=info.role,
                 instance_id=info.instance_id,
                 auth=auth.describe(),
                 **started)

    try:
        await run_until_signal(server, on_ready=ready)
    finally:
        await servicer.close()  # its channels to the executors it imported KV from
        if metrics_server is not None:
            metrics_server.close()
