"""`python -m executor_svc`: load the model, size the KV cache, serve until SIGTERM.

With `--port 0` the bound port is logged (`server_started port=...`) and, with `--port-file`,
written to that file once the server accepts calls (written whole, then renamed); the same for
the metrics port (`--metrics-port`, `--metrics-port-file`), bound once the model is loaded.

torch, grpc and transformers are imported only after malloc is tuned (malloc_tuning.py): they
start threads, and a thread that allocates before the tuning keeps an arena of its own.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import structlog

from common.auth import split_names
from common.logging import configure_logging
from executor_svc.malloc_tuning import tune_malloc
from executor_svc.settings import ExecutorSettings, SettingsError, parse_settings

log = structlog.get_logger("executor_svc")


def write_port_file(path: str, port: int) -> None:
    tmp = Path(f"{path}.{os.getpid()}.tmp")
    tmp.write_text(f"{port}\n")
    tmp.replace(path)


async def serve(settings: ExecutorSettings) -> None:
    from common.auth import internal_authenticator
    from common.metrics import RpcMetrics, service_registry, start_metrics_server
    from common.server import run_until_signal, start_server
    from executor_svc.compute_thread import compute_thread
    from executor_svc.runner import build_runner
    from executor_svc.service import StepMetrics, registration

    worker = compute_thread()
    runner = await asyncio.get_running_loop().run_in_executor(worker, build_runner, settings)
    step_metrics = rpc_metrics = metrics_server = None
    if settings.metrics.enabled:
        registry = service_registry()
        step_metrics, rpc_metrics = StepMetrics(registry, runner), RpcMetrics(registry)
        metrics_server = start_metrics_server(registry, settings.host, settings.metrics)
    auth = settings.auth
    server = await start_server(
        [registration(runner, worker, step_metrics, settings.pool_name)], settings.host,
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
        log.info(
            "server_started",
            host=settings.host,
            port=server.port,
            metrics_port=metrics_server.port if metrics_server else None,
            model=info.model_name,
            backend=info.backend,
            device=info.device,
            num_blocks=info.num_blocks,
            instance_id=info.instance_id,
            auth="mutual-tls" if auth.tls else "token" if auth.token else "none (--insecure)",
        )

    try:
        await run_until_signal(server, on_ready=ready)
    finally:
        if metrics_server is not None:
            metrics_server.close()


def main(argv: Sequence[str] | None = None) -> int:
    try:
        settings = parse_settings(argv)
    except SettingsError as exc:
        print(f"executor_svc: {exc}", file=sys.stderr)  # before logging exists
        return 2
    # Before torch and grpc are imported (module docstring). On CUDA a step's large tensors
    # live on the device: nothing to gain, and the host copies of the weights made while
    # loading could stay in the heap, never returned to the system.
    malloc_tuned = settings.tune_malloc and not settings.on_cuda and tune_malloc()
    configure_logging("executor", json=settings.log_json, level=settings.log_level)
    log.info("malloc_settings", tuned=malloc_tuned, requested=settings.tune_malloc,
             skipped="cuda" if settings.tune_malloc and settings.on_cuda else None)
    from common.metrics import MetricsPortError
    from executor_svc.model_loader import ModelLoadError

    try:
        asyncio.run(serve(settings))
    except (SettingsError, ModelLoadError, MetricsPortError) as exc:
        log.error("executor_failed_to_start", error=str(exc))
        return 2
    return 0


def _certificate_names(settings: ExecutorSettings) -> dict[str, frozenset[str]] | None:
    """Under mutual TLS: gateways run steps; the allocator may Describe too (None: no TLS, or
    every certificate of the CA may call everything)."""
    gateways = split_names(settings.tls_gateway_names)
    if settings.auth.tls is None or not gateways:
        return None
    return {"Execute": gateways, "Release": gateways,
            "Describe": gateways | split_names(settings.tls_allocator_names)}


if __name__ == "__main__":
    sys.exit(main())
