"""The metrics port (common.metrics) and the per-RPC metrics of the guarded handlers, on real
servers on loopback, scraped over HTTP."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import Any

import grpc
import pytest
import structlog

from allocator_svc.core.allocator import Allocator, Limits
from allocator_svc.service import AllocatorServicer
from common.auth import internal_authenticator
from common.credentials import RoleTokens
from common.errors import NotFound
from common.interceptor import client_request_id
from common.metrics import (
    OFF,
    MetricsEndpoint,
    MetricsPortError,
    RpcMetrics,
    service_registry,
    start_metrics_server,
)
from common.server import start_server
from pagedkv.allocator.v1 import allocator_pb2 as pb
from pagedkv.allocator.v1 import allocator_pb2_grpc
from tests.common.scrape import scrape

pytestmark = pytest.mark.service

SERVICE = "pagedkv.allocator.v1.AllocatorService"
TOKENS = RoleTokens.new()
TOKEN = TOKENS.token("gateway")


def test_metrics_endpoint_binds_any_free_port_and_writes_the_port_file(tmp_path: Path) -> None:
    # Port 0: a free port, written to the port file when asked (once the service is ready);
    # close() frees it.
    port_file = tmp_path / "metrics.port"
    server = start_metrics_server(service_registry(), "127.0.0.1",
                                  MetricsEndpoint(0, str(port_file)))
    assert server is not None and server.port > 0 and not port_file.exists()
    server.write_port_file(str(port_file))
    assert int(port_file.read_text()) == server.port
    samples = scrape(server.port)
    assert samples.get("process_open_fds") > 0  # the process collector is registered
    server.close()
    with socket.socket() as probe:
        # Free again (a listener would still refuse SO_REUSEADDR; the scrape's TIME_WAIT not).
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(("127.0.0.1", server.port))
        probe.listen()


def test_metrics_endpoint_off_serves_nothing(tmp_path: Path) -> None:
    port_file = tmp_path / "metrics.port"
    assert start_metrics_server(service_registry(), "127.0.0.1",
                                MetricsEndpoint(OFF, str(port_file))) is None
    assert not port_file.exists()


def test_metrics_endpoint_a_taken_port_stops_only_a_port_asked_for() -> None:
    # Asked for (flag or env): MetricsPortError naming the remedy. The default: a warning.
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(MetricsPortError, match=f"cannot bind the metrics port 127.0.0.1:"
                           f"{port} .*: pass --metrics-port with a free port, 0"):
            start_metrics_server(service_registry(), "127.0.0.1", MetricsEndpoint(port))
        with structlog.testing.capture_logs() as logs:
            assert start_metrics_server(service_registry(), "127.0.0.1",
                                        MetricsEndpoint(port, required=False)) is None
    assert [(e["event"], e["log_level"], e["port"]) for e in logs] == [
        ("metrics_port_unavailable", "warning", port)]


@pytest.mark.parametrize(("port", "grpc_port", "message"), [
    (70000, 50052, "--metrics-port must be in -1..65535 (0: any free port, -1: off), not 70000"),
    (-2, 50052, "--metrics-port must be in -1..65535"),
    (50052, 50052, "--metrics-port 50052 is the gRPC --port too"),
])
def test_metrics_endpoint_problems_name_the_flag(port: int, grpc_port: int, message: str) -> None:
    problem = MetricsEndpoint(port).problem(grpc_port)
    assert problem is not None and problem.startswith(message)


def test_metrics_endpoint_accepts_off_any_and_a_port() -> None:
    assert [MetricsEndpoint(p).problem(0) for p in (-1, 0, 9092, 65535)] == [None] * 4


class Probe(AllocatorServicer):
    """GetStats answers pool 'ok', raises a domain error for 'gone', a bug for 'bug', and
    aborts the call itself for 'denied'."""

    def __init__(self) -> None:
        super().__init__(Allocator(Limits()))

    async def GetStats(self, request: Any, context: Any) -> Any:  # noqa: N802
        if request.pool_id == "gone":
            raise NotFound("pool 'gone' is unknown")
        if request.pool_id == "bug":
            raise RuntimeError("a bug")
        if request.pool_id == "denied":
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "not yours")
        return pb.GetStatsResponse()


async def _calls(pools: list[str], token: str | None) -> tuple[int, list[str]]:
    """Serve Probe with RPC metrics on a metrics port; call GetStats once per pool."""
    registry = service_registry()
    metrics = start_metrics_server(registry, "127.0.0.1", MetricsEndpoint(0))
    assert metrics is not None
    server = await start_server([(Probe(), SERVICE)], "127.0.0.1", 0,
                                authenticator=internal_authenticator(TOKENS.auth("allocator")),
                                rpc_metrics=RpcMetrics(registry))
    codes = []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = allocator_pb2_grpc.AllocatorServiceStub(channel)
            for pool in pools:
                metadata = (("authorization", f"Bearer {token}"),) if token else None
                try:
                    await stub.GetStats(pb.GetStatsRequest(pool_id=pool), metadata=metadata)
                    codes.append("OK")
                except grpc.aio.AioRpcError as exc:
                    codes.append(exc.code().name)
    finally:
        await server.stop(0)
    return metrics.port, codes


def test_rpc_metrics_count_every_call_by_status_and_time_it() -> None:
    # 3 answered, 2 domain errors, 1 bug, 1 aborted by the handler; then 2 without a token.
    pools = ["ok", "gone", "ok", "bug", "denied", "gone", "ok"]
    port, codes = asyncio.run(_calls(pools, TOKEN))
    assert codes == ["OK", "NOT_FOUND", "OK", "INTERNAL", "PERMISSION_DENIED", "NOT_FOUND", "OK"]
    samples = scrape(port)
    labels = {"service": SERVICE, "method": "GetStats"}
    calls = {k: v for k, v in samples.series("pagedkv_rpc_total").items()
             if ("method", "GetStats") in k}
    assert calls == {
        frozenset({**labels, "code": code}.items()): count
        for code, count in [("OK", 3), ("NOT_FOUND", 2), ("INTERNAL", 1),
                            ("PERMISSION_DENIED", 1)]
    }
    assert samples.get("pagedkv_rpc_duration_seconds_count", **labels) == 7
    assert samples.get("pagedkv_rpc_duration_seconds_bucket", le="+Inf", **labels) == 7
    assert 0 < samples.get("pagedkv_rpc_duration_seconds_sum", **labels) < 7 * 1.0
    # Every method has its series from the start (no gaps in rates); none was called.
    assert samples.get("pagedkv_rpc_duration_seconds_count", service=SERVICE,
                       method="Step") == 0
    port, codes = asyncio.run(_calls(["ok", "ok"], None))
    assert codes == ["UNAUTHENTICATED"] * 2
    assert scrape(port).get("pagedkv_rpc_total", code="UNAUTHENTICATED", **labels) == 2


@pytest.mark.parametrize(("seq_id", "request_id"), [
    ("0a1b2c3d/req-7", "req-7"),  # one tenant: namespace only
    ("0a1b2c3d/9f8e7d6c/req-7", "req-7"),  # with API keys: namespace and tenant tag
    ("0a1b2c3d/9f8e7d6c/req-7-prefill", "req-7-prefill"),  # n > 1: the suffix stays
    ("0a1b2c3d/9f8e7d6c/a/b", "a/b"),  # a client id with a slash
    ("req-7", "req-7"),  # not from a gateway: as it is
    ("0A1B2C3D/req-7", "0A1B2C3D/req-7"),  # not a namespace (upper case)
])
def test_client_request_id_strips_the_gateway_namespace(seq_id: str, request_id: str) -> None:
    assert client_request_id(seq_id) == request_id
