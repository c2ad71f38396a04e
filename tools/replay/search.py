"""The smallest pool that serves a workload without preemption: each probe a replay (stopped at
its first preemption), doubling from the largest request's own need until one passes, then
bisecting.

NOTE: bisection assumes a larger pool never preempts where a smaller one did not. Scheduling
can break that in corner cases (a larger pool admits earlier and ends up with a different
mix); the answer is then a pool that serves it without preemption, perhaps not the smallest.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from tools.replay.simulator import ReplayConfig, replay
from tools.replay.workload import ReplayError, Workload

MAX_BLOCKS = 1 << 22


@dataclass(frozen=True, slots=True)
class MinBlocks:
    config: ReplayConfig  # with num_blocks the smallest found
    num_probes: int
    wall_s: float


def find_min_blocks(workload: Workload, base: ReplayConfig) -> MinBlocks:
    started = time.perf_counter()
    num_probes = 0

    def serves(num_blocks: int) -> bool:
        nonlocal num_probes
        num_probes += 1
        config = replace(base, num_blocks=num_blocks)
        return replay(workload, config, stop_at_first_preemption=True).completed

    low, _ = workload.blocks_needed(base.block_size)  # the smallest that can hold it at all
    if serves(low):
        high = low
    else:
        high = low * 2
        while not serves(high):  # `low` preempts, `high` is untried
            low, high = high, high * 2
            if high > MAX_BLOCKS:
                raise ReplayError(f"no pool up to {MAX_BLOCKS} blocks serves it without "
                                  "preemption")
        while high - low > 1:  # `low` preempts, `high` does not
            middle = (low + high) // 2
            if serves(middle):
                high = middle
            else:
                low = middle
    return MinBlocks(replace(base, num_blocks=high), num_probes, time.perf_counter() - started)
