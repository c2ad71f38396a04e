"""The replay at other configurations: block sizes from hashes against the recorded token ids
(exact at multiples of the recorded size, a lower bound at divisors), the smallest pool
without preemption, swap preemption; every run ends with every block free."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import pytest

from tests.tools.recorded_run import BLOCK_SIZE, BUDGET, NUM_BLOCKS, drive
from tools.replay.records import PoolTrace, RecordedRequest
from tools.replay.report import result_row
from tools.replay.search import find_min_blocks
from tools.replay.simulator import ReplayConfig, replay
from tools.replay.step_time import StepTime, fit
from tools.replay.trace import read_recording
from tools.replay.workload import ReplayError, Workload

pytestmark = pytest.mark.service


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> PoolTrace:
    """The recorded run, with token ids."""
    path = tmp_path_factory.mktemp("replay") / "rec.jsonl"
    asyncio.run(drive(path, token_ids=True))
    recording = read_recording(str(path))
    assert recording.token_ids
    return recording.pools["pool-0"]


def without_token_ids(trace: PoolTrace) -> PoolTrace:
    def strip(request: RecordedRequest) -> RecordedRequest:
        return replace(request, token_ids=None,
                       children=tuple(strip(c) for c in request.children))

    return replace(trace, requests=tuple(strip(r) for r in trace.requests))


def config(num_blocks: int, block_size: int, **changes: object) -> ReplayConfig:
    return replace(ReplayConfig(num_blocks, block_size, "recompute", 0, True,
                                BUDGET.max_num_seqs, BUDGET.max_num_batched_tokens,
                                StepTime(0.25), async_depth=1),
                   **changes)


def test_replay_simulator_block_sizes_from_hashes_against_token_ids(trace: PoolTrace) -> None:
    # Hashes only, the recorded size and its multiples give the token ids' hits exactly; a
    # divisor at most as many (a prefix shared into a recorded block is seen to its start).
    exact, hashed = Workload.from_trace(trace), Workload.from_trace(without_token_ids(trace))
    hits = {}
    for block_size in (1, 2, BLOCK_SIZE, 2 * BLOCK_SIZE, 3 * BLOCK_SIZE):
        tokens = NUM_BLOCKS * BLOCK_SIZE * 4  # no preemption at any size
        by_ids = replay(exact, config(tokens // block_size, block_size))
        by_hashes = replay(hashed, config(tokens // block_size, block_size))
        assert by_ids.num_preemptions == by_hashes.num_preemptions == 0
        assert by_ids.num_prefix_queries == by_hashes.num_prefix_queries
        hits[block_size] = (by_hashes.num_prefix_hits, by_ids.num_prefix_hits)
    for block_size in (BLOCK_SIZE, 2 * BLOCK_SIZE, 3 * BLOCK_SIZE):
        assert hits[block_size][0] == hits[block_size][1]
    assert hits[BLOCK_SIZE][0] > hits[2 * BLOCK_SIZE][0] > 0
    for block_size in (1, 2):
        assert hits[block_size][0] <= hits[block_size][1]
    assert hits[1][1] > hits[1][0]  # the prompts share tokens into a recorded block: missed


def test_replay_simulator_finds_the_smallest_pool_without_preemption(trace: PoolTrace) -> None:
    # N serves it without a preemption, N - 1 does not; neither needs more than the search.
    workload = Workload.from_trace(trace)
    found = find_min_blocks(workload, config(1, BLOCK_SIZE))
    smallest = found.config.num_blocks
    assert replay(workload, config(smallest, BLOCK_SIZE)).num_preemptions == 0
    assert replay(workload, config(smallest - 1, BLOCK_SIZE)).num_preemptions > 0
    assert smallest > NUM_BLOCKS  # the recorded pool preempted
    assert found.num_probes <= 10


def test_replay_simulator_swap_preempts_by_swapping(trace: PoolTrace) -> None:
    # With CPU blocks, a short pool swaps out instead of recomputing, and swaps back in.
    workload = Workload.from_trace(trace)
    swapped = replay(workload, config(NUM_BLOCKS, BLOCK_SIZE, preemption_mode="swap",
                                      num_cpu_blocks=NUM_BLOCKS))
    assert swapped.num_preemptions == swapped.num_swap_outs > 0
    recomputed = replay(workload, config(NUM_BLOCKS, BLOCK_SIZE))
    assert recomputed.num_swap_outs == 0 and recomputed.num_preemptions > 0
    # Without swap space, swap falls back to recompute (the allocator's rule).
    fallback = replay(workload, config(NUM_BLOCKS, BLOCK_SIZE, preemption_mode="swap"))
    assert fallback.num_swap_outs == 0 and fallback.num_preemptions > 0


def test_replay_simulator_preempts_by_cost_as_the_allocator_would(trace: PoolTrace) -> None:
    # The allocator's --preemption-policy cost in the replay: the same short pool serves every
    # request either way, and the report names the policy.
    workload = Workload.from_trace(trace)
    tail = replay(workload, config(NUM_BLOCKS, BLOCK_SIZE))
    cost = replay(workload, config(NUM_BLOCKS, BLOCK_SIZE, preemption_policy="cost"))
    assert tail.num_requests == cost.num_requests == len(trace.requests)
    assert tail.num_preemptions > 0 and cost.num_preemptions > 0
    assert result_row("p", cost)[4] == "recompute, by cost"
    assert result_row("p", tail)[4] == "recompute"


def test_replay_simulator_a_pool_too_small_for_one_request(trace: PoolTrace) -> None:
    workload = Workload.from_trace(trace)
    need, job = workload.blocks_needed(BLOCK_SIZE)
    assert job is not None
    with pytest.raises(ReplayError, match=f"need {need} blocks; use --num-blocks {need} or more"):
        replay(workload, config(need - 1, BLOCK_SIZE))
    with pytest.raises(ReplayError, match="block size must be a positive integer, got 0"):
        replay(workload, config(NUM_BLOCKS, 0))
    with pytest.raises(ReplayError, match="block_size=2048 is out of range: 1..1024"):
        replay(workload, config(NUM_BLOCKS, 2048))


def test_replay_simulator_reports_utilisation(trace: PoolTrace, tmp_path: Path) -> None:
    # Peak and mean use are shares of the pool; a pool twice as large halves the peak share.
    workload = Workload.from_trace(trace)
    small = replay(workload, config(4 * NUM_BLOCKS, BLOCK_SIZE))
    large = replay(workload, config(8 * NUM_BLOCKS, BLOCK_SIZE))
    assert small.peak_used_blocks == large.peak_used_blocks
    assert large.peak_utilization == pytest.approx(small.peak_utilization / 2)
    assert 0 < small.mean_utilization <= small.peak_utilization <= 1
    assert small.hit_rate == pytest.approx(small.num_prefix_hits / small.num_prefix_queries)


def test_replay_simulator_step_time_fits_the_recorded_gaps() -> None:
    # Gaps that grow with the batch are fitted back; a coefficient that would be negative is
    # dropped; a handful of steps gives their median.
    samples = [(rows, tokens, 0.010 + 0.002 * rows + 0.0001 * (tokens - rows))
               for rows in range(1, 30) for tokens in (rows, rows + 50, rows + 400)]
    model = fit(samples, 0.02)
    assert (model.base_s, model.per_row_s, model.per_token_s) == pytest.approx(
        (0.010, 0.002, 0.0001))
    falling = [(rows, rows + 10 * rows, 0.05 - 0.0001 * rows) for rows in range(1, 40)]
    assert fit(falling, 0.02).per_row_s == 0.0
    assert fit([(1, 1, 0.03), (2, 2, 0.01), (3, 3, 0.02)], 0.5) == StepTime(0.02)
    assert fit([], 0.5) == StepTime(0.5)
