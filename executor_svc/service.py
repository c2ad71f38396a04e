"""The gRPC servicer: decode the proto, call the runner, encode the answer.

Steps (and Releases) run one at a time, in arrival order, in one worker thread, so the event
loop keeps answering health checks and Describe while the model computes. A step that arrives
while another computes (the gateway launches ahead) is decoded meanwhile and waits in the
worker's queue: the worker starts it the moment the one before ends, with no hop through the
event loop. Domain exceptions raised by the runner reach common.interceptor, which maps them
to their status codes.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

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
        # One thread: the runner is not thread-safe, and its queue keeps arrival order.
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="executor-step")

    async def Describe(  # noqa: N802 - gRPC method name
        self, request: pb.DescribeRequest, context: grpc.aio.ServicerContext
    ) -> pb.DescribeResponse:
        return convert.info_to_proto(self._runner.info)

    async def Execute(  # noqa: N802
        self, request: pb.ExecuteRequest, context: grpc.aio.ServicerContext
    ) -> pb.ExecuteResponse:
        step = convert.step_from_proto(request)
        # A cancelled RPC (client gone) drops its step if it has not started; one that has
        # runs to its end in the worker, before anything queued behind it.
        loop = asyncio.get_running_loop()
        result = await loop.run_in_executor(self._worker, self._runner.execute, step)
        return convert.result_to_proto(result, len(request.decode_request_ids))

    async def Release(  # noqa: N802
        self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReleaseResponse:
        loop = asyncio.get_running_loop()
        num_released = await loop.run_in_executor(
            self._worker, self._runner.release, tuple(request.request_ids)
        )
        return pb.ReleaseResponse(num_released=num_released)


def registration(runner: ModelRunner) -> Registration:
    return (pb_grpc.add_ExecutorServiceServicer_to_server, ExecutorServicer(runner), SERVICE_NAME)
