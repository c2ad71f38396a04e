"""SIGTERM drains the gateway (a real subprocess): health NOT_SERVING and new requests
UNAVAILABLE at once, the streams in flight finish in full within --shutdown-grace-s, those
still running at its end are ended with UNAVAILABLE, and the process exits 0."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import grpc
import pytest
from e2e_stack import Streamed, generate, prompts, sampling, start_simulated_stack
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedkv.gateway.v1 import gateway_pb2 as gpb
from pagedkv.gateway.v1 import gateway_pb2_grpc as gpb_grpc
from tools.launch import Stack

NUM_STREAMS = 8
MAX_TOKENS = 300
# Simulated executors: what is tested is the gateway's shutdown, not the model's numbers.
EXECUTOR_ARGS = ("--num-blocks", "512", "--time-scale", "0.3")  # steps of a few ms


def _streams(stack: Stack) -> tuple[list[threading.Thread], list[dict[int, Streamed] | str]]:
    """NUM_STREAMS Generate streams, each on a thread; a result is the stream, or the
    status and details it ended with."""
    stub = gpb_grpc.GatewayServiceStub(grpc.insecure_channel(stack.gateway_addr))
    results: list[dict[int, Streamed] | str] = [""] * NUM_STREAMS

    def run(i: int, prompt: list[int]) -> None:
        try:
            results[i] = generate(stub, gpb.GenerateRequest(
                token_ids=gpb.TokenIds(ids=prompt),
                sampling=sampling(MAX_TOKENS, ignore_eos=True)), timeout=120)
        except grpc.RpcError as exc:
            results[i] = f"{exc.code().name}: {exc.details()}"

    threads = [threading.Thread(target=run, args=(i, p))
               for i, p in enumerate(prompts(NUM_STREAMS, 12, seed=907))]
    for thread in threads:
        thread.start()
    log = Path(stack.by_name("gateway").log_path or "")
    deadline = time.monotonic() + 60
    while log.read_text().count("request_queued") < NUM_STREAMS:
        assert time.monotonic() < deadline, "the streams never all arrived"
        time.sleep(0.02)
    return threads, results


def _health(stack: Stack) -> int:
    with grpc.insecure_channel(stack.gateway_addr) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=5).status


def test_sigterm_lets_the_streams_in_flight_finish_and_refuses_new_ones(tmp_path: Path):
    # Eight long streams in flight (two run at a time, the others wait), then SIGTERM: health
    # turns NOT_SERVING and a new request is UNAVAILABLE, naming the shutdown; every stream
    # started before the signal still gets all its tokens; the gateway exits 0 in the grace.
    grace_s = 90.0
    stack = start_simulated_stack(
        tmp_path, executor_args=EXECUTOR_ARGS,
        gateway_args=("--shutdown-grace-s", str(grace_s), "--max-num-seqs", "2"))
    try:
        threads, results = _streams(stack)
        gateway = stack.by_name("gateway").process
        gateway.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        assert sum(1 for r in results if r) < NUM_STREAMS  # some were running, not all done
        deadline = time.monotonic() + 10
        while _health(stack) != health_pb2.HealthCheckResponse.NOT_SERVING:
            assert time.monotonic() < deadline, "health still SERVING after SIGTERM"
            time.sleep(0.05)
        with grpc.insecure_channel(stack.gateway_addr) as channel:
            with pytest.raises(grpc.RpcError) as refused:
                gpb_grpc.GatewayServiceStub(channel).Complete(gpb.CompleteRequest(
                    text="too late", sampling=sampling(4)), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "shutting down" in (refused.value.details() or "")
        for thread in threads:
            thread.join(grace_s)
        for result in results:
            assert isinstance(result, dict), result
            assert len(result[0].token_ids) == MAX_TOKENS
            assert result[0].finish_reason == gpb.FINISH_REASON_LENGTH
        assert gateway.wait(grace_s) == 0
        assert time.monotonic() - signalled < grace_s
    finally:
        stack.stop()


def test_sigterm_ends_what_outlasts_the_grace_with_unavailable(tmp_path: Path):
    # A grace of 1 s against streams that need longer: those still open at its end get
    # UNAVAILABLE saying why (not a cut connection), and the gateway still exits 0.
    stack = start_simulated_stack(
        tmp_path, executor_args=EXECUTOR_ARGS,
        gateway_args=("--shutdown-grace-s", "1", "--max-num-seqs", "1"))
    try:
        threads, results = _streams(stack)
        gateway = stack.by_name("gateway").process
        gateway.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(30)
        cut = [r for r in results if isinstance(r, str)]
        assert cut, "every stream finished within 1 s: make them longer"
        for status in cut:
            assert status.startswith("UNAVAILABLE: the gateway shut down before this request "
                                     "finished (it had --shutdown-grace-s 1 seconds to)"), status
        assert gateway.wait(30) == 0
    finally:
        stack.stop()
