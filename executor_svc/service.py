"""The gRPC servicer: decode the proto, call the runner, encode the answer.

Steps run one at a time (an asyncio lock) in a worker thread, so the event loop keeps
answering health checks and Describe while the model computes. Domain exceptions raised by the
runner reach common.interceptor, which maps them to their status codes.
"""

from __future__ import annotations

import asyncio

import grpc

from common.server import Registration
from executor_svc import convert
from executor_svc.runner import ModelRunner
from pagedkv.executor.v1 import executor_pb2 as pb
from pagedkv.executor.v1 import executor_pb2_grpc as pb_grpc

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ExecutorService"].full_name


class ExecutorServicer(pb_grpc.ExecutorServiceServicer):
    def __init__(self, runner: ModelRunner) -> None:
        self._runner = runner
        self._lock = asyncio.Lock()

    async def Describe(  # noqa: N802 - gRPC method name
        self, request: pb.DescribeRequest, context: grpc.aio.ServicerContext
    ) -> pb.DescribeResponse:
        return convert.info_to_proto(self._runner.info)

    async def Execute(  # noqa: N802
        self, request: pb.ExecuteRequest, context: grpc.aio.ServicerContext
    ) -> pb.ExecuteResponse:
        step = convert.step_from_proto(request)
        async with self._lock:
            # NOTE: a cancelled RPC (client gone) must not release the lock while the step
            # still runs in its thread: the next call would touch the same state.
            task = asyncio.ensure_future(asyncio.to_thread(self._runner.execute, step))
            try:
                result = await asyncio.shield(task)
            except asyncio.CancelledError:
                await asyncio.wait([task])
                raise
        return convert.result_to_proto(result, len(request.decode_request_ids))

    async def Release(  # noqa: N802
        self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReleaseResponse:
        async with self._lock:
            num_released = self._runner.release(tuple(request.request_ids))
        return pb.ReleaseResponse(num_released=num_released)


def registration(runner: ModelRunner) -> Registration:
    return (pb_grpc.add_ExecutorServiceServicer_to_server, ExecutorServicer(runner), SERVICE_NAME)
