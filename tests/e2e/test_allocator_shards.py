"""Two allocator shards under one gateway, three executors: each pool lives on the shard its
id hashes to, outputs match transformers, nothing leaks; losing a shard fails only the
requests on its pools while the others carry on, and its pool serves again when it returns."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from e2e_stack import SIMULATED_TOKENS, generate, prompts, sampling, start_simulated_stack

from common.sharding import shard_of
from pagedkv.allocator.v1 import allocator_pb2 as apb
from pagedkv.allocator.v1 import allocator_pb2_grpc as apb_grpc
from pagedkv.gateway.v1 import gateway_pb2 as gpb
from pagedkv.gateway.v1 import gateway_pb2_grpc as gpb_grpc
from tools.launch import Stack

NUM_SHARDS = 2
POOLS = ["pool-0", "pool-1", "pool-2"]  # the launcher's names for three executors
LONE_SHARD = 0  # owns pool-2 alone (pool-0 and pool-1 hash to shard 1): checked below


def registered(stack: Stack, pool_id: str) -> bool:
    """The lone shard knows the pool; False while it is not serving (no address yet)."""
    try:
        return pool_id in shard_stats(stack, LONE_SHARD)
    except grpc.RpcError:
        return False


def shard_stats(stack: Stack, shard: int) -> dict[str, apb.PoolStats]:
    with stack.internal_auth.channel(stack.allocator_addrs()[shard]) as channel:
        stub = apb_grpc.AllocatorServiceStub(channel)
        return {p.pool_id: p for p in stub.GetStats(apb.GetStatsRequest(), timeout=10).pools}


def prefix_queries(stack: Stack) -> dict[str, int]:
    """Prompt tokens each pool was asked about: > 0 once a request was admitted there."""
    return {pool_id: stats.num_prefix_queries
            for shard in range(NUM_SHARDS) for pool_id, stats in shard_stats(stack, shard).items()}


def run_all(stub: gpb_grpc.GatewayServiceStub, batch: list[list[int]],
            max_tokens: int) -> None:
    """Concurrent greedy requests, each checked against transformers."""
    def one(prompt: list[int]) -> None:
        done = generate(stub, gpb.GenerateRequest(
            token_ids=gpb.TokenIds(ids=prompt), sampling=sampling(max_tokens)))
        assert list(done[0].token_ids) == SIMULATED_TOKENS.generate(prompt, max_tokens)

    with ThreadPoolExecutor(max_workers=len(batch)) as pool:
        list(pool.map(one, batch))


def wait_no_requests(stack: Stack, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        pools = [p for s in range(NUM_SHARDS) for p in shard_stats(stack, s).values()]
        if all(p.num_requests == 0 and p.num_used_blocks == 0 for p in pools):
            return
        assert time.monotonic() < deadline, f"blocks still in use: {pools}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory):
    assert [shard_of(p, NUM_SHARDS) for p in POOLS] == [1, 1, LONE_SHARD]
    # Requests wait 3 s (not the default 10) for a shard that does not answer.
    stack = start_simulated_stack(tmp_path_factory.mktemp("shards"), allocator_shards=NUM_SHARDS,
                        num_executors=len(POOLS), gateway_args=("--allocator-retry-s", "3"))
    yield stack
    stack.stop()


def test_each_pool_lives_on_its_own_shard_and_outputs_match(stack: Stack):
    for shard in range(NUM_SHARDS):
        assert set(shard_stats(stack, shard)) == {
            p for p in POOLS if shard_of(p, NUM_SHARDS) == shard}
    with grpc.insecure_channel(stack.gateway_addr) as channel:
        stub = gpb_grpc.GatewayServiceStub(channel)
        shared = next(prompts(1, 40, seed=71))
        batch = [shared + p[1:] for p in prompts(9, 6, seed=72)]
        run_all(stub, batch, max_tokens=8)
    assert all(n > 0 for n in prefix_queries(stack).values()), "a pool got no request"
    wait_no_requests(stack)


def test_a_shard_refuses_a_pool_of_another_shard(stack: Stack):
    other = 1 - LONE_SHARD
    before = shard_stats(stack, other)
    with stack.internal_auth.channel(stack.allocator_addrs()[other]) as channel:
        stub = apb_grpc.AllocatorServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.RegisterPool(apb.RegisterPoolRequest(
                pool_id="pool-2", num_blocks=64, block_size=16, model_fingerprint="m",
                executor_instance_id="i", num_shards=NUM_SHARDS), timeout=10)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert (f"pool 'pool-2' belongs to allocator shard {LONE_SHARD} of 2, this allocator is "
            f"shard {other}") in info.value.details()
    assert set(shard_stats(stack, other)) == set(before)


def test_losing_a_shard_fails_only_its_pools_requests(stack: Stack):
    """One long request per pool; the lone shard goes away for good (past the gateway's
    --allocator-retry-s): its pool's request fails with UNAVAILABLE, the others finish and
    match; new requests meanwhile go to the live shard's pools; when the shard returns, its
    pool is registered again and serves."""
    gateway = grpc.insecure_channel(stack.gateway_addr)
    stub = gpb_grpc.GatewayServiceStub(gateway)
    long_prompts = list(prompts(len(POOLS), 12, seed=73))
    max_tokens = 600
    results: dict[int, object] = {}
    streaming = [threading.Event() for _ in POOLS]

    def run(i: int) -> None:
        try:
            results[i] = generate(
                stub, gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=long_prompts[i]),
                                          sampling=sampling(max_tokens, ignore_eos=True)),
                timeout=120, on_tokens=lambda n: n >= 4 and streaming[i].set())
        except grpc.RpcError as exc:
            results[i] = exc
        streaming[i].set()

    try:
        queries_before = prefix_queries(stack)
        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(POOLS))]
        for i, thread in enumerate(threads):
            # One at a time: each goes to the least loaded pool, so one per pool.
            thread.start()
            assert streaming[i].wait(60), "no tokens within 60 s"
        assert not results, f"a request finished before the shard went away: {results}"
        spread = {p: n - queries_before[p] for p, n in prefix_queries(stack).items()}
        assert all(n > 0 for n in spread.values()), f"not one request per pool: {spread}"
        stack.kill(Stack.allocator_name(LONE_SHARD, NUM_SHARDS))
        # Meanwhile new requests go to the live shard's pools and succeed.
        run_all(stub, list(prompts(4, 10, seed=74)), max_tokens=6)
        for thread in threads:
            thread.join(120)
        failed = {i: r for i, r in results.items() if isinstance(r, grpc.RpcError)}
        assert len(failed) == 1, results
        error = next(iter(failed.values()))
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert "allocator has not answered" in error.details()
        for i, done in results.items():
            if i not in failed:
                assert list(done[0].token_ids) == SIMULATED_TOKENS.generate(  # type: ignore[index]
                    long_prompts[i], max_tokens)
        # The shard returns (as the launcher restarts it): its pool is registered again.
        assert [s.name for s in stack.restart_exited()] == [
            Stack.allocator_name(LONE_SHARD, NUM_SHARDS)]
        deadline = time.monotonic() + 30
        while not registered(stack, "pool-2"):
            assert time.monotonic() < deadline, "pool-2 was not registered again"
            time.sleep(0.2)
            stack.restart_exited()  # (one that exited while starting, under load, starts again)
        run_all(stub, list(prompts(6, 10, seed=75)), max_tokens=6)
        assert shard_stats(stack, LONE_SHARD)["pool-2"].num_prefix_queries > 0
        wait_no_requests(stack)
    finally:
        gateway.close()
