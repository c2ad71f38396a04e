"""Two executors behind one gateway: requests spread over both pools with unchanged outputs;
an executor killed mid-run leaves its requests to the other one (or a clean UNAVAILABLE)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from e2e_stack import (
    Clients,
    Streamed,
    generate,
    generate_many,
    prompts,
    reference_greedy,
    sampling,
    start_stack,
)

from pagedkv.gateway.v1 import gateway_pb2 as gpb


@pytest.fixture(scope="module")
def clients(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Clients]:
    log_dir: Path = tmp_path_factory.mktemp("stack")
    stack = start_stack(log_dir, num_executors=2,
                        executor_args=("--load-format", "dummy", "--num-blocks", "128"))
    clients = Clients(stack)
    yield clients
    clients.close()
    stack.stop()


def test_two_executors_spread_requests_and_keep_outputs(clients: Clients):
    # 8 concurrent distinct prompts: both pools serve some, outputs equal transformers'.
    batch = [list(p) for p in prompts(8, 24, seed=41)]
    requests = [gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=p), sampling=sampling(16))
                for p in batch]
    results = generate_many(clients.gateway, requests)
    for prompt, result in zip(batch, results, strict=True):
        assert tuple(result[0].token_ids) == reference_greedy(tuple(prompt), 16)
    pools = clients.wait_all_blocks_back()
    assert len(pools) == 2
    assert all(p.num_prefix_queries > 0 for p in pools), pools
    info = clients.gateway.GetModelInfo(gpb.GetModelInfoRequest())
    assert [e.healthy for e in info.executors] == [True, True]


def test_prefix_hit_routes_to_the_pool_that_cached_it(clients: Clients):
    # A prompt sharing 64 tokens with an earlier one goes where those blocks are cached.
    shared = next(prompts(1, 64, seed=43))
    generate(clients.gateway, gpb.GenerateRequest(
        token_ids=gpb.TokenIds(ids=shared + [5]), sampling=sampling(4)))
    done = generate(clients.gateway, gpb.GenerateRequest(
        token_ids=gpb.TokenIds(ids=shared + [6, 7]), sampling=sampling(4)))[0]
    assert done.usage is not None and done.usage.cached_prompt_tokens == 64


def test_killed_executor_requests_finish_on_the_other_one(clients: Clients):
    # Executor 0 is killed while 6 long requests stream: each finishes with the reference
    # output (recomputed on executor 1) or fails cleanly with UNAVAILABLE; nothing hangs.
    batch = [list(p) for p in prompts(6, 20, seed=47)]
    results: list[dict[int, Streamed] | grpc.RpcError | None] = [None] * len(batch)
    first_token = threading.Event()

    def run(i: int) -> None:
        request = gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=batch[i]),
                                      sampling=sampling(150, ignore_eos=True))
        out: dict[int, Streamed] = {0: Streamed()}
        try:
            for response in clients.gateway.Generate(request, timeout=120):
                first_token.set()
                out[0].token_ids.extend(response.token_ids)
                if response.finish_reason:
                    out[0].finish_reason = response.finish_reason
            results[i] = out
        except grpc.RpcError as exc:
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(batch))]
    for t in threads:
        t.start()
    assert first_token.wait(60)
    clients.stack.kill("executor-0")
    for t in threads:
        t.join(150)
        assert not t.is_alive(), "a request hung after its executor died"
    finished = 0
    for prompt, result in zip(batch, results, strict=True):
        if isinstance(result, grpc.RpcError):
            assert result.code() == grpc.StatusCode.UNAVAILABLE, result
            continue
        assert result is not None
        assert tuple(result[0].token_ids) == reference_greedy(tuple(prompt), 150, ignore_eos=True)
        finished += 1
    assert finished == len(batch)  # one executor is left: every request can finish there
    info = clients.gateway.GetModelInfo(gpb.GetModelInfoRequest())
    assert [e.healthy for e in info.executors] == [False, True]
    survivor = [p for p in clients.pools() if p.pool_id == info.executors[1].pool_id][0]
    assert survivor.num_used_blocks == 0 and survivor.num_requests == 0
    # New requests still work, on the survivor.
    prompt = next(prompts(1, 10, seed=53))
    done = generate(clients.gateway, gpb.GenerateRequest(
        token_ids=gpb.TokenIds(ids=prompt), sampling=sampling(8)))[0]
    assert tuple(done.token_ids) == reference_greedy(tuple(prompt), 8)
