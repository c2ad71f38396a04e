"""A KV pool far too small for the load: preemption happens many times, outputs do not change,
every block comes back; a request that could never fit is refused up front."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from e2e_stack import Clients, generate_many, prompts, reference_greedy, sampling, start_stack

from pagedkv.gateway.v1 import gateway_pb2 as gpb

NUM_BLOCKS = 16  # 256 tokens for 8 concurrent requests of 40 + 48 tokens (704)


# One stack, in swap mode at the default depth (2): swaps cross all three services (the
# allocator's plans, the executor's copies). Recompute and depth 1 are the same requests'
# paths through the scheduler and engine, tested in process against the real allocator core
# (tests/gateway/test_scheduler.py, test_engine.py, test_engine_pipeline.py) and through
# every restart in tests/e2e/test_restart.py (readmission is recompute).
@pytest.fixture(scope="module")
def clients(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Clients]:
    log_dir: Path = tmp_path_factory.mktemp("stack-swap")
    stack = start_stack(
        log_dir,
        executor_args=("--load-format", "dummy", "--num-blocks", str(NUM_BLOCKS)),
        gateway_args=("--preemption-mode", "swap", "--max-num-batched-tokens", "64"),
    )
    clients = Clients(stack)
    yield clients
    clients.close()
    stack.stop()


def test_preemption_keeps_greedy_outputs_and_returns_blocks(clients: Clients):
    # 8 concurrent clients on 16 blocks: many preemptions, outputs equal transformers'.
    before = clients.pools()[0].num_preemptions
    batch = [list(p) for p in prompts(8, 40, seed=31)]
    requests = [gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=p), sampling=sampling(48))
                for p in batch]
    results = generate_many(clients.gateway, requests)
    for prompt, result in zip(batch, results, strict=True):
        assert tuple(result[0].token_ids) == reference_greedy(tuple(prompt), 48)
    pools = clients.wait_all_blocks_back()
    num_preemptions = pools[0].num_preemptions - before
    print(f"preemptions: {num_preemptions}")
    assert num_preemptions >= 5
    assert pools[0].num_free_blocks == NUM_BLOCKS


def test_preemption_of_forked_children_keeps_greedy_outputs(clients: Clients):
    # n=4 greedy children of two requests fight for 16 blocks: forks, copy-on-write and
    # preemptions; every child still equals the reference.
    batch = [list(p) for p in prompts(2, 40, seed=71)]
    requests = [gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=p),
                                    sampling=sampling(24, n=4, ignore_eos=True)) for p in batch]
    results = generate_many(clients.gateway, requests)
    for prompt, result in zip(batch, results, strict=True):
        expected = reference_greedy(tuple(prompt), 24, ignore_eos=True)
        assert [tuple(result[i].token_ids) for i in range(4)] == [expected] * 4
    clients.wait_all_blocks_back()


def test_request_that_never_fits_the_pool_is_resource_exhausted(clients: Clients):
    # 300 prompt + 200 completion tokens need 32 blocks; the pool has 16.
    with pytest.raises(grpc.RpcError) as err:
        clients.gateway.Complete(gpb.CompleteRequest(
            token_ids=gpb.TokenIds(ids=[1] * 300), sampling=sampling(200)), timeout=10)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_tokens" in (err.value.details() or "")
