"""Trust through the whole stack (real subprocesses): API keys and tenants at the public door,
closed internal services where the caller's role decides what it may call, and bounded inputs
that cannot stall or bloat the gateway."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from e2e_stack import (
    SIMULATED_TOKENS,
    Clients,
    generate,
    http_base,
    prompts,
    sampling,
    start_simulated_stack,
)

from common.credentials import with_metadata
from gateway.api.tenants import Tenancy, load_tenancy
from pagedkv.allocator.v1 import allocator_pb2 as apb
from pagedkv.allocator.v1 import allocator_pb2_grpc as apb_grpc
from pagedkv.executor.v1 import executor_pb2 as epb
from pagedkv.executor.v1 import executor_pb2_grpc as epb_grpc
from pagedkv.gateway.v1 import gateway_pb2 as gpb
from pagedkv.gateway.v1 import gateway_pb2_grpc as gpb_grpc

KEY_A = "key-of-tenant-a-0123456789"
KEY_B = "key-of-tenant-b-0123456789"
MAX_PROMPT_BYTES = 65536
TENANT_MAX_REQUESTS = 6


@pytest.fixture(scope="module")
def clients(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Clients]:
    log_dir: Path = tmp_path_factory.mktemp("stack")
    keys = log_dir / "api-keys"
    keys.write_text(f"# key tenant\n{KEY_A} tenant-a\n{KEY_B} tenant-b\n")
    # Simulated executors (steps at a tenth of the modelled time): what is tested is who may
    # do what, not the model's numbers.
    stack = start_simulated_stack(
        log_dir, executor_args=("--time-scale", "0.1"),
        allocator_args=("--max-blocks-per-tenant", "128"),
        gateway_args=("--api-keys-file", str(keys), "--max-prompt-bytes", str(MAX_PROMPT_BYTES),
                      "--max-num-seqs", "2", "--tenant-max-requests", str(TENANT_MAX_REQUESTS),
                      "--tenant-max-running", "1"))
    clients = Clients(stack, http=http_base(stack))
    yield clients
    clients.close()
    stack.stop()


def as_tenant(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


def run(clients: Clients, request: gpb.GenerateRequest, key: str = KEY_A) -> gpb.Completion:
    response = clients.gateway.Complete(
        gpb.CompleteRequest(**{f.name: v for f, v in request.ListFields()}),
        metadata=as_tenant(key), timeout=60)
    return response.completions[0]


@pytest.mark.parametrize("authorization", [None, "Bearer not-a-key-0123456789", "Basic abc"])
def test_the_public_api_needs_a_valid_key(clients: Clients, authorization: str | None):
    metadata = (("authorization", authorization),) if authorization else None
    for call in (
        lambda: clients.gateway.Complete(gpb.CompleteRequest(text="hi", sampling=sampling(2)),
                                         metadata=metadata, timeout=10),
        lambda: clients.gateway.Tokenize(gpb.TokenizeRequest(text="hi"), metadata=metadata,
                                         timeout=10),
        lambda: clients.gateway.GetModelInfo(gpb.GetModelInfoRequest(), metadata=metadata,
                                             timeout=10),
    ):
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_prefix_hits_never_cross_tenants(clients: Clients):
    # Tenant A's prompt is cached for A; B sending the same prompt, with no salt or with any
    # salt it can choose, computes it afresh. Outputs are the reference's either way.
    prompt = next(prompts(1, 40, seed=401))
    request = gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=prompt), sampling=sampling(4))
    expected = tuple(SIMULATED_TOKENS.generate(prompt, 4))
    first = run(clients, request, KEY_A)
    again = run(clients, request, KEY_A)
    assert first.usage.cached_prompt_tokens == 0 and again.usage.cached_prompt_tokens >= 32
    # Even A's own derived salt, sent by B as its salt, is joined under B's.
    tenancy = load_tenancy("", "", clients.stack.internal_auth.token)  # the gateway's
    a_salt = Tenancy({KEY_A: "tenant-a"}, tenancy.salt_secret).cache_salt("tenant-a", "")
    for salt in ("", "tenant-a", a_salt):
        salted = gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=prompt), sampling=sampling(4),
                                     cache_salt=salt)
        other = run(clients, salted, KEY_B)
        assert other.usage.cached_prompt_tokens == 0, salt
        assert tuple(other.token_ids) == expected
    assert tuple(first.token_ids) == tuple(again.token_ids) == expected


@pytest.mark.parametrize("service", ["allocator", "executor-0"])
def test_a_stranger_gets_nothing_from_the_internal_services(clients: Clients, service: str):
    address = clients.stack.by_name(service).address
    method = ("/pagedkv.allocator.v1.AllocatorService/GetStats" if service == "allocator"
              else "/pagedkv.executor.v1.ExecutorService/Describe")
    with grpc.insecure_channel(address) as channel:
        with pytest.raises(grpc.RpcError) as err:
            channel.unary_unary(method)(b"", timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_lower_case_bearer_is_the_same_scheme(clients: Clients):
    # RFC 7235: the scheme's name is case-insensitive (`bearer` was refused).
    request = gpb.TokenizeRequest(text="hi")
    for scheme in ("bearer", "BEARER"):
        reply = clients.gateway.Tokenize(request, metadata=(("authorization",
                                                              f"{scheme} {KEY_A}"),), timeout=10)
        assert list(reply.token_ids)


def _denied(call: Any) -> str:
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, err.value.details()
    return str(err.value.details())


def test_an_executors_credential_can_neither_poison_the_cache_nor_read_prompts(clients: Clients):
    # Issue 30: an executor's token (every executor holds one) once stepped and freed with a
    # commit and no Execute, filling a tenant's prefix cache with blocks no model computed,
    # and read every tenant's prompts through GetEvents. Now every such call is refused, and
    # an innocent request of that prompt gets no cached tokens and the reference's output.
    stack = clients.stack
    (pool,) = clients.pools()
    prompt = next(prompts(1, 70, seed=421))
    with stack.role_auth("executor").channel(stack.allocator_addr) as channel:
        allocator = apb_grpc.AllocatorServiceStub(channel)
        calls = {
            "CreateLease": lambda: allocator.CreateLease(apb.CreateLeaseRequest(), timeout=10),
            "Step": lambda: allocator.Step(apb.StepRequest(
                pool_id=pool.pool_id, epoch=pool.epoch, lease_id="any", items=[apb.StepItem(
                    request_id="poison", prompt_token_ids=prompt, num_tokens=len(prompt))]),
                timeout=10),
            "Free": lambda: allocator.Free(apb.FreeRequest(
                pool_id=pool.pool_id, epoch=pool.epoch, lease_id="any", request_ids=["poison"],
                commits=[apb.Commit(request_id="poison", num_computed_tokens=len(prompt))]),
                timeout=10),
            "Abort": lambda: allocator.Abort(apb.AbortRequest(
                pool_id=pool.pool_id, epoch=pool.epoch, lease_id="any", request_ids=["x"]),
                timeout=10),
            "GetEvents": lambda: allocator.GetEvents(apb.GetEventsRequest(
                pool_id=pool.pool_id), timeout=10),
            "RegisterPool": lambda: allocator.RegisterPool(apb.RegisterPoolRequest(
                pool_id="not-mine", num_blocks=16, block_size=16,
                model_fingerprint="x", executor_instance_id="y"), timeout=10),
        }
        for method, call in calls.items():
            assert _denied(call) == (
                f"the executor role's token may not call {method}: only gateway may")
    executor_addr = stack.executor_addrs()[0]
    with stack.role_auth("executor").channel(executor_addr) as channel:
        executor = epb_grpc.ExecutorServiceStub(channel)
        assert _denied(lambda: executor.Execute(epb.ExecuteRequest(), timeout=10)) == (
            "the executor role's token may not call Execute: only gateway may")
    with stack.internal_auth.channel(executor_addr) as channel:  # the gateway's
        assert epb_grpc.ExecutorServiceStub(channel).Describe(epb.DescribeRequest(),
                                                              timeout=10).instance_id
    request = gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=prompt), sampling=sampling(4))
    innocent = run(clients, request, KEY_A)
    assert innocent.usage.cached_prompt_tokens == 0
    assert tuple(innocent.token_ids) == tuple(SIMULATED_TOKENS.generate(prompt, 4))


def test_no_log_line_of_the_stack_names_a_lease_id(clients: Clients):
    # A lease id is a capability (an Abort under it passes): the allocator's and gateway's
    # logs name leases by tag.
    log_dir = Path(str(clients.stack.spec.log_dir))
    lines = [line for name in ("allocator.log", "gateway.log")
             for line in (log_dir / name).read_text().splitlines()]
    leased = [line for line in lines if "lease_created" in line or "lease_acquired" in line]
    assert leased and all("lease=lease-" in line for line in leased), leased
    assert not [line for line in lines if "lease_id=" in line or '"lease_id"' in line]


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_huge_prompts_are_refused_at_once_and_a_stream_beside_them_is_unaffected(
    clients: Clients,
):
    # A stream runs while a 60 MB prompt (refused by gRPC before it is parsed), a 2 MB one
    # (refused before tokenizing) and an over-long chat arrive: each is refused quickly, the
    # gateway's memory does not grow, and the stream's output is the reference's.
    prompt = next(prompts(1, 12, seed=409))
    result: dict[str, object] = {}

    def stream() -> None:
        result["done"] = generate(stub, gpb.GenerateRequest(
            token_ids=gpb.TokenIds(ids=prompt), sampling=sampling(60, ignore_eos=True)),
            timeout=120)

    gateway_pid = clients.stack.by_name("gateway").process.pid
    rss_before = _rss_bytes(gateway_pid)
    channel = with_metadata(grpc.insecure_channel(clients.stack.gateway_addr), as_tenant(KEY_A))
    stub = gpb_grpc.GatewayServiceStub(channel)
    thread = threading.Thread(target=stream)
    thread.start()
    try:
        cases = [
            ("x" * 60_000_000, grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max"),
            # Under gRPC's cap (2 x --max-prompt-bytes + 1 MiB), over the prompt's.
            ("y" * 1_000_000, grpc.StatusCode.INVALID_ARGUMENT,
             f"prompt text is 1000000 bytes; this gateway accepts at most {MAX_PROMPT_BYTES}"),
        ]
        for text, code, message in cases:
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:
                stub.Complete(gpb.CompleteRequest(text=text, sampling=sampling(2)), timeout=30)
            assert err.value.code() == code and message in (err.value.details() or "")
            assert time.monotonic() - started < 5.0  # the transfer itself, then at once
        with pytest.raises(grpc.RpcError) as err:
            stub.Complete(gpb.CompleteRequest(chat=gpb.ChatMessages(messages=[
                gpb.ChatMessage(role="user", content="z" * 40_000)] * 2), sampling=sampling(2)))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "chat content is 80008 bytes" in (err.value.details() or "")
    finally:
        thread.join(120)
        channel.close()
    done = result["done"]
    assert isinstance(done, dict)
    assert tuple(done[0].token_ids) == tuple(SIMULATED_TOKENS.generate(prompt, 60))
    assert _rss_bytes(gateway_pid) - rss_before < 64 * 2**20


@pytest.mark.parametrize(("sampling_fields", "ids", "message"), [
    ({"stop": ["s"] * 33}, {}, "sampling.stop has 33 strings; at most 32"),
    ({"stop": ["s" * 257]}, {}, "sampling.stop has a string of 257 characters; at most 256"),
    ({}, {"request_id": "r" * 129}, "request_id has 129 characters; at most 128"),
    ({}, {"request_id": "caf\u00e9"}, "request_id must be printable ASCII"),
    ({}, {"request_id": "a\nb"}, "request_id must be printable ASCII"),
    ({}, {"cache_salt": "s" * 129}, "cache_salt has 129 characters; at most 128"),
    # The OpenAI sampling fields, on gRPC too (the same validation as HTTP's 400s).
    ({"min_p": 1.5}, {}, "sampling.min_p is 1.5; it must be in [0.0, 1.0]"),
    ({"presence_penalty": 2.5}, {}, "sampling.presence_penalty is 2.5"),
    ({"repetition_penalty": 0.0}, {}, "sampling.repetition_penalty is 0.0"),
    ({"logit_bias": {600: 1.0}}, {}, "sampling.logit_bias has token id 600, outside"),
    ({"logit_bias": {5: 101.0}}, {}, "sampling.logit_bias[5] is 101.0"),
    ({"logprobs": 21}, {}, "sampling.logprobs is 21; it must be in [0, 20]"),
    ({"min_tokens": 3}, {}, "sampling.min_tokens is 3; it must be <= max_tokens (2)"),
])
def test_bounded_fields_are_invalid_argument(clients: Clients, sampling_fields, ids, message):
    request = gpb.CompleteRequest(text="hi", sampling=sampling(2, **sampling_fields), **ids)
    with pytest.raises(grpc.RpcError) as err:
        clients.gateway.Complete(request, metadata=as_tenant(KEY_A), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in (err.value.details() or "")


def test_undecodable_bytes_are_invalid_argument_at_the_gateway(clients: Clients):
    with grpc.insecure_channel(clients.stack.gateway_addr) as channel:
        call = channel.unary_unary("/pagedkv.gateway.v1.GatewayService/Complete")
        with pytest.raises(grpc.RpcError) as err:
            call(b"\xff\xff\xff\xff", metadata=as_tenant(KEY_A), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_tenant_at_its_quota_cannot_starve_another(clients: Clients):
    # Two sequences per step, one running request per tenant: tenant A fills its quota of
    # six requests in flight (long ones), B sends a short one after them. B is admitted
    # beside A's first instead of waiting behind A's queue: it finishes before any of A's.
    # A's seventh request is refused, naming the quota.
    batch = list(prompts(7, 10, seed=419))
    channels = {key: with_metadata(grpc.insecure_channel(clients.stack.gateway_addr),
                                   as_tenant(key)) for key in (KEY_A, KEY_B)}
    stubs = {key: gpb_grpc.GatewayServiceStub(channel) for key, channel in channels.items()}
    finished: list[str] = []

    def run_a(i: int) -> None:
        generate(stubs[KEY_A], gpb.GenerateRequest(
            token_ids=gpb.TokenIds(ids=batch[i]), sampling=sampling(400, ignore_eos=True)),
            timeout=120)
        finished.append(f"a{i}")

    threads = [threading.Thread(target=run_a, args=(i,)) for i in range(TENANT_MAX_REQUESTS)]
    for thread in threads:
        thread.start()
    try:
        # Once the gateway holds all six (its log says so), a seventh is refused.
        log = Path(clients.stack.by_name("gateway").log_path or "")
        deadline = time.monotonic() + 30
        while log.read_text().count("max_tokens=400") < TENANT_MAX_REQUESTS:
            assert time.monotonic() < deadline, "A's six requests never all arrived"
            time.sleep(0.02)
        with pytest.raises(grpc.RpcError) as err:
            stubs[KEY_A].Complete(gpb.CompleteRequest(text="one more", sampling=sampling(2)),
                                  timeout=30)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"quota (--tenant-max-requests {TENANT_MAX_REQUESTS})" in (
            err.value.details() or "")
        done = generate(stubs[KEY_B], gpb.GenerateRequest(
            token_ids=gpb.TokenIds(ids=batch[6]), sampling=sampling(8, ignore_eos=True)),
            timeout=60)[0]
        finished.append("b")
    finally:
        for thread in threads:
            thread.join(120)
        for channel in channels.values():
            channel.close()
    assert finished[0] == "b", finished
    assert tuple(done.token_ids) == tuple(SIMULATED_TOKENS.generate(batch[6], 8))
    clients.wait_all_blocks_back()


def test_request_ids_are_each_tenants_own(clients: Clients):
    # A and B run the same request ids at once (n = 2: sequence ids too): both complete with
    # the reference's tokens; neither can learn, or block, the other's ids.
    batch = list(prompts(2, 12, seed=431))
    channels = {key: with_metadata(grpc.insecure_channel(clients.stack.gateway_addr),
                                   as_tenant(key)) for key in (KEY_A, KEY_B)}
    try:
        def run(key: str, prompt: list[int]) -> dict[int, Any]:
            return generate(gpb_grpc.GatewayServiceStub(channels[key]), gpb.GenerateRequest(
                token_ids=gpb.TokenIds(ids=prompt), request_id="shared-id",
                sampling=sampling(40, n=2, ignore_eos=True)), timeout=120)

        with ThreadPoolExecutor(2) as pool:
            results = list(pool.map(run, (KEY_A, KEY_B), batch))
    finally:
        for channel in channels.values():
            channel.close()
    for prompt, done in zip(batch, results, strict=True):
        expected = tuple(SIMULATED_TOKENS.generate(prompt, 40))
        assert [tuple(done[i].token_ids) for i in (0, 1)] == [expected, expected]


def test_concurrent_requests_cannot_overrun_the_in_flight_quota(clients: Clients):
    # Twenty text requests of one tenant at once (each awaits its tokenization): at most
    # TENANT_MAX_REQUESTS get in, the others are RESOURCE_EXHAUSTED.
    channel = with_metadata(grpc.insecure_channel(clients.stack.gateway_addr), as_tenant(KEY_B))
    stub = gpb_grpc.GatewayServiceStub(channel)
    calls = [stub.Generate(gpb.GenerateRequest(text=f"request number {i} " * 20,
                                               sampling=sampling(400, ignore_eos=True)),
                           timeout=60) for i in range(20)]
    admitted = refused = 0
    try:
        for call in calls:
            try:
                next(iter(call))
                admitted += 1
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc.details()
                refused += 1
    finally:
        for call in calls:
            call.cancel()
        channel.close()
    assert admitted <= TENANT_MAX_REQUESTS and admitted + refused == 20
    clients.wait_all_blocks_back()


@pytest.mark.parametrize("authorization", [None, "Bearer not-a-key-0123456789", "Basic abc"])
def test_the_http_api_needs_a_valid_key(clients: Clients, authorization: str | None):
    # 401 in OpenAI's error shape on every endpoint that serves a tenant; /health stays open
    # for probes; /metrics, with keys on, answers any valid key (a scraper's), 401 otherwise.
    import httpx

    headers = {"authorization": authorization} if authorization else {}
    body = {"model": "tiny-llama", "prompt": "hi", "max_tokens": 2}
    for response in (httpx.post(f"{clients.http}/v1/completions", json=body, headers=headers),
                     httpx.get(f"{clients.http}/v1/models", headers=headers)):
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{clients.http}/health").status_code == 200
    assert httpx.get(f"{clients.http}/metrics", headers=headers).status_code == 401
    assert httpx.get(f"{clients.http}/metrics",
                     headers={"authorization": f"Bearer {KEY_B}"}).status_code == 200


def test_the_http_api_serves_tenants_and_refuses_one_over_its_quota(clients: Clients):
    # With A's key, the official client works; past A's in-flight quota it gets 429
    # (openai.RateLimitError), and B is unaffected.
    import openai

    client_a = openai.OpenAI(base_url=f"{clients.http}/v1", api_key=KEY_A, max_retries=0)
    client_b = openai.OpenAI(base_url=f"{clients.http}/v1", api_key=KEY_B, max_retries=0)
    prompt = next(prompts(1, 10, seed=441))
    streams = [client_a.completions.create(model="tiny-llama", prompt=prompt, max_tokens=400,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
               for _ in range(TENANT_MAX_REQUESTS)]
    try:  # (each create returned once its stream's headers came: the request is queued)
        with pytest.raises(openai.RateLimitError, match="tenant-max-requests"):
            client_a.completions.create(model="tiny-llama", prompt="x", max_tokens=2)
        done = client_b.completions.create(model="tiny-llama", prompt=prompt, max_tokens=6,
                                           temperature=0, extra_body={"ignore_eos": True})
        expected = tuple(SIMULATED_TOKENS.generate(prompt, 6))
        from e2e_stack import tokenizer

        assert done.choices[0].text == tokenizer().decode(list(expected),
                                                          skip_special_tokens=True)
    finally:
        for stream in streams:
            stream.close()
    clients.wait_all_blocks_back()


def test_only_the_executor_itself_can_reset_its_pool(clients: Clients):
    # Even an internal caller (it holds the token) cannot reset a live pool with an instance
    # id the executor does not report: the allocator asks the executor first. The pool, and
    # the requests it serves, are untouched.
    from pagedkv.allocator.v1 import allocator_pb2 as apb

    stub = clients.allocator
    (stats,) = clients.pools()
    info = stub.DescribePool(apb.DescribePoolRequest(pool_id=stats.pool_id), timeout=10).pool
    executor_addr = clients.stack.executor_addrs()[0]

    def register(instance_id: str, address: str) -> apb.RegisterPoolResponse:
        return stub.RegisterPool(apb.RegisterPoolRequest(
            pool_id=info.pool_id, num_blocks=info.num_blocks, block_size=info.block_size,
            num_cpu_blocks=info.num_cpu_blocks, model_fingerprint=info.model_fingerprint,
            executor_instance_id=instance_id, enable_prefix_caching=info.enable_prefix_caching,
            executor_address=address), timeout=30)

    for address, code, words in (
        ("", grpc.StatusCode.FAILED_PRECONDITION, "send executor_address"),
        (executor_addr, grpc.StatusCode.PERMISSION_DENIED, "only an executor's own"),
        ("127.0.0.1:1", grpc.StatusCode.UNAVAILABLE, "did not answer"),
    ):
        with pytest.raises(grpc.RpcError) as err:
            register("forged-instance", address)
        assert err.value.code() == code and words in (err.value.details() or "")
    same = register(info.executor_instance_id, executor_addr)  # its own id: no reset
    assert not same.reset and same.pool.epoch == info.epoch
    prompt = next(prompts(1, 12, seed=451))
    done = run(clients, gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=prompt),
                                            sampling=sampling(5, ignore_eos=True)))
    assert tuple(done.token_ids) == tuple(SIMULATED_TOKENS.generate(prompt, 5))
