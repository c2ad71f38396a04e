"""A pinned system prompt through the whole stack: pinned with the operator's tool before any
traffic, it stays cached under eviction pressure that evicts everything else, so a later
request hits it (and still equals transformers' greedy output); unpinned, the same pressure
evicts it (the control)."""

from __future__ import annotations

from pathlib import Path

import pytest
from e2e_stack import SIMULATED_TOKENS, Clients, generate, prompts, sampling, start_simulated_stack

from common.credentials import ROLE_TOKEN_ENV
from pagedkv.allocator.v1 import allocator_pb2 as apb
from pagedkv.gateway.v1 import gateway_pb2 as gpb
from tools import pin as pin_tool

NUM_BLOCKS = 16  # of 16 tokens: 256 tokens in all
SYSTEM_TOKENS = 48  # three blocks, within the pin budget of 4 (--max-pinned-fraction 0.25)


def ask(clients: Clients, prompt: list[int], max_tokens: int) -> tuple[list[int], int]:
    """Greedy completion and its cached prompt tokens."""
    done = generate(clients.gateway, gpb.GenerateRequest(
        token_ids=gpb.TokenIds(ids=prompt), sampling=sampling(max_tokens, ignore_eos=True)))[0]
    assert done.usage is not None
    return done.token_ids, done.usage.cached_prompt_tokens


def pressure(clients: Clients, seed: int) -> None:
    """Three requests of 12 blocks each, one after the other: every block that is not held
    is reused (and its cached prefix evicted)."""
    for prompt in prompts(3, 150, seed=seed):
        ask(clients, prompt, 40)


def test_a_pinned_system_prompt_survives_eviction_pressure(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch):
    # Simulated executors: the pin is the allocator's; their tokens still show whether the
    # hit read the right blocks.
    stack = start_simulated_stack(tmp_path, allocator_args=("--max-pinned-fraction", "0.25"),
                                  executor_args=("--num-blocks", str(NUM_BLOCKS)))
    clients = Clients(stack)
    try:
        monkeypatch.setenv(ROLE_TOKEN_ENV, stack.internal_auth.token)  # the gateway's
        (pool,) = clients.pools()
        system = next(prompts(1, SYSTEM_TOKENS, seed=901))
        tool = ["--allocator-addr", stack.allocator_addr, "--pool", pool.pool_id]
        assert pin_tool.main([*tool, "--token-ids", ",".join(map(str, system)),
                              "--name", "system"]) == 0
        (pin,) = clients.allocator.ListPins(apb.ListPinsRequest(pool_id=pool.pool_id)).pins
        assert (pin.num_blocks, pin.num_pending_blocks) == (3, 3)
        # The first request caches the system prompt: the pin holds it from then on.
        _, cached = ask(clients, [*system, 7, 8, 9], 4)
        assert cached == 0
        (pin,) = clients.allocator.ListPins(apb.ListPinsRequest(pool_id=pool.pool_id)).pins
        assert pin.num_pinned_blocks == 3
        evictions = clients.pools()[0].num_evictions
        pressure(clients, seed=902)
        assert clients.pools()[0].num_evictions > evictions
        # A later request with the system prompt hits it, and reads the right KV from it.
        question = [*system, 11, 12, 13, 14]
        tokens, cached = ask(clients, question, 8)
        assert cached == SYSTEM_TOKENS
        assert list(tokens) == SIMULATED_TOKENS.generate(question, 8)
        # Unpinned, the same pressure evicts it: the pin was what kept it.
        assert pin_tool.main([*tool, "--unpin", pin.pin_id]) == 0
        pressure(clients, seed=903)
        _, cached = ask(clients, [*system, 21, 22, 23], 4)
        assert cached == 0
        pools = clients.wait_all_blocks_back()
        assert pools[0].num_pinned_blocks == 0 and pools[0].num_free_blocks == NUM_BLOCKS
    finally:
        clients.close()
        stack.stop()
