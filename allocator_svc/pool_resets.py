"""A pool is reset only by its own executor: before a registration with a new instance id
replaces a live pool, the allocator asks the executor at the address given for its instance
id (Describe, with the allocator's internal credentials) and compares."""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from common.credentials import InternalAuth
from common.errors import FailedPrecondition, PermissionDenied, Unavailable
from pagedkv.executor.v1 import executor_pb2 as epb
from pagedkv.executor.v1 import executor_pb2_grpc as epb_grpc

DESCRIBE_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class ResetVerifier:
    auth: InternalAuth
    timeout_s: float = DESCRIBE_TIMEOUT_S

    async def verify(self, pool_id: str, address: str, instance_id: str) -> None:
        """Raises unless the executor at `address` reports `instance_id`."""
        if not address:
            raise FailedPrecondition(
                f"registering pool {pool_id!r} with executor instance {instance_id[:64]!r} "
                "would reset it: send executor_address, where the allocator can confirm the "
                "instance with the executor itself"
            )
        async with self.auth.aio_channel(address) as channel:
            try:
                info = await epb_grpc.ExecutorServiceStub(channel).Describe(
                    epb.DescribeRequest(), metadata=self.auth.call_metadata(),
                    timeout=self.timeout_s)
            except grpc.aio.AioRpcError as exc:
                raise Unavailable(
                    f"cannot confirm pool {pool_id!r}'s reset: the executor at {address[:128]} "
                    f"did not answer Describe ({exc.code().name})"
                ) from exc
        if info.instance_id != instance_id:
            raise PermissionDenied(
                f"the executor at {address[:128]} reports instance {info.instance_id!r}, not "
                f"{instance_id[:64]!r}: only an executor's own instance id resets its pool"
            )
