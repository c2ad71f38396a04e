"""Several callers on one executor, as several gateways scheduling onto one pool: each caller's
calls, whatever runs beside them (an executor may merge the calls waiting for it into one
forward pass), give that caller its own rows, its own errors and the reference's tokens; one
caller's bad request or departure never fails another's."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import grpc
import pytest

from common.credentials import InternalAuth
from pagedkv.executor.v1 import executor_pb2 as pb
from pagedkv.executor.v1 import executor_pb2_grpc as pb_grpc

from .conftest import Executor, Reference, reference_generate, require_uses_sampled_tokens

pytestmark = pytest.mark.conformance
A = TypeVar("A")
B = TypeVar("B")


def _prompts(vocab_size: int, lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in lengths]


@pytest.fixture
def second_caller(executor: Executor, internal_auth: InternalAuth) -> Iterator[Executor]:
    """Another caller (its own channel, requests and step ids), taking blocks from the same
    executor's blocks as the first, as two gateways take them from one allocator."""
    channel = internal_auth.channel(executor.address)
    yield Executor(stub=pb_grpc.ExecutorServiceStub(channel), channel=channel,
                   info=executor.info, blocks=executor.blocks,
                   export_stub=executor.export_stub, export_channel=executor.export_channel,
                   address=executor.address)
    channel.close()


def _decode_ahead(caller: Executor, rids: list[str], prompts: list[list[int]],
                  num_steps: int) -> dict[str, list[int]]:
    """Prefill, then `num_steps` decode steps, each sent before the one it builds on has
    returned (use_sampled_token, numbered by step_id / previous_step_id)."""
    step_id = time.time_ns() + random.randrange(1 << 20)  # unlike any other caller's ids
    prefill = [caller.work(r, p) for r, p in zip(rids, prompts, strict=True)]
    calls = [caller.stub.Execute.future(pb.ExecuteRequest(seqs=prefill, step_id=step_id),
                                        timeout=60)]
    for step in range(num_steps):
        seqs = [caller.work(r, [0]) for r in rids]
        for work in seqs:
            work.use_sampled_token = True
        calls.append(caller.stub.Execute.future(
            pb.ExecuteRequest(seqs=seqs, step_id=step_id + 1, previous_step_id=step_id),
            timeout=60))
        step_id += 1
        calls[step].result()  # the one before returns only now: two are in flight
    outputs: dict[str, list[int]] = {r: [] for r in rids}
    for call in calls:
        for token in call.result().tokens:
            outputs[token.request_id].append(token.token_id)
    caller.forget(*rids)
    return outputs


def _beside(first: Callable[[], A], second: Callable[[], B]) -> tuple[A, B]:
    with ThreadPoolExecutor(2) as pool:
        a, b = pool.submit(first), pool.submit(second)
        return a.result(timeout=120), b.result(timeout=120)


def test_two_callers_stepping_at_once_each_get_the_reference_tokens(
    executor: Executor, second_caller: Executor, reference: Reference
) -> None:
    # Two callers, each two requests decoded 12 steps with two calls in flight, at once: each
    # caller's replies carry only its own requests, and the tokens equal the reference's.
    require_uses_sampled_tokens(executor)
    prompts = _prompts(executor.info.vocab_size, [7, 19, 12, 26], seed=21)
    num_new = 12
    mine, theirs = _beside(
        lambda: _decode_ahead(executor, ["callers-a0", "callers-a1"], prompts[:2], num_new - 1),
        lambda: _decode_ahead(second_caller, ["callers-b0", "callers-b1"], prompts[2:],
                              num_new - 1))
    outputs = {**mine, **theirs}
    assert set(mine) == {"callers-a0", "callers-a1"}
    for rid, prompt in zip(outputs, prompts, strict=True):
        assert outputs[rid] == reference_generate(reference, prompt, num_new), f"{rid} diverged"


def test_one_callers_refused_steps_never_fail_anothers(
    executor: Executor, second_caller: Executor, reference: Reference
) -> None:
    # While one caller decodes, the other sends steps that are refused (an unknown request,
    # a block outside the pool, a token it has not sampled): each refusal has its own status,
    # none holds anything, and the first caller's tokens are the reference's.
    require_uses_sampled_tokens(executor)
    prompts = _prompts(executor.info.vocab_size, [9, 14], seed=22)
    num_blocks = executor.info.num_blocks
    bad = [
        (pb.ExecuteRequest(seqs=[pb.SequenceWork(request_id="refused-ghost", token_ids=[3],
                                                 start_position=4, sample=True)]),
         grpc.StatusCode.NOT_FOUND),
        (pb.ExecuteRequest(seqs=[pb.SequenceWork(
            request_id="refused-block", token_ids=[3, 4], sample=True,
            sampling=pb.SamplingParams(),
            delta=pb.BlockTableDelta(block_ids=[num_blocks]))]),
         grpc.StatusCode.INVALID_ARGUMENT),
        (pb.ExecuteRequest(seqs=[pb.SequenceWork(
            request_id="refused-sampled", token_ids=[0], use_sampled_token=True, sample=True,
            sampling=pb.SamplingParams(),
            delta=pb.BlockTableDelta(block_ids=[0]))]),
         grpc.StatusCode.FAILED_PRECONDITION),
    ]
    codes: list[grpc.StatusCode] = []

    def refused() -> None:
        for i in range(24):
            request, expected = bad[i % len(bad)]
            with pytest.raises(grpc.RpcError) as err:
                second_caller.stub.Execute(request, timeout=60)
            assert err.value.code() == expected, err.value.details()
            codes.append(err.value.code())

    outputs, _ = _beside(
        lambda: _decode_ahead(executor, ["refused-a0", "refused-a1"], prompts, 15), refused)
    for rid, prompt in zip(outputs, prompts, strict=True):
        assert outputs[rid] == reference_generate(reference, prompt, 16), f"{rid} diverged"
    assert len(codes) == 24
    released = second_caller.stub.Release(pb.ReleaseRequest(
        request_ids=["refused-ghost", "refused-block", "refused-sampled"]))
    assert released.num_released == 0, "a refused step left a request held"


def test_a_caller_that_goes_away_loses_only_its_own(
    executor: Executor, second_caller: Executor, reference: Reference
) -> None:
    # While one caller decodes, the other sends prefills and gives up on each before it can
    # return: the first caller's tokens are the reference's, and the one that went away can
    # release what it left and carry on.
    require_uses_sampled_tokens(executor)
    prompts = _prompts(executor.info.vocab_size, [11, 8, 30], seed=23)
    gone: list[str] = []
    cancelled: list[bool] = []

    def going_away() -> None:
        for i in range(12):
            rid = f"gone-{i}"
            work = second_caller.work(rid, prompts[2])
            call = second_caller.stub.Execute.future(pb.ExecuteRequest(seqs=[work]), timeout=60)
            cancelled.append(call.cancel())  # False only if it had already returned
            gone.append(rid)
            time.sleep(0.002)

    outputs, _ = _beside(
        lambda: _decode_ahead(executor, ["stays-0", "stays-1"], prompts[:2], 15), going_away)
    for rid, prompt in zip(outputs, prompts[:2], strict=True):
        assert outputs[rid] == reference_generate(reference, prompt, 16), f"{rid} diverged"
    assert any(cancelled), "every call returned before its caller could go away"
    second_caller.forget(*gone)  # whichever of them ran are held: released now
    again = _decode_ahead(second_caller, ["back"], prompts[2:], 3)
    assert again["back"] == reference_generate(reference, prompts[2], 4)
