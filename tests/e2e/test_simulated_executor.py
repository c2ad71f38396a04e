"""Allocator + two simulated executors + gateway, as real subprocesses: requests complete with
the simulated model's tokens, shared prefixes hit the cache, forks and every block come back.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_stack import (
    MODEL,
    SIMULATED_ARGS,
    SIMULATED_TOKENS,
    Clients,
    generate,
    generate_many,
    prompts,
    sampling,
)

from pagedkv.gateway.v1 import gateway_pb2 as gpb
from tools.launch import Stack, StackSpec

SIMULATED = SIMULATED_ARGS
TOKENS = SIMULATED_TOKENS


@pytest.fixture(scope="module")
def clients(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Clients]:
    log_dir: Path = tmp_path_factory.mktemp("simulated")
    stack = Stack(StackSpec(model=MODEL, num_executors=2, allocator_port=0, executor_port=0,
                            gateway_port=0, log_dir=str(log_dir),
                            executor_module="executor_svc.simulated", executor_args=SIMULATED))
    clients = None
    try:
        stack.start()
        clients = Clients(stack)
        yield clients
    finally:
        if clients is not None:
            clients.close()
        stack.stop()


def test_simulated_stack_completes_requests_on_both_executors(clients: Clients) -> None:
    # 8 concurrent distinct prompts: each gets the simulated model's greedy continuation,
    # both pools serve some, and every block comes back.
    batch = [list(p) for p in prompts(8, 24, seed=71)]
    requests = [gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=p), sampling=sampling(16))
                for p in batch]
    for prompt, result in zip(batch, generate_many(clients.gateway, requests), strict=True):
        assert result[0].token_ids == TOKENS.generate(prompt, 16)
        assert result[0].finish_reason == gpb.FINISH_REASON_LENGTH
    pools = clients.wait_all_blocks_back()
    assert len(pools) == 2 and all(p.num_prefix_queries > 0 for p in pools), pools


def test_simulated_stack_hits_the_prefix_cache(clients: Clients) -> None:
    # A prompt sharing 64 tokens (4 blocks) with an earlier one is served them from the cache,
    # and continues as the whole prompt does: the executor read the cached blocks' state.
    shared = next(prompts(1, 64, seed=73))
    generate(clients.gateway, gpb.GenerateRequest(
        token_ids=gpb.TokenIds(ids=[*shared, 5]), sampling=sampling(4)))
    done = generate(clients.gateway, gpb.GenerateRequest(
        token_ids=gpb.TokenIds(ids=[*shared, 6, 7]), sampling=sampling(8)))[0]
    assert done.usage is not None and done.usage.cached_prompt_tokens == 64
    assert done.token_ids == TOKENS.generate([*shared, 6, 7], 8)
    pools = clients.wait_all_blocks_back()
    assert sum(p.num_prefix_hits for p in pools) >= 64, pools


def test_simulated_stack_forks_completions(clients: Clients) -> None:
    # n = 3 greedy completions of one prompt share its blocks and continue identically.
    prompt = next(prompts(1, 37, seed=79))
    done = generate(clients.gateway, gpb.GenerateRequest(
        token_ids=gpb.TokenIds(ids=prompt), sampling=sampling(20, n=3)))
    expected = TOKENS.generate(prompt, 20)
    assert sorted(done) == [0, 1, 2]
    assert all(done[i].token_ids == expected for i in done)
    clients.wait_all_blocks_back()
