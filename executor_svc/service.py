"""The gRPC servicer: decode the proto, call the runner, encode the answer.

Steps (and Releases) run one at a time, in the order they are queued, in the executor's compute
thread (compute_thread.py: the thread that loaded the model), so the event loop keeps
answering health checks and Describe while the model computes. A step
that arrives while another computes (the gateway launches ahead) is decoded meanwhile and
waits in the worker's queue: the worker starts it the moment the one before ends, with no hop
through the event loop. A step naming a `previous_step_id` not taken yet waits for it first,
and is refused if it never comes (step_order.py). Domain exceptions raised by the runner
reach common.interceptor, which maps them to their status codes.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc

from common.errors import FailedPrecondition, InvalidArgument
from common.server import Registration
from executor_svc import convert
from executor_svc.compute_thread import compute_thread
from executor_svc.runner import ModelRunner
from executor_svc.step_order import ORDER_WAIT_S, StepOrder
from pagedkv.executor.v1 import executor_pb2 as pb
from pagedkv.executor.v1 import executor_pb2_grpc as pb_grpc

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ExecutorService"].full_name
T = TypeVar("T")


class ExecutorServicer(pb_grpc.ExecutorServiceServicer):
    def __init__(self, runner: ModelRunner, worker: ThreadPoolExecutor | None = None) -> None:
        self._runner = runner
        # One thread: the runner is not thread-safe, and its queue keeps the order.
        self._worker = worker or compute_thread()
        self._order = StepOrder()

    async def Describe(  # noqa: N802 - gRPC method name
        self, request: pb.DescribeRequest, context: grpc.aio.ServicerContext
    ) -> pb.DescribeResponse:
        return convert.info_to_proto(self._runner.info)

    async def Execute(  # noqa: N802
        self, request: pb.ExecuteRequest, context: grpc.aio.ServicerContext
    ) -> pb.ExecuteResponse:
        try:
            step = convert.step_from_proto(request)
            previous = request.previous_step_id
            if previous and previous == request.step_id:
                raise InvalidArgument(f"previous_step_id {previous} names this call itself")
            if not await self._order.after(previous):
                raise FailedPrecondition(
                    f"previous_step_id {previous}: no such call reached this executor within "
                    f"{ORDER_WAIT_S:g} s; this call builds on it, so it does not run"
                )
            # A cancelled RPC (client gone) drops its step if it has not started; one that has
            # runs to its end, before anything queued behind it.
            result = self._in_worker(self._runner.execute, step)
        finally:
            self._order.take(request.step_id)  # queued, refused or given up: the next goes on
        return convert.result_to_proto(await result, len(request.decode_request_ids))

    async def Release(  # noqa: N802
        self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReleaseResponse:
        num_released = await self._in_worker(self._runner.release, tuple(request.request_ids))
        return pb.ReleaseResponse(num_released=num_released)

    def _in_worker(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """Queue `fn(*args)` for the worker, in the caller's context (its log bindings)."""
        context = contextvars.copy_context()
        return asyncio.get_running_loop().run_in_executor(self._worker, context.run, fn, *args)


def registration(runner: ModelRunner, worker: ThreadPoolExecutor | None = None) -> Registration:
    """`worker`: the thread that built `runner` (compute_thread.py); None: a new one."""
    servicer = ExecutorServicer(runner, worker)
    return (servicer, SERVICE_NAME)
