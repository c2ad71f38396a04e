"""The prefix cache's CPU tier end to end: a conversation returns after other prompts evicted
its blocks from a small device pool. With the executor's --cpu-cache-space its prefix is
copied back from CPU blocks instead of computed again; its greedy output is the same either way
and equals transformers' own generate; every block comes back."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest
from e2e_stack import ROOT, Clients, generate, prompts, reference_greedy, sampling, start_stack

from pagedkv.gateway.v1 import gateway_pb2 as gpb

NUM_BLOCKS = 16  # 256 tokens: one long prompt evicts everything cached
BLOCK_SIZE = 16
TIER_GIB = "0.0005"  # tiny-llama's blocks are 8 KiB: 65 CPU blocks


@pytest.fixture(scope="module", params=["tier", "no-tier"])
def served(request: pytest.FixtureRequest,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Clients, bool]]:
    """The stack's clients, and whether its executor has a CPU tier."""
    tier = ("--cpu-cache-space", TIER_GIB) if request.param == "tier" else ()
    stack = start_stack(
        tmp_path_factory.mktemp(f"stack-{request.param}"),
        executor_args=("--load-format", "dummy", "--num-blocks", str(NUM_BLOCKS),
                       "--swap-space", "0", *tier),
    )
    clients = Clients(stack)
    yield clients, bool(tier)
    clients.close()
    stack.stop()


def complete(clients: Clients, prompt: list[int], max_tokens: int) -> tuple[list[int], int]:
    """Greedy output and cached prompt tokens."""
    (out,) = generate(clients.gateway, gpb.GenerateRequest(
        token_ids=gpb.TokenIds(ids=prompt), sampling=sampling(max_tokens, ignore_eos=True)
    )).values()
    assert out.usage is not None
    return out.token_ids, out.usage.cached_prompt_tokens


def test_cpu_tier_returning_conversation_after_eviction_equals_generate(
    served: tuple[Clients, bool],
):
    # Turn 1: 96 prompt + 16 output tokens, of which 111 computed (the last output token's KV
    # is never written): 6 full blocks committed. Four 199-token prompts
    # then each take 13 of the 16 device blocks: turn 1's blocks are evicted from the device.
    # Turn 2 (turn 1, its answer, 8 new tokens) finds them in the CPU tier, or recomputes.
    clients, tier = served
    (first, *others) = [list(p) for p in prompts(5, 96, seed=41)]
    pressure = [p + p[1:] + p[1:9] for p in others]  # 199 tokens each, sharing nothing
    answer, _ = complete(clients, first, 16)
    assert tuple(answer) == reference_greedy(tuple(first), 16, ignore_eos=True)
    for prompt in pressure:
        complete(clients, prompt, 1)
    (pool,) = clients.pools()
    assert pool.num_evictions >= 6
    before = pool.num_prefix_cpu_hits
    turn2 = first + answer + list(range(300, 308))
    output, cached = complete(clients, turn2, 16)
    assert tuple(output) == reference_greedy(tuple(turn2), 16, ignore_eos=True)
    (pool,) = clients.wait_all_blocks_back()
    if tier:
        assert pool.num_cpu_cache_blocks == 65
        assert cached == 6 * BLOCK_SIZE  # every block turn 1 committed, from the CPU
        assert pool.num_prefix_cpu_hits - before == cached
        assert pool.num_cpu_cache_loads >= 6
    else:
        assert pool.num_cpu_cache_blocks == 0 and pool.num_prefix_cpu_hits == 0
        assert cached == 0  # evicted: computed again
    assert pool.num_free_blocks == NUM_BLOCKS


@pytest.mark.parametrize(("value", "message"), [
    ("-1", "executor: --cpu-cache-space must be >= 0 GiB (0: no CPU tier), not -1.0"),
    ("100000", "2 executor(s) x (--cpu-cache-space 100000 + --swap-space 0.25 GiB) is more "
               "than this machine's"),
])
def test_cpu_tier_launcher_refuses_what_the_machine_cannot_give(value: str, message: str):
    # Before anything starts: a usage error (exit 2) naming the flag, counting every executor.
    result = subprocess.run(
        [sys.executable, "-m", "tools.launch", "--model", "tiny-llama", "--num-executors", "2",
         "--cpu-cache-space", value], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith(
        f"python -m tools.launch: error: {message}")
