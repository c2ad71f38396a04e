"""A Step whose deadline passes while it waits in the server's queue is never applied.

The gateway relies on it: after a Step times out it aborts every id the Step may have
created, so a Step applied later would leave requests nobody tracks. The aio server does not
dispatch a call whose deadline has passed, and the Step handler has no await inside, so a
Step is applied entirely before its deadline or not at all. This test pins that down (a
thread-pool server, for one, would run the queued handler late).
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from allocator_svc.core.allocator import Allocator, Limits
from allocator_svc.service import AllocatorServicer
from common.server import start_server
from pagedkv.allocator.v1 import allocator_pb2 as pb
from pagedkv.allocator.v1 import allocator_pb2_grpc as pb_grpc

pytestmark = pytest.mark.service


def _late_step(address: str, epoch: int) -> grpc.StatusCode:
    """From another thread: a Step with a 0.2 s deadline, sent while the server is stalled."""
    time.sleep(0.1)
    with grpc.insecure_channel(address) as channel:
        item = pb.StepItem(request_id="late", prompt_token_ids=[1, 2, 3], num_tokens=3)
        try:
            pb_grpc.AllocatorServiceStub(channel).Step(
                pb.StepRequest(pool_id="p", epoch=epoch, items=[item]), timeout=0.2
            )
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def test_a_step_that_runs_after_its_deadline_changes_nothing():
    # The server's event loop is stalled (as when it is busy) while a Step waits in its
    # queue; when the handler finally runs, the deadline has passed: nothing is admitted.
    allocator = Allocator(Limits())

    async def scenario() -> grpc.StatusCode:
        registration = (
            AllocatorServicer(allocator),
            "pagedkv.allocator.v1.AllocatorService",
        )
        server = await start_server([registration], "127.0.0.1", 0)
        try:
            address = f"127.0.0.1:{server.port}"
            async with grpc.aio.insecure_channel(address) as channel:
                pool = (
                    await pb_grpc.AllocatorServiceStub(channel).RegisterPool(
                        pb.RegisterPoolRequest(
                            pool_id="p",
                            num_blocks=16,
                            block_size=4,
                            model_fingerprint="m",
                            executor_instance_id="i",
                        )
                    )
                ).pool
            late = asyncio.get_running_loop().run_in_executor(None, _late_step, address, pool.epoch)
            time.sleep(0.8)  # the stall: the handler cannot run before the deadline passes
            code = await late
            await asyncio.sleep(0.2)  # let the queued handler run
            return code
        finally:
            await server.server.stop(0)

    code = asyncio.run(scenario())
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "late" not in allocator.pools["p"].requests
    assert allocator.pools["p"].blocks.num_free == 16
