"""The gRPC servicer on a real server (port 0): conversion, status codes, health."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future

import grpc
import pytest
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.server import Server, start_server
from executor_svc.runner import ModelRunner
from executor_svc.service import SERVICE_NAME, registration
from pagedkv.executor.v1 import executor_pb2 as pb
from pagedkv.executor.v1 import executor_pb2_grpc as pb_grpc

from .oracle import random_prompts, reference_generate, reference_model

Served = tuple[pb_grpc.ExecutorServiceStub, grpc.Channel, ModelRunner]


@pytest.fixture
def served(make_runner: Callable[..., ModelRunner]) -> Iterator[Served]:
    """An in-process server on its own event loop thread; a sync client channel."""
    runner = make_runner(num_blocks=64, max_num_seqs=4)
    loop = asyncio.new_event_loop()
    started: Future[Server] = Future()

    def serve() -> None:
        asyncio.set_event_loop(loop)
        started.set_result(
            loop.run_until_complete(start_server([registration(runner)], "127.0.0.1", 0))
        )
        loop.run_forever()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    server = started.result(timeout=30)
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    yield pb_grpc.ExecutorServiceStub(channel), channel, runner
    channel.close()
    asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(timeout=10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=10)


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
    assert (info.backend, info.device, info.dtype) == ("torch", "cpu", "float32")
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


def test_service_queues_a_step_that_arrives_while_one_computes(served: Served) -> None:
    # Steps run one at a time in arrival order, in the worker: a step sent while another
    # computes starts once that one ends; one whose caller gave up before it started never
    # runs; Describe is answered meanwhile.
    stub, _, runner = served
    original = runner.execute
    started, release = threading.Event(), threading.Event()
    order: list[tuple[str, str]] = []

    def execute(step):  # type: ignore[no-untyped-def]
        rid = step.seqs[0].request_id
        order.append(("start", rid))
        if rid == "first":
            started.set()
            assert release.wait(timeout=30)
        try:
            return original(step)
        finally:
            order.append(("end", rid))

    runner.execute = execute  # type: ignore[method-assign]
    first = stub.Execute.future(_first_step("first", [5, 6, 7], [1]))
    assert started.wait(timeout=30)
    second = stub.Execute.future(_first_step("second", [8, 9], [2]))
    with pytest.raises(grpc.RpcError) as err:
        stub.Execute(_first_step("gave-up", [4], [3]), timeout=0.2)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert stub.Describe(pb.DescribeRequest(), timeout=5).num_blocks == 64
    release.set()
    assert first.result(timeout=30).tokens[0].request_id == "first"
    assert second.result(timeout=30).tokens[0].request_id == "second"
    assert order == [("start", "first"), ("end", "first"), ("start", "second"),
                     ("end", "second")]
    assert set(runner.requests) == {"first", "second"}


def test_service_a_call_naming_a_refused_call_goes_on_and_one_never_seen_is_not_waited_for(
    served: Served,
) -> None:
    # A refused call counts as taken: the call naming it runs without waiting. A call naming
    # an id never seen runs after a bounded wait, which is logged.
    stub, _, _ = served
    refused = _first_step("refused", [1, 2], [64])  # block 64 is out of range
    refused.step_id = 41
    with structlog.testing.capture_logs() as logs:
        with pytest.raises(grpc.RpcError) as err:
            stub.Execute(refused, timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        after_refused = _first_step("after-refused", [1, 2], [0])
        after_refused.step_id, after_refused.previous_step_id = 42, 41
        assert stub.Execute(after_refused, timeout=30).tokens[0].request_id == "after-refused"
        assert not [e for e in logs if e["event"] == "previous_step_not_seen"]
        orphan = _first_step("orphan", [3, 4], [1])
        orphan.step_id, orphan.previous_step_id = 44, 43  # 43 never comes
        assert stub.Execute(orphan, timeout=30).tokens[0].request_id == "orphan"
    waited = [e for e in logs if e["event"] == "previous_step_not_seen"]
    assert [e["previous_step_id"] for e in waited] == [43]
