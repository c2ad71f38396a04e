"""Two gateways on one allocator and one executor, and a gateway restarted over its own dead
run: a request id used twice never fails anything but (at most) the request that reuses it.
Before sequence ids were namespaced per gateway run, the allocator refused the whole Step
(ALREADY_EXISTS) and every unrelated request in it failed with UNAVAILABLE."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from e2e_stack import (
    SIMULATED_TOKENS,
    Clients,
    generate,
    prompts,
    reference_greedy,
    sampling,
    start_simulated_stack,
    start_stack,
)

from pagedkv.gateway.v1 import gateway_pb2 as gpb
from pagedkv.gateway.v1 import gateway_pb2_grpc as gpb_grpc


def _request(prompt: list[int], request_id: str, max_tokens: int = 24) -> gpb.GenerateRequest:
    return gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=prompt), request_id=request_id,
                               sampling=sampling(max_tokens, ignore_eos=True))


@pytest.fixture(scope="module")
def two_gateways(tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[tuple[Clients, list[gpb_grpc.GatewayServiceStub]]]:
    """Two gateways over one allocator and two executors."""
    stack = start_stack(tmp_path_factory.mktemp("two-gateways"), num_executors=2,
                        executor_args=("--load-format", "dummy", "--num-blocks", "256",
                                       "--block-size", "16"))
    clients = Clients(stack)
    channel = grpc.insecure_channel(stack.start_gateway("gateway-2").address)
    try:
        yield clients, [clients.gateway, gpb_grpc.GatewayServiceStub(channel)]
    finally:
        channel.close()
        clients.close()
        stack.stop()


def test_the_same_request_ids_through_two_gateways_all_complete(
    two_gateways: tuple[Clients, list[gpb_grpc.GatewayServiceStub]],
):
    clients, stubs = two_gateways
    batch = list(prompts(8, 16, seed=601))
    # Each gateway runs the same eight ids at once ("shared-0".."shared-7"), on
    # different prompts: sixteen requests, eight id collisions at the allocator's level.
    jobs = [(stubs[g], _request(batch[(i + 4 * g) % 8], f"shared-{i}"), batch[(i + 4 * g) % 8])
            for g in (0, 1) for i in range(8)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda job: generate(job[0], job[1]), jobs))
    for (_, _, prompt), done in zip(jobs, results, strict=True):
        assert tuple(done[0].token_ids) == reference_greedy(tuple(prompt), 24,
                                                            ignore_eos=True)
    clients.wait_all_blocks_back()


def test_a_restarted_gateway_reuses_the_ids_of_its_dead_run(tmp_path: Path):
    # SIGKILL the gateway mid-stream: its requests stay admitted until its lease (5 s)
    # expires. Restarted at once, it takes the same ids for new requests: they complete.
    # (Simulated executors: the ids are what is tested.)
    stack = start_simulated_stack(tmp_path, gateway_args=("--lease-ttl-ms", "5000"))
    clients = Clients(stack)
    try:
        batch = list(prompts(4, 16, seed=607))
        calls = [clients.gateway.Generate(_request(p, f"again-{i}", 2000), timeout=60)
                 for i, p in enumerate(batch)]
        for call in calls:
            next(iter(call))
        assert clients.pools()[0].num_requests == 4
        stack.kill("gateway")
        assert [s.name for s in stack.restart_exited()] == ["gateway"]
        fresh = Clients(stack)
        try:
            with ThreadPoolExecutor(4) as pool:
                results = list(pool.map(
                    lambda i: generate(fresh.gateway, _request(batch[3 - i], f"again-{i}")),
                    range(4)))
            for i, done in enumerate(results):
                assert list(done[0].token_ids) == SIMULATED_TOKENS.generate(batch[3 - i], 24)
            fresh.wait_all_blocks_back(timeout_s=15)  # the dead run's, once its lease expires
        finally:
            fresh.close()
    finally:
        clients.close()
        stack.stop()


def test_two_gateways_route_shared_prefixes_to_the_pool_that_holds_them(
    two_gateways: tuple[Clients, list[gpb_grpc.GatewayServiceStub]],
):
    # Two gateways, two executors, one allocator. Each of six prefixes is sent once through
    # one gateway; then a continuation of it through the other gateway goes to the pool that
    # cached it (the allocator's exact index, the same for both), served from that cache.
    # Outputs are the reference's; every block comes back.
    clients, stubs = two_gateways
    prefixes = list(prompts(6, 48, seed=611))

    def first(i: int) -> None:
        generate(stubs[i % 2], _request(prefixes[i], f"prefix-{i}", max_tokens=4))

    with ThreadPoolExecutor(6) as pool:
        list(pool.map(first, range(6)))
    continuations = [[*p, 7, 8, 9] for p in prefixes]

    def then(i: int) -> gpb.Completion:
        return stubs[(i + 1) % 2].Complete(gpb.CompleteRequest(
            token_ids=gpb.TokenIds(ids=continuations[i]), request_id=f"then-{i}",
            sampling=sampling(8, ignore_eos=True)), timeout=60).completions[0]

    with ThreadPoolExecutor(6) as pool:
        done = list(pool.map(then, range(6)))
    for prompt, completion in zip(continuations, done, strict=True):
        assert completion.usage.cached_prompt_tokens == 48  # three full blocks
        assert tuple(completion.token_ids) == reference_greedy(tuple(prompt), 8,
                                                               ignore_eos=True)
    pools = clients.wait_all_blocks_back()
    assert all(p.num_prefix_queries > 0 for p in pools)  # both pools served
