"""Mutual TLS between the services (make certs; python -m tools.launch --tls-dir): the stack
(simulated executors) serves the reference's tokens over the gateway's own TLS port, and an
internal port refuses whoever lacks a certificate of its CA, before any RPC."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from e2e_stack import SIMULATED_TOKENS, generate, prompts, sampling, start_simulated_stack

from common.credentials import InternalAuth, TlsFiles
from pagedkv.allocator.v1 import allocator_pb2 as apb
from pagedkv.allocator.v1 import allocator_pb2_grpc as apb_grpc
from pagedkv.executor.v1 import executor_pb2 as epb
from pagedkv.executor.v1 import executor_pb2_grpc as epb_grpc
from pagedkv.gateway.v1 import gateway_pb2 as gpb
from pagedkv.gateway.v1 import gateway_pb2_grpc as gpb_grpc
from tools.make_certs import make_certs


def test_a_stack_on_mutual_tls_serves_and_refuses_strangers(tmp_path: Path):
    make_certs(tmp_path / "certs", [])
    make_certs(tmp_path / "other-ca", [])
    stack = start_simulated_stack(tmp_path, tls_dir=str(tmp_path / "certs"))
    try:
        prompt = next(prompts(1, 12, seed=503))
        ca = (tmp_path / "certs" / "ca.pem").read_bytes()
        address = stack.gateway_addr.replace("127.0.0.1", "localhost")
        with grpc.secure_channel(address, grpc.ssl_channel_credentials(ca)) as channel:
            done = generate(gpb_grpc.GatewayServiceStub(channel), gpb.GenerateRequest(
                token_ids=gpb.TokenIds(ids=prompt), sampling=sampling(8)))[0]
        assert list(done.token_ids) == SIMULATED_TOKENS.generate(prompt, 8)
        with grpc.insecure_channel(stack.gateway_addr) as channel:  # plaintext: no answer
            with pytest.raises(grpc.RpcError) as err:
                gpb_grpc.GatewayServiceStub(channel).Tokenize(gpb.TokenizeRequest(text="hi"),
                                                              timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        # The stack's own credentials work (the gateway's certificate and its token)...
        with stack.internal_auth.channel(stack.allocator_addr) as channel:
            pools = apb_grpc.AllocatorServiceStub(channel).GetStats(apb.GetStatsRequest()).pools
        assert len(pools) == 1
        # ... a plaintext caller, and one whose certificate another CA signed, get nothing
        # (even with the gateway's token).
        other = tmp_path / "other-ca"
        gateway_token = stack.internal_auth.token
        strangers = [
            InternalAuth(token=gateway_token),
            InternalAuth(token=gateway_token,
                         tls=TlsFiles(str(other / "gateway.pem"), str(other / "gateway-key.pem"),
                                      str(tmp_path / "certs" / "ca.pem"))),
        ]
        for auth in strangers:
            with auth.channel(stack.allocator_addr) as channel:
                with pytest.raises(grpc.RpcError) as err:
                    apb_grpc.AllocatorServiceStub(channel).GetStats(apb.GetStatsRequest(),
                                                                    timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        # A certificate's name is its role, and so is a token's: both must be allowed. An
        # executor's certificate may not call the allocator, even with a gateway's token, nor
        # an executor's token with a gateway's certificate; the allocator's may Describe an
        # executor (to confirm a pool reset) but not run steps.
        certs = tmp_path / "certs"

        def as_role(role: str, token_role: str = "") -> InternalAuth:
            return InternalAuth(token=stack.role_auth(token_role or role).token, tls=TlsFiles(
                str(certs / f"{role}.pem"), str(certs / f"{role}-key.pem"), str(certs / "ca.pem")))

        for auth, message in (
            (as_role("executor", "gateway"),
             "a certificate for 'executor' (role none) may not call GetStats: only gateway may"),
            (as_role("gateway", "executor"),
             "the executor role's token may not call GetStats: only gateway may"),
        ):
            with auth.channel(stack.allocator_addr) as channel:
                with pytest.raises(grpc.RpcError) as err:
                    apb_grpc.AllocatorServiceStub(channel).GetStats(apb.GetStatsRequest(),
                                                                    timeout=5)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert (err.value.details() or "").startswith(message), err.value.details()
        executor_addr = stack.executor_addrs()[0]
        with as_role("allocator").channel(executor_addr) as channel:
            stub = epb_grpc.ExecutorServiceStub(channel)
            assert stub.Describe(epb.DescribeRequest(), timeout=5).instance_id
            with pytest.raises(grpc.RpcError) as err:
                stub.Execute(epb.ExecuteRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with as_role("gateway").channel(executor_addr) as channel:
            epb_grpc.ExecutorServiceStub(channel).Release(epb.ReleaseRequest(), timeout=5)
    finally:
        stack.stop()
