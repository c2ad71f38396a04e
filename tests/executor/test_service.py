"""The gRPC servicer on a real server (port 0): conversion, status codes, health."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future

import grpc
import pytest
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.server import Server, start_server
from executor_svc.runner import ModelRunner
from executor_svc.service import SERVICE_NAME, ExecutorServicer, registration
from pagedkv.executor.v1 import executor_pb2 as pb
from pagedkv.executor.v1 import executor_pb2_grpc as pb_grpc

from .oracle import random_prompts, reference_generate, reference_model

pytestmark = pytest.mark.service

Served = tuple[pb_grpc.ExecutorServiceStub, grpc.Channel, ModelRunner]


@pytest.fixture
def served_with_servicer(
    make_runner: Callable[..., ModelRunner],
) -> Iterator[tuple[Served, ExecutorServicer]]:
    """An in-process server on its own event loop thread; a sync client channel."""
    runner = make_runner(num_blocks=64, max_num_seqs=4)
    loop = asyncio.new_event_loop()
    started: Future[Server] = Future()
    servicer, name = registration(runner)

    def serve() -> None:
        asyncio.set_event_loop(loop)
        started.set_result(
            loop.run_until_complete(start_server([(servicer, name)], "127.0.0.1", 0))
        )
        loop.run_forever()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    server = started.result(timeout=30)
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    yield (pb_grpc.ExecutorServiceStub(channel), channel, runner), servicer
    channel.close()
    asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(timeout=10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=10)


@pytest.fixture
def served(served_with_servicer: tuple[Served, ExecutorServicer]) -> Served:
    return served_with_servicer[0]


def _first_step(request_id: str, tokens: list[int], blocks: list[int]) -> pb.ExecuteRequest:
    return pb.ExecuteRequest(
        seqs=[
            pb.SequenceWork(
                request_id=request_id,
                sampling=pb.SamplingParams(),
                token_ids=tokens,
                delta=pb.BlockTableDelta(start_index=0, block_ids=blocks),
                sample=True,
            )
        ]
    )


def test_service_describe_reports_the_runner(served: Served) -> None:
    # Describe carries the runner's sizes, model identity and limits.
    stub, _, runner = served
    info = stub.Describe(pb.DescribeRequest())
    assert (info.num_blocks, info.block_size, info.vocab_size) == (64, 16, 512)
    assert (info.backend, info.device, info.dtype) == ("cpu", "cpu", "float32")
    assert info.model_fingerprint == runner.info.model_fingerprint
    assert list(info.eos_token_ids) == [2] and info.max_num_seqs == 4


def test_service_execute_decodes_like_generate(served: Served) -> None:
    # Prefill + 5 decode steps over gRPC equal transformers' greedy continuation.
    stub, _, runner = served
    prompt = random_prompts(512, [21])[0]
    reply = stub.Execute(_first_step("r", prompt, [9, 3]))
    tokens = [reply.tokens[0].token_id]
    assert reply.num_tokens == 21 and reply.timings.total_ms >= reply.timings.forward_ms > 0
    for step in range(5):
        work = pb.SequenceWork(
            request_id="r", token_ids=[tokens[-1]], start_position=21 + step, sample=True
        )
        tokens.append(stub.Execute(pb.ExecuteRequest(seqs=[work])).tokens[0].token_id)
    assert tokens == reference_generate(reference_model(runner), prompt, 6)


def test_service_maps_errors_and_keeps_serving(served: Served) -> None:
    # NOT_FOUND and INVALID_ARGUMENT come back with their messages; health stays SERVING.
    stub, channel, _ = served
    unknown = pb.ExecuteRequest(seqs=[pb.SequenceWork(request_id="ghost", token_ids=[1])])
    with pytest.raises(grpc.RpcError) as err:
        stub.Execute(unknown)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as err:
        stub.Execute(_first_step("r", [1, 2], [64]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "outside [0, 64)" in (err.value.details() or "")
    health = health_pb2_grpc.HealthStub(channel)
    status = health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME)).status
    assert status == health_pb2.HealthCheckResponse.SERVING
    assert stub.Execute(_first_step("r", [1, 2], [0])).tokens[0].request_id == "r"


def test_service_release_counts_held_requests(served: Served) -> None:
    # Release drops held requests and ignores unknown ids.
    stub, _, runner = served
    stub.Execute(_first_step("a", [5, 6, 7], [1]))
    reply = stub.Release(pb.ReleaseRequest(request_ids=["a", "ghost"]))
    assert reply.num_released == 1 and runner.requests == {}


def test_service_merges_the_steps_that_arrive_while_one_computes(
    served_with_servicer: tuple[Served, ExecutorServicer],
) -> None:
    # Steps run in the worker, in turns: the steps sent while one computes wait, and merge
    # into the next forward, each caller getting its own rows; one whose caller gave up
    # before its turn never runs; Describe is answered meanwhile.
    (stub, _, runner), servicer = served_with_servicer
    original = runner.execute_merged
    started, release = threading.Event(), threading.Event()
    turns: list[list[str]] = []

    def execute_merged(steps):  # type: ignore[no-untyped-def]
        rids = [step.seqs[0].request_id for step in steps]
        turns.append(rids)
        if rids == ["first"]:
            started.set()
            assert release.wait(timeout=30)
        return original(steps)

    runner.execute_merged = execute_merged  # type: ignore[method-assign]
    first = stub.Execute.future(_first_step("first", [5, 6, 7], [1]))
    assert started.wait(timeout=30)
    second = stub.Execute.future(_first_step("second", [8, 9], [2]))
    with pytest.raises(grpc.RpcError) as err:
        stub.Execute(_first_step("gave-up", [4], [3]), timeout=0.2)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    third = stub.Execute.future(_first_step("third", [4, 8, 9, 5], [4]))
    assert stub.Describe(pb.DescribeRequest(), timeout=5).num_blocks == 64
    deadline = time.monotonic() + 30
    while servicer.queue.num_waiting() < 2:  # second and third
        assert time.monotonic() < deadline, "the steps never reached the queue"
        time.sleep(0.01)
    release.set()
    replies = [f.result(timeout=30) for f in (first, second, third)]
    assert [[t.request_id for t in r.tokens] for r in replies] == [["first"], ["second"],
                                                                    ["third"]]
    assert [r.num_tokens for r in replies] == [3, 2, 4]
    assert turns == [["first"], ["second", "third"]]
    assert set(runner.requests) == {"first", "second", "third"}


def test_service_orders_calls_by_previous_step_id(served: Served) -> None:
    # A call refused while it is decoded, or given up by its caller while it waits, counts as
    # taken: the call naming it runs at once. A call naming an id that never comes is refused
    # after a bounded, logged wait (FAILED_PRECONDITION); one naming itself, at once.
    stub, _, _ = served

    def step(rid: str, block: int, step_id: int, previous: int) -> pb.ExecuteRequest:
        request = _first_step(rid, [1, 2], [block])
        request.step_id, request.previous_step_id = step_id, previous
        return request

    with structlog.testing.capture_logs() as logs:
        refused = pb.ExecuteRequest(decode_request_ids=["x", "y"], decode_token_ids=[1],
                                    decode_positions=[0, 0], step_id=41)
        with pytest.raises(grpc.RpcError) as err:
            stub.Execute(refused, timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert stub.Execute(step("after-refused", 0, 42, 41), timeout=30).tokens
        with pytest.raises(grpc.RpcError) as err:  # waits for 44, which never comes
            stub.Execute(step("given-up", 1, 45, 44), timeout=0.2)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert stub.Execute(step("after-given-up", 2, 46, 45), timeout=30).tokens
        assert not [e for e in logs if e["event"] == "previous_step_not_seen"]
        with pytest.raises(grpc.RpcError) as err:
            stub.Execute(step("orphan", 3, 48, 47), timeout=30)  # 47 never comes
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "previous_step_id 47" in (err.value.details() or "")
        with pytest.raises(grpc.RpcError) as err:
            stub.Execute(step("itself", 4, 49, 49), timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    waited = [e for e in logs if e["event"] == "previous_step_not_seen"]
    assert [e["previous_step_id"] for e in waited] == [47]
