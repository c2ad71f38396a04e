"""Prometheus metrics shared by the internal services: the metrics port and per-RPC metrics.

Each service serves its own registry on a port of its own (`--metrics-port`; -1: off, 0: any
free port), with prometheus_client's HTTP server in a daemon thread, bound to the service's
host. Scrapes therefore run beside the event loop: collectors read counts the services keep
as plain ints (a read under the GIL is atomic), never iterate state a handler is changing.

The default port is best effort: a second service on one host finds it taken, logs a warning
and serves without metrics (the launcher gives each executor a port of its own). A port set
by flag or environment variable is required: taken, the service does not start.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
from prometheus_client import (
    CollectorRegistry,
    Counter,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    start_http_server,
)

from common.config import SettingsError, add_flag, env_name

log = structlog.get_logger(__name__)

OFF = -1
# From 100 us (an allocator Step) to 30 s (a long Execute, a stream).
RPC_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
               0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class MetricsPortError(OSError):
    """The metrics port asked for cannot be bound; the message says what to pass instead."""


@dataclass(frozen=True, slots=True)
class MetricsEndpoint:
    port: int  # OFF: no endpoint; 0: any free port
    port_file: str | None = None  # the bound port is written here once the service serves
    required: bool = True  # False: the default port, given up with a warning when taken

    @property
    def enabled(self) -> bool:
        return self.port != OFF

    def problem(self, grpc_port: int) -> str | None:
        """What is wrong with the endpoint (a message naming the flag), or None."""
        if not OFF <= self.port <= 65535:
            return (f"--metrics-port must be in -1..65535 (0: any free port, -1: off), "
                    f"not {self.port}")
        if self.port > 0 and self.port == grpc_port:
            return f"--metrics-port {self.port} is the gRPC --port too: give it another one"
        return None

    def check(self, grpc_port: int) -> None:
        """Raise SettingsError, naming the flag, when the endpoint cannot work beside it."""
        problem = self.problem(grpc_port)
        if problem is not None:
            raise SettingsError(problem)


class _SetByFlag(argparse.Action):
    """Records that --metrics-port was given on the command line (then it is required)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        namespace.metrics_port_set = True


def add_metrics_flags(parser: argparse.ArgumentParser, default_port: int) -> None:
    add_flag(parser, "--metrics-port", type=int, default=default_port, action=_SetByFlag,
             help="Prometheus metrics over HTTP on this port (0: any free port, -1: off; the "
             "default port is given up with a warning when another process holds it)")
    add_flag(parser, "--metrics-port-file", default=None,
             help="write the bound metrics port here once serving")


def metrics_endpoint(args: argparse.Namespace) -> MetricsEndpoint:
    """The endpoint the parsed flags ask for (check it with `problem`)."""
    required = getattr(args, "metrics_port_set", False) or env_name("--metrics-port") in os.environ
    return MetricsEndpoint(args.metrics_port, args.metrics_port_file, required)


def service_registry() -> CollectorRegistry:
    """A service's registry, with the process's CPU, memory, file descriptors and garbage
    collections (read at scrape time)."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry


@dataclass(slots=True)
class MetricsServer:
    port: int
    server: Any  # the WSGI server: shutdown() stops its thread
    thread: Any

    def write_port_file(self, path: str | None) -> None:
        """The bound port, written whole, then renamed (a reader never sees half of it)."""
        if path:
            tmp = Path(f"{path}.{os.getpid()}.tmp")
            tmp.write_text(f"{self.port}\n")
            tmp.replace(path)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def start_metrics_server(
    registry: CollectorRegistry, host: str, endpoint: MetricsEndpoint
) -> MetricsServer | None:
    """Serve `registry` at http://host:port/metrics; None when off (or the default port is
    taken). Raises MetricsPortError for a required port that cannot be bound. The service
    writes `endpoint.port_file` (MetricsServer.write_port_file) once it is ready."""
    if not endpoint.enabled:
        return None
    try:
        server, thread = start_http_server(endpoint.port, addr=host, registry=registry)
    except OSError as exc:
        message = (f"cannot bind the metrics port {host}:{endpoint.port} ({exc.strerror}): pass "
                   "--metrics-port with a free port, 0 (any free port) or -1 (off)")
        if endpoint.required:
            raise MetricsPortError(message) from exc
        log.warning("metrics_port_unavailable", port=endpoint.port, error=message)
        return None
    port = int(server.server_port)
    log.info("metrics_serving", host=host, port=port)
    return MetricsServer(port, server, thread)


class MethodMetrics:
    """One RPC method's latency histogram and per-status counters, looked up once."""

    __slots__ = ("_counters", "_counter", "_labels", "duration", "ok")

    def __init__(self, duration: Histogram, counter: Counter, service: str, method: str):
        self.duration = duration.labels(service, method)
        self.ok = counter.labels(service, method, "OK")
        self._counter = counter
        self._labels = (service, method)
        self._counters: dict[str, Any] = {"OK": self.ok}

    def observe(self, code: str, seconds: float) -> None:
        """One call ended with status `code` (a grpc.StatusCode name) after `seconds`."""
        self.duration.observe(seconds)
        counter = self._counters.get(code)
        if counter is None:
            counter = self._counters[code] = self._counter.labels(*self._labels, code)
        counter.inc()


class RpcMetrics:
    """`pagedkv_rpc_duration_seconds{service,method}` and `pagedkv_rpc_total{service,method,
    code}` for every call of the services a server registers (common.interceptor)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.duration = Histogram(
            "pagedkv_rpc_duration_seconds", "Time a gRPC handler took, from the request's "
            "bytes to its answer (the whole stream for a streaming call)",
            ["service", "method"], registry=registry, buckets=RPC_BUCKETS)
        self.calls = Counter("pagedkv_rpc", "gRPC calls handled, by status code",
                             ["service", "method", "code"], registry=registry)

    def method(self, service: str, method: str) -> MethodMetrics:
        return MethodMetrics(self.duration, self.calls, service, method)
