"""tools/health_probe.py: the exit status the compose health checks read, against real gRPC
health servers on port 0."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tools.health_probe import main

pytestmark = pytest.mark.service

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture
def servers() -> Iterator[dict[str, str]]:
    """Three health servers: `up` and `also_up` SERVING, `down` NOT_SERVING."""
    started, addresses = [], {}
    for name, status in [("up", SERVING), ("also_up", SERVING), ("down", NOT_SERVING)]:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        servicer = health.HealthServicer()
        servicer.set("", status)
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        addresses[name] = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        server.start()
        started.append(server)
    yield addresses
    for server in started:
        server.stop(None)


def test_health_probe_exit_status_follows_the_server(servers: dict[str, str]) -> None:
    # SERVING -> 0; NOT_SERVING -> 1.
    assert main([servers["up"]]) == 0
    assert main([servers["down"]]) == 1


def test_health_probe_any_of_needs_one_more_server_serving(servers: dict[str, str]) -> None:
    # A gateway that says SERVING with every executor gone (or NOT_SERVING) fails the check;
    # one executor serving among several is enough.
    gone = "127.0.0.1:1"  # nothing listens there
    assert main([servers["up"], f"--any-of={gone},{servers['down']}", "--timeout-s=1"]) == 1
    assert main([servers["up"], f"--any-of={servers['down']},{servers['also_up']}"]) == 0
    assert main([servers["down"], f"--any-of={servers['also_up']}"]) == 1
