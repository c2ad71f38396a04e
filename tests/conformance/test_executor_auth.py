"""The executor is an internal service: every RPC but health needs an internal credential,
the role of the caller decides what it may call (only a gateway runs steps; ExportKV is
another executor's call), and undecodable bytes are INVALID_ARGUMENT (part of the contract
platform teams implement)."""

from __future__ import annotations

import grpc
import pytest

from common.credentials import InternalAuth
from pagedkv.executor.v1 import executor_pb2 as pb

SERVICE = "pagedkv.executor.v1.ExecutorService"
METHODS = sorted(pb.DESCRIPTOR.services_by_name["ExecutorService"].methods_by_name)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("authorization", [None, "Bearer wrong-token-0123456789"])
def test_a_caller_without_the_internal_token_is_unauthenticated(
    executor_addr: str, method: str, authorization: str | None
) -> None:
    # An executor that answers anyway runs open: it fails here (the contract says closed).
    with grpc.insecure_channel(executor_addr) as channel:
        call = channel.unary_unary(f"/{SERVICE}/{method}")
        metadata = (("authorization", authorization),) if authorization else None
        with pytest.raises(grpc.RpcError) as info:
            call(b"", metadata=metadata, timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, info.value.details()


@pytest.mark.parametrize("method", METHODS)
def test_undecodable_bytes_are_invalid_argument(
    executor_addr: str, internal_auth: InternalAuth, executor_auth: InternalAuth, method: str
) -> None:
    auth = executor_auth if method == "ExportKV" else internal_auth
    with auth.channel(executor_addr) as channel:
        call = channel.unary_unary(f"/{SERVICE}/{method}")
        with pytest.raises(grpc.RpcError) as info:
            call(b"\xff\xff\xff\xff", timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()


@pytest.mark.parametrize("method", ["Execute", "Release", "ImportKV"])
def test_an_executors_credential_may_not_run_steps(
    executor_addr: str, internal_auth: InternalAuth, executor_auth: InternalAuth, method: str
) -> None:
    # An executor (a peer pulling KV) may not step, release or start hand-offs: the role,
    # not the possession of an internal secret, decides.
    if executor_auth.token == internal_auth.token:
        pytest.skip("one credential for both roles: rerun with the executors' own token, "
                    "PAGEDKV_EXECUTOR_TOKEN=<token> make conformance EXECUTOR_ADDR=<host:port>")
    with executor_auth.channel(executor_addr) as channel:
        call = channel.unary_unary(f"/{SERVICE}/{method}")
        with pytest.raises(grpc.RpcError) as info:
            call(b"", timeout=10)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, info.value.details()
