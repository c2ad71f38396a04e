"""ReserveHandOff in allocation recordings: a handoff record in the target pool, which the
replay reads as the request's arrival there (every token it brought its prompt) and replays
without error; a bad handoff record is refused with its line."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from allocator_svc.core.allocator import Allocator, Limits
from allocator_svc.recording import HASH_PREFIX_BYTES, Recorder, RecordingSettings
from allocator_svc.service import AllocatorServicer
from common.block_hash import hash_chain, root_hash
from pagedkv.allocator.v1 import allocator_pb2 as pb
from tools.replay.__main__ import main
from tools.replay.records import RecordingError
from tools.replay.simulator import ReplayConfig, replay
from tools.replay.trace import read_recording
from tools.replay.workload import Workload

BS = 4
TOKENS = list(range(8)) + [90, 91, 92, 93, 94]  # 13 tokens: three full blocks


class Driver:
    """Two pools of one recording allocator, called in process: "src" computes a request,
    "p" takes it by hand-off."""

    def __init__(self, path: Path) -> None:
        self.allocator = Allocator(Limits())
        self.now = [0.0]
        self.recorder = Recorder.open(RecordingSettings(str(path)), self.allocator.pools,
                                      clock=lambda: self.now[0])
        self.servicer = AllocatorServicer(self.allocator, recorder=self.recorder)
        self.lease = self.run(self.servicer.CreateLease(pb.CreateLeaseRequest(), None)).lease_id
        self.epochs = {pool_id: self.run(self.servicer.RegisterPool(pb.RegisterPoolRequest(
            pool_id=pool_id, num_blocks=16, block_size=BS, model_fingerprint="fp",
            executor_instance_id="i", enable_prefix_caching=True), None)).pool.epoch
            for pool_id in ("src", "p")}

    @staticmethod
    def run(coroutine: Any) -> Any:
        return asyncio.run(coroutine)

    def step(self, pool_id: str, **fields: Any) -> pb.StepResponse:
        self.now[0] += 0.5
        return self.run(self.servicer.Step(pb.StepRequest(
            pool_id=pool_id, epoch=self.epochs[pool_id], lease_id=self.lease, **fields), None))

    def hand_off(self, request_id: str) -> pb.ReserveHandOffResponse:
        self.now[0] += 0.5
        return self.run(self.servicer.ReserveHandOff(pb.ReserveHandOffRequest(
            pool_id="p", epoch=self.epochs["p"], lease_id=self.lease, request_id=request_id,
            token_ids=TOKENS, num_prompt_tokens=10, source_model_fingerprint="fp",
            source_block_size=BS, source_pool_id="src"), None))

    def records(self) -> list[dict[str, Any]]:
        self.recorder.flush()
        self.recorder.file.settle()
        return [json.loads(line) for line in Path(self.recorder.settings.path).read_text()
                .splitlines()]


def computed_at_the_source(d: Driver) -> None:
    """r's 10-token prompt and 3 decodes at the source, committed, then handed off to p and
    freed there; p's cache already holds its first block (another request's)."""
    d.step("src", items=[pb.StepItem(request_id="r", prompt_token_ids=TOKENS[:10],
                                     num_tokens=10)])
    for token in TOKENS[10:]:
        d.step("src", decode_request_ids=["r"], append_request_ids=["r"], append_token_ids=[token])
    d.step("p", items=[pb.StepItem(request_id="o", prompt_token_ids=TOKENS[:5], num_tokens=5)])
    d.step("p", commits=[pb.Commit(request_id="o", num_computed_tokens=5)],
           free_request_ids=["o"])
    assert d.hand_off("r").num_cached_tokens == 4
    d.step("src", commits=[pb.Commit(request_id="r", num_computed_tokens=13)],
           free_request_ids=["r"])


def test_hand_off_recording_is_a_record_the_replay_reads_and_replays(tmp_path: Path):
    # In p, r decodes twice and is freed with its commit: its end names 15 tokens and the
    # chain hashes of its three full blocks.
    path = tmp_path / "rec.jsonl"
    d = Driver(path)
    computed_at_the_source(d)
    d.step("p", decode_request_ids=["r"], append_request_ids=["r"], append_token_ids=[95])
    d.step("p", decode_request_ids=["r"], append_request_ids=["r"], append_token_ids=[96],
           commits=[pb.Commit(request_id="r", num_computed_tokens=14)])
    d.step("p", commits=[pb.Commit(request_id="r", num_computed_tokens=15)],
           free_request_ids=["r"])
    (record,) = [r for r in d.records() if r.get("k") == "handoff"]
    assert record == {"k": "handoff", "t": 3.5, "pool": "p", "id": "r", "num_tokens": 13,
                      "prompt": 10, "cached": 4}
    recording = read_recording(str(path))
    (request,) = [r for r in recording.pools["p"].requests if r.request_id == "r"]
    chain = hash_chain(root_hash("fp", ""), TOKENS + [95, 96], BS)
    assert (request.arrival_s, request.num_prompt_tokens, request.num_tokens) == (3.5, 13, 15)
    assert request.block_hashes == b"".join(h[:HASH_PREFIX_BYTES] for h in chain)
    assert recording.pools["p"].recorded.num_prefix_queries == 5  # o's prompt only
    assert recording.warnings == ("pool 'p': 1 request(s) handed off into it from another "
                                  "pool are replayed as prompts of the tokens they brought "
                                  "(computed here, not moved)",)
    for pool_id in ("p", "src"):
        workload = Workload.from_trace(recording.pools[pool_id])
        result = replay(workload, ReplayConfig(8, BS))
        assert result.completed and result.num_requests == len(workload.jobs)
    assert main([str(path), "--num-blocks", "8,100%"]) == 0


def test_hand_off_recording_live_at_the_stop_or_aborted_still_replays(tmp_path: Path):
    # r is aborted in p (its move failed), then reserved again and live at the stop.
    path = tmp_path / "rec.jsonl"
    d = Driver(path)
    computed_at_the_source(d)
    d.run(d.servicer.Abort(pb.AbortRequest(pool_id="p", epoch=d.epochs["p"], request_ids=["r"],
                                           lease_id=d.lease), None))
    d.hand_off("r")
    d.recorder.close()
    recording = read_recording(str(path))
    requests = [r for r in recording.pools["p"].requests if r.request_id == "r"]
    assert [(r.num_prompt_tokens, r.num_tokens, r.aborted) for r in requests] == [
        (13, 13, True), (13, 13, False)]
    assert recording.pools["p"].num_unfinished == 0
    assert replay(Workload.from_trace(recording.pools["p"]), ReplayConfig(8, BS)).completed


@pytest.mark.parametrize(("change", "message"), [
    ({"cached": 14}, "handoff record: cached must be in [0, num_tokens=13], got 14"),
    ({"prompt": -1}, "handoff record: prompt must be in [0, num_tokens=13], got -1"),
    ({"num_tokens": 0}, "handoff record: num_tokens must be >= 1, got 0"),
    ({"id": 7}, "handoff record: id must be str, got 7"),
    ({"pool": "q"}, "a handoff record for pool 'q', which no pool record before it registered"),
])
def test_hand_off_recording_a_bad_handoff_record_is_refused(tmp_path: Path, change: Any,
                                                            message: str):
    path = tmp_path / "rec.jsonl"
    Driver(path).records()
    good = {"k": "handoff", "t": 1.0, "pool": "p", "id": "r", "num_tokens": 13, "prompt": 10,
            "cached": 4}
    with path.open("a") as file:
        file.write(json.dumps({**good, **change}) + "\n")
    with pytest.raises(RecordingError) as info:
        read_recording(str(path))
    assert str(info.value) == f"{path}, line 4: {message}"
