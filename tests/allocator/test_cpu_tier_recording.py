"""The CPU tier in allocation recordings and their replay: the pool record names the tier, a
replay serves the recorded workload with it (or without it, or with another size), a record
with a tier larger than its CPU blocks is refused."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path

import pytest

from allocator_svc.core.allocator import Allocator, Limits
from allocator_svc.recording import Recorder, RecordingSettings
from allocator_svc.service import AllocatorServicer
from pagedkv.allocator.v1 import allocator_pb2 as pb
from tests.tools.recorded_run import BLOCK_SIZE, BUDGET, drive
from tools.replay.__main__ import build_parser, configs
from tools.replay.records import RecordingError
from tools.replay.simulator import ReplayConfig, replay
from tools.replay.step_time import StepTime
from tools.replay.trace import read_recording
from tools.replay.workload import Workload

pytestmark = pytest.mark.service


def record_tiered_pool(path: Path, tier: int) -> None:
    allocator = Allocator(Limits())
    recorder = Recorder.open(RecordingSettings(str(path)), allocator.pools, clock=lambda: 0.0)
    servicer = AllocatorServicer(allocator, recorder=recorder)
    asyncio.run(servicer.RegisterPool(pb.RegisterPoolRequest(
        pool_id="p", num_blocks=8, block_size=4, num_cpu_blocks=6, num_cpu_cache_blocks=tier,
        model_fingerprint="fp", executor_instance_id="i", enable_prefix_caching=True), None))
    recorder.flush()
    recorder.file.settle()


def test_cpu_tier_recording_pool_record_names_the_tier_only_when_there_is_one(tmp_path):
    for tier, expected in ((4, {"num_cpu_cache_blocks": 4}), (0, {})):
        path = tmp_path / f"rec{tier}.jsonl"
        record_tiered_pool(path, tier)
        pool = json.loads(path.read_text().splitlines()[1])
        assert {k: v for k, v in pool.items() if k == "num_cpu_cache_blocks"} == expected
        shape = read_recording(str(path)).pools["p"].shape
        assert (shape.num_cpu_blocks, shape.num_cpu_cache_blocks) == (6, tier)


def test_cpu_tier_recording_replay_flags_size_the_tier_beside_the_swap_space(tmp_path):
    # Recorded: 6 CPU blocks, 4 of them the tier. By default the replay keeps both; a flag
    # sizes the tier (0: none) beside the 2 blocks of swap space.
    path = tmp_path / "rec.jsonl"
    record_tiered_pool(path, 4)
    trace = read_recording(str(path)).pools["p"]
    for flags, expected in (([], (6, 4)), (["--num-cpu-cache-blocks", "0"], (2, 0)),
                            (["--num-cpu-cache-blocks", "10"], (12, 10))):
        (config,) = configs(trace, build_parser().parse_args([str(path), *flags]))
        assert (config.num_cpu_blocks, config.num_cpu_cache_blocks) == expected


def test_cpu_tier_recording_replays_with_the_tier_and_ends_with_every_block_free(tmp_path):
    # The known recorded workload (shared prefixes) in a pool too small to keep them: with a
    # tier, hits the device pool lost are served from the CPU; without, recomputed.
    path = tmp_path / "rec.jsonl"
    asyncio.run(drive(path))
    workload = Workload.from_trace(read_recording(str(path)).pools["pool-0"])
    base = ReplayConfig(8, BLOCK_SIZE, "recompute", 0, True, BUDGET.max_num_seqs,
                        BUDGET.max_num_batched_tokens, StepTime(0.25), async_depth=2)
    without = replay(workload, base)
    tiered = replay(workload, replace(base, num_cpu_blocks=16, num_cpu_cache_blocks=16))
    assert without.completed and tiered.completed  # (replay asserts no request is held)
    assert tiered.num_prefix_queries == without.num_prefix_queries
    # (At 8 blocks the device pool alone keeps 28 of the 36 tokens a pool large enough hits.)
    assert (without.num_prefix_hits, tiered.num_prefix_hits) == (28, 36)


def test_cpu_tier_recording_with_a_tier_larger_than_its_cpu_blocks_is_refused(tmp_path):
    path = tmp_path / "rec.jsonl"
    record_tiered_pool(path, 4)
    lines = path.read_text().splitlines()
    lines[1] = lines[1].replace('"num_cpu_cache_blocks":4', '"num_cpu_cache_blocks":7')
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(RecordingError, match=r"line 2: .*num_cpu_cache_blocks must be an "
                       r"integer in \[0, num_cpu_blocks=6\], got 7"):
        read_recording(str(path))
