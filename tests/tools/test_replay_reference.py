"""The replay against independent references: a known workload driven through a real allocator
server on loopback is read back as the workload that was sent (its chain hashes as the block-hash
profile computes them), and replayed at the recorded configuration it gives the server's own
prefix-hit and preemption counters."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from allocator_svc.recording import HASH_PREFIX_BYTES
from common.block_hash import hash_chain, root_hash
from gateway.core.seq_ids import prefill_parent_id
from tests.tools.recorded_run import (
    BLOCK_SIZE,
    BUDGET,
    NUM_BLOCKS,
    STEP_S,
    WORKLOAD,
    drive,
    output_token,
)
from tools.replay.simulator import ReplayConfig, replay
from tools.replay.step_time import StepTime
from tools.replay.trace import read_recording
from tools.replay.workload import Workload

pytestmark = pytest.mark.service


def test_replay_reference_recording_reads_back_the_workload_sent(tmp_path: Path) -> None:
    # Arrivals, prompt and output lengths, the fork and the abort, and each request's chain
    # hashes (the allocator's, as the block-hash profile computes them) come back as sent.
    path = tmp_path / "rec.jsonl"
    asyncio.run(drive(path))
    trace = read_recording(str(path)).pools["pool-0"]
    assert trace.num_unfinished == 0
    assert trace.shape.block_size == BLOCK_SIZE and trace.shape.num_blocks == NUM_BLOCKS
    by_id = {r.request_id: r for r in trace.requests}
    assert sorted(by_id) == sorted(
        s.request_id if len(s.num_outputs) == 1 else prefill_parent_id(s.request_id)
        for s in WORKLOAD)
    root = root_hash("fp-test", "")
    for sent in WORKLOAD:
        if len(sent.num_outputs) > 1:
            parent = by_id[prefill_parent_id(sent.request_id)]
            assert parent.num_tokens == len(sent.prompt) - 1  # the prompt but its last token
            assert [c.num_tokens for c in parent.children] == [
                len(sent.prompt) + n - 1 for n in sent.num_outputs]
            continue
        got = by_id[sent.request_id]
        # Seen by the allocator once the gateway's budget let it be sent: not before it came.
        assert got.arrival_s >= sent.arrival_step * STEP_S
        assert got.num_prompt_tokens == len(sent.prompt)
        assert got.num_tokens == len(sent.prompt) + sent.num_outputs[0] - 1
        assert got.aborted == sent.aborted
        tokens = sent.prompt + [output_token(sent.request_id, p) for p in range(
            len(sent.prompt), got.num_tokens)]
        expected = b"".join(h[:HASH_PREFIX_BYTES] for h in hash_chain(root, tokens, BLOCK_SIZE))
        assert expected.startswith(got.block_hashes) and got.block_hashes
        if not sent.aborted:  # freed: committed to its end
            assert got.block_hashes == expected
    assert [r.request_id for r in trace.requests][:2] in (["a", "b"], ["b", "a"])


def test_replay_reference_at_the_recorded_config_matches_the_servers_counters(
        tmp_path: Path) -> None:
    # The same pool, budget and step time: the replay makes the same calls, so its prefix
    # hits, lookups, preemptions, steps and peak use are the recorded server's own.
    path = tmp_path / "rec.jsonl"
    stats, steps = asyncio.run(drive(path))
    assert stats.num_preemptions > 0 and stats.num_prefix_hits > 0  # the scenario's point
    trace = read_recording(str(path)).pools["pool-0"]
    # Every step took STEP_S: the fitted step time is that, whatever the batch.
    assert trace.step_time.seconds(1, 1) == pytest.approx(STEP_S)
    assert trace.step_time.seconds(6, 12) == pytest.approx(STEP_S)
    assert trace.recorded.num_preemptions == stats.num_preemptions
    assert trace.recorded.num_steps == steps
    result = replay(Workload.from_trace(trace), ReplayConfig(
        NUM_BLOCKS, BLOCK_SIZE, "recompute", 0, True, BUDGET.max_num_seqs,
        BUDGET.max_num_batched_tokens, StepTime(STEP_S), async_depth=1))
    assert (result.num_prefix_hits, result.num_prefix_queries, result.num_preemptions) == (
        stats.num_prefix_hits, stats.num_prefix_queries, stats.num_preemptions)
    assert result.num_steps == steps
    assert result.peak_used_blocks == trace.recorded.peak_used_blocks
    assert result.sum_used_blocks == trace.recorded.sum_used_blocks
