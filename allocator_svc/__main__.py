"""`python -m allocator_svc`: serve the block allocator until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from pathlib import Path

import structlog

from allocator_svc.core.allocator import Allocator
from allocator_svc.core.tenant_service import TenantService
from allocator_svc.core.victims import PreemptionPolicy
from allocator_svc.metrics import AllocatorCollector
from allocator_svc.pool_resets import ResetVerifier
from allocator_svc.recording import Recorder, RecordingOpenError, flush_periodically
from allocator_svc.service import METHOD_ROLES, AllocatorServicer, sweep_leases
from allocator_svc.settings import AllocatorSettings, parse_settings
from common.auth import Access, certificate_roles, internal_authenticator
from common.cpu_priority import lower_cpu_priority
from common.logging import configure_logging
from common.metrics import MetricsPortError, RpcMetrics, service_registry, start_metrics_server
from common.server import run_until_signal, start_server
from pagedkv.allocator.v1 import allocator_pb2

SERVICE_NAME = allocator_pb2.DESCRIPTOR.services_by_name["AllocatorService"].full_name


async def serve(settings: AllocatorSettings) -> None:
    log = structlog.get_logger("allocator_svc")
    allocator = Allocator(settings.limits,
                          preemption_policy=PreemptionPolicy(settings.preemption_policy),
                          tenant_service=TenantService(settings.prefill_service_weight,
                                                       settings.decode_service_weight))
    recorder = (Recorder.open(settings.recording, allocator.pools)
                if settings.recording is not None else None)
    rpc_metrics = None
    metrics_server = None
    if settings.metrics.enabled:
        registry = service_registry()
        registry.register(AllocatorCollector(allocator))
        rpc_metrics = RpcMetrics(registry)
        metrics_server = start_metrics_server(registry, settings.host, settings.metrics)
    auth = settings.auth
    server = await start_server(
        [(AllocatorServicer(allocator,
                            ResetVerifier(auth) if settings.verify_pool_resets else None,
                            settings.shard_index, settings.num_shards, recorder),
          SERVICE_NAME)],
        settings.host, settings.port,
        authenticator=internal_authenticator(auth), credentials=auth.server_credentials(),
        rpc_metrics=rpc_metrics,
        # Only gateways call the allocator (their tokens' role, or their certificates').
        access=Access(METHOD_ROLES, certificate_roles(gateway=settings.tls_gateway_names)
                      if auth.tls is not None and settings.tls_gateway_names else None),
    )
    sweeper = asyncio.create_task(
        sweep_leases(allocator, settings.lease_check_interval_s, recorder))
    flusher = asyncio.create_task(flush_periodically(recorder)) if recorder else None

    def ready() -> None:
        if metrics_server is not None:
            metrics_server.write_port_file(settings.metrics.port_file)
        if settings.port_file:
            Path(settings.port_file).write_text(str(server.port))
        log.info("server_started", host=settings.host, port=server.port,
                 metrics_port=metrics_server.port if metrics_server else None,
                 shard=f"{settings.shard_index}/{settings.num_shards}",
                 auth=auth.describe())

    async def stop_sweeper() -> None:
        sweeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sweeper

    try:
        await run_until_signal(server, settings.grace_s, on_stop=stop_sweeper, on_ready=ready)
    finally:
        if metrics_server is not None:
            metrics_server.close()
        if recorder is not None:  # after the grace period: no call is left to record
            if flusher is not None:
                flusher.cancel()
            recorder.close()


def main() -> None:
    settings = parse_settings()
    configure_logging("allocator", json=settings.log_json, level=settings.log_level)
    lower_cpu_priority(settings.nice)
    try:
        asyncio.run(serve(settings))
    except (MetricsPortError, RecordingOpenError) as exc:
        structlog.get_logger("allocator_svc").error("allocator_failed_to_start", error=str(exc))
        sys.exit(2)


if __name__ == "__main__":
    main()
