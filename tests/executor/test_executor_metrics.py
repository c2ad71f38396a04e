"""The executor's metrics and request lifecycle logs: a real server on loopback (in process,
and `python -m executor_svc` once for the flags), a known workload, the metrics port scraped
over HTTP."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import structlog

from common.metrics import MetricsEndpoint, RpcMetrics, service_registry, start_metrics_server
from common.server import Server, start_server
from executor_svc.runner import ModelRunner
from executor_svc.service import SERVICE_NAME, StepMetrics, registration
from pagedkv.executor.v1 import executor_pb2 as pb
from pagedkv.executor.v1 import executor_pb2_grpc as pb_grpc
from tests.common.scrape import scrape

from .oracle import MODELS

pytestmark = pytest.mark.e2e

NS = "0a1b2c3d/9f8e7d6c/"  # a gateway's namespace and tenant tag


@dataclass
class Served:
    stub: pb_grpc.ExecutorServiceStub
    runner: ModelRunner
    metrics_port: int
    now: list[float]


@pytest.fixture
def served(make_runner: Callable[..., ModelRunner]) -> Iterator[Served]:
    """An in-process executor with metrics, on its own event loop thread, and a clock the
    test moves (idle release)."""
    runner = make_runner(num_blocks=64, max_num_seqs=4, idle_release_s=100.0)
    now = [0.0]
    runner.clock = lambda: now[0]
    runner.next_idle_check = 10.0
    registry = service_registry()
    metrics = start_metrics_server(registry, "127.0.0.1", MetricsEndpoint(0))
    assert metrics is not None
    loop = asyncio.new_event_loop()
    started: Future[Server] = Future()

    def serve() -> None:
        asyncio.set_event_loop(loop)
        registered = registration(runner, None, StepMetrics(registry, runner))
        started.set_result(loop.run_until_complete(start_server(
            [registered], "127.0.0.1", 0, rpc_metrics=RpcMetrics(registry))))
        loop.run_forever()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    server = started.result(timeout=30)
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    yield Served(pb_grpc.ExecutorServiceStub(channel), runner, metrics.port, now)
    channel.close()
    asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(timeout=10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=10)
    metrics.close()


def _first(request_id: str, tokens: list[int], block: int) -> pb.SequenceWork:
    return pb.SequenceWork(request_id=request_id, sampling=pb.SamplingParams(), token_ids=tokens,
                           delta=pb.BlockTableDelta(start_index=0, block_ids=[block]), sample=True)


def _decode(request_id: str, token: int, position: int) -> pb.SequenceWork:
    return pb.SequenceWork(request_id=request_id, token_ids=[token], start_position=position,
                           sample=True)


def test_executor_metrics_and_lifecycle_logs_follow_a_workload(served: Served) -> None:
    # A (5 tokens) starts; decodes once in the compact columns; B (3 tokens) starts beside
    # A's next decode; an unknown request is refused; 200 s later a step for B alone finds A
    # idle and drops it; B is released. 4 steps ran: 1 + 1 + 2 + 1 sequences, 5 + 1 + 4 + 1
    # tokens, one sampled per sequence.
    stub, a, b = served.stub, NS + "req-A", NS + "req-B"
    merge = [structlog.contextvars.merge_contextvars]
    with structlog.testing.capture_logs(processors=merge) as logs:
        token = stub.Execute(pb.ExecuteRequest(seqs=[_first(a, [1, 2, 3, 4, 5], 0)])).tokens[0]
        reply = stub.Execute(pb.ExecuteRequest(decode_request_ids=[a], decode_positions=[5],
                                               decode_token_ids=[token.token_id]))
        stub.Execute(pb.ExecuteRequest(seqs=[_decode(a, reply.decode_sampled_token_ids[0], 6),
                                             _first(b, [7, 8, 9], 1)]))
        with pytest.raises(grpc.RpcError) as err:
            stub.Execute(pb.ExecuteRequest(seqs=[_decode(NS + "ghost", 1, 0)]))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert set(served.runner.requests) == {a, b}
        held = scrape(served.metrics_port).get("pagedkv_executor_requests")
        served.now[0] = 200.0
        stub.Execute(pb.ExecuteRequest(seqs=[_decode(b, 1, 3)]))
        assert set(served.runner.requests) == {b}
        assert stub.Release(pb.ReleaseRequest(request_ids=[b, NS + "ghost"])).num_released == 1
    samples = scrape(served.metrics_port)
    assert held == 2 and samples.get("pagedkv_executor_requests") == 0
    assert [samples.get(f"pagedkv_executor_{name}") for name in (
        "steps_total", "batch_sequences_count", "batch_sequences_sum", "batch_tokens_sum",
        "tokens_total", "sampled_tokens_total", "forward_seconds_count",
        "sample_seconds_count", "step_seconds_count", "requests_started_total", "kv_blocks",
    )] == [4, 4, 5, 11, 11, 5, 4, 4, 4, 2, 64]
    assert samples.get("pagedkv_executor_batch_sequences_bucket", le="1.0") == 3
    assert samples.get("pagedkv_executor_requests_released_total", reason="released") == 1
    assert samples.get("pagedkv_executor_requests_released_total", reason="idle") == 1
    assert samples.get("pagedkv_executor_step_seconds_sum") >= samples.get(
        "pagedkv_executor_forward_seconds_sum") > 0
    for method, code, count in [("Execute", "OK", 4), ("Execute", "NOT_FOUND", 1),
                                ("Release", "OK", 1), ("Describe", "OK", 0)]:
        assert samples.get("pagedkv_rpc_total", service=SERVICE_NAME, method=method,
                           code=code) == count
    (info,) = samples.series("pagedkv_executor_info")
    assert dict(info)["backend"] == served.runner.info.backend
    lifecycle = [(e["event"], e["log_level"], e["request_id"], e["seq_id"]) for e in logs
                 if e["event"].startswith("request_")]
    assert lifecycle == [
        ("request_started", "info", "req-A", a),
        ("request_started", "info", "req-B", b),
        ("request_idle_released", "info", "req-A", a),
        ("request_released", "info", "req-B", b),
    ]
    batches = [e["seq_ids"] for e in logs if e["event"] == "batch_executed"]
    assert batches == [[a], [a], [a, b], [b]]  # DEBUG, one line a step


def test_executor_main_serves_metrics_on_its_own_port(tmp_path: Path) -> None:
    # --metrics-port 0: a free port, written to --metrics-port-file; scraped, it reports the
    # KV blocks and every ExecutorService method; SIGTERM stops it with status 0.
    files = {name: tmp_path / name for name in ("port", "metrics.port")}
    command = [sys.executable, "-m", "executor_svc", "--model", str(MODELS / "tiny-llama"),
               "--load-format", "dummy", "--num-blocks", "32", "--swap-space", "0",
               "--port", "0", "--port-file", str(files["port"]), "--metrics-port", "0",
               "--metrics-port-file", str(files["metrics.port"]), "--insecure"]
    process = subprocess.Popen(command, cwd=MODELS.parent, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not files["port"].exists() and time.monotonic() < deadline:
            assert process.poll() is None, "the executor exited at start"
            time.sleep(0.1)
        samples = scrape(int(files["metrics.port"].read_text()))
    finally:
        os.kill(process.pid, signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
    assert process.returncode == 0, stderr[-2000:]
    assert samples.get("pagedkv_executor_kv_blocks") == 32
    methods: set[Any] = {dict(labels)["method"] for labels in
                         samples.series("pagedkv_rpc_duration_seconds_count")}
    assert methods == {"Describe", "Execute", "Release", "ImportKV", "ExportKV",
                       "LoadLoraAdapter", "UnloadLoraAdapter"}
    for direction in ("imported", "exported"):
        for unit in ("blocks", "bytes"):
            assert samples.get(f"pagedkv_executor_kv_{direction}_{unit}_total") == 0
