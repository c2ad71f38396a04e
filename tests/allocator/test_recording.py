"""The allocation recorder (--record-allocations): what it writes for each call, the bound, an
I/O error (recording stops, serving does not), a restart appending a segment, its flags, and a
real allocator recording until SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest
import structlog

from allocator_svc.core.allocator import Allocator, Limits
from allocator_svc.recording import HASH_PREFIX_BYTES, Recorder, RecordingSettings
from allocator_svc.service import AllocatorServicer
from allocator_svc.settings import parse_settings
from common.block_hash import hash_chain, root_hash
from common.errors import NotFound
from pagedkv.allocator.v1 import allocator_pb2 as pb
from pagedkv.allocator.v1 import allocator_pb2_grpc
from tests.allocator.conftest import ALLOCATOR_ENV, AUTH, REPO_ROOT, start_allocator, stop_process
from tools.replay.trace import read_recording

BS = 4


class Driver:
    """A servicer with a recorder, called in process (the handlers are plain coroutines)."""

    def __init__(self, path: Path, **settings: Any) -> None:
        self.allocator = Allocator(Limits())
        self.now = [0.0]
        self.recorder = Recorder.open(RecordingSettings(str(path), **settings),
                                      self.allocator.pools, clock=lambda: self.now[0])
        self.servicer = AllocatorServicer(self.allocator, recorder=self.recorder)
        self.lease = self.run(self.servicer.CreateLease(pb.CreateLeaseRequest(), None)).lease_id
        self.epoch = self.run(self.servicer.RegisterPool(pb.RegisterPoolRequest(
            pool_id="p", num_blocks=16, block_size=BS, model_fingerprint="fp",
            executor_instance_id="i", enable_prefix_caching=True), None)).pool.epoch

    @staticmethod
    def run(coroutine: Any) -> Any:
        return asyncio.run(coroutine)

    def step(self, **fields: Any) -> pb.StepResponse:
        self.now[0] += 0.5
        return self.run(self.servicer.Step(pb.StepRequest(
            pool_id="p", epoch=self.epoch, lease_id=self.lease, **fields), None))

    def records(self) -> list[dict[str, Any]]:
        self.recorder.flush()
        self.recorder.file.settle()
        return [json.loads(line) for line in Path(self.recorder.settings.path).read_text()
                .splitlines()]


def new(request_id: str, prompt: list[int]) -> pb.StepItem:
    return pb.StepItem(request_id=request_id, prompt_token_ids=prompt, num_tokens=len(prompt))


def test_recording_writes_each_call_as_its_workload(tmp_path: Path) -> None:
    # a (9 tokens) is admitted, decodes twice, and is freed with a commit; b hits its first two
    # blocks and is aborted: admissions, a decode-only step's short line, ends with hashes.
    d = Driver(tmp_path / "rec.jsonl")
    d.step(items=[new("a", list(range(9)))])
    d.step(decode_request_ids=["a"], append_request_ids=["a"], append_token_ids=[50])
    d.step(decode_request_ids=["a"], append_request_ids=["a"], append_token_ids=[51],
           commits=[pb.Commit(request_id="a", num_computed_tokens=10)])
    d.step(free_request_ids=["a"], commits=[pb.Commit(request_id="a", num_computed_tokens=11)],
           items=[new("b", list(range(8)) + [70, 71])])
    d.run(d.servicer.Abort(pb.AbortRequest(pool_id="p", epoch=d.epoch, request_ids=["b"],
                                           lease_id=d.lease), None))
    header, pool, *steps, free = d.records()
    assert header["format"] == "pagedkv-allocations" and header["version"] == 1
    assert header["token_ids"] is False and header["hash_prefix_bytes"] == HASH_PREFIX_BYTES
    assert pool == {"k": "pool", "t": 0.0, "pool": "p", "num_blocks": 16, "block_size": BS,
                    "num_cpu_blocks": 0, "prefix_caching": True, "reset": False}
    assert steps[0] == {"k": "step", "t": 0.5, "pool": "p", "rows": 1, "used": 3,
                        "tokens": 9, "admit": [["a", 9, 0, 0]]}
    assert steps[1] == {"k": "step", "t": 1.0, "pool": "p", "rows": 1, "used": 3}
    chain = hash_chain(root_hash("fp", ""), [*range(9), 50, 51], BS)
    a_hashes = b"".join(h[:HASH_PREFIX_BYTES] for h in chain).hex()
    assert steps[3]["end"] == [["a", "f", 11, a_hashes]]
    assert steps[3]["admit"] == [["b", 10, 8, 0]]  # two cached blocks
    assert steps[3]["tokens"] == 2  # the rest of b's prompt
    assert free["k"] == "free" and free["end"][0][:3] == ["b", "a", 10]
    assert free["end"][0][3] == a_hashes[: 2 * 2 * HASH_PREFIX_BYTES]  # its cached prefix only


def test_recording_token_ids_only_when_asked(tmp_path: Path) -> None:
    # The same free with --record-token-ids carries the request's token ids.
    d = Driver(tmp_path / "rec.jsonl", token_ids=True)
    d.step(items=[new("a", [5, 6, 7])])
    d.step(free_request_ids=["a"])
    records = d.records()
    assert records[0]["token_ids"] is True
    assert records[-1]["end"] == [["a", "f", 3, "", [5, 6, 7]]]


def test_recording_a_refused_call_records_nothing(tmp_path: Path) -> None:
    # A Step the core refuses (unknown request) changes nothing, and writes nothing.
    d = Driver(tmp_path / "rec.jsonl")
    before = len(d.records())
    with pytest.raises(NotFound):
        d.step(free_request_ids=["ghost"])
    assert len(d.records()) == before


def test_recording_stops_at_its_bound_and_serving_goes_on(tmp_path: Path) -> None:
    # At --record-max-bytes the recording ends with a stop record naming the live requests;
    # later steps are served and not written; the file replays.
    path = tmp_path / "rec.jsonl"
    d = Driver(path, max_bytes=700)
    d.step(items=[new("a", list(range(9)))])
    with structlog.testing.capture_logs() as logs:
        for token in range(20):
            d.step(decode_request_ids=["a"], append_request_ids=["a"], append_token_ids=[token])
    assert not d.recorder.active
    assert [e["reason"] for e in logs if e["event"] == "allocation_recording_stopped"] == [
        "max_bytes"]
    d.recorder.file.settle()  # (serving, the stop does not wait for the writer)
    stop = json.loads(path.read_text().splitlines()[-1])
    assert stop["k"] == "stop" and stop["reason"] == "max_bytes"
    assert stop["live"][0][0] == "p" and stop["live"][0][1][:2] == ["a", "l"]
    size = path.stat().st_size
    assert size - len(json.dumps(stop, separators=(",", ":"))) - 1 <= 700
    # Still served:
    d.step(decode_request_ids=["a"], append_request_ids=["a"], append_token_ids=[99])
    assert path.stat().st_size == size
    (request,) = read_recording(str(path)).pools["p"].requests
    assert request.request_id == "a" and request.num_prompt_tokens == 9


class FullDisk:
    def write(self, data: bytes) -> int:
        raise OSError(28, "No space left on device")

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_recording_io_error_stops_recording_not_serving(tmp_path: Path) -> None:
    # A write that fails (in the writer thread) stops the recording with one log line at the
    # next flush; the calls go on.
    d = Driver(tmp_path / "rec.jsonl")
    d.recorder.file.settle()
    d.recorder.file.file.close()
    d.recorder.file.file = FullDisk()  # type: ignore[assignment]
    d.step(items=[new("a", [1, 2, 3])])
    d.recorder.file.flush()
    d.recorder.file.settle()
    with structlog.testing.capture_logs() as logs:
        d.recorder.flush()
        d.step(decode_request_ids=["a"], append_request_ids=["a"], append_token_ids=[4])
    assert not d.recorder.active
    assert [(e["event"], e["reason"], e["detail"]) for e in logs] == [
        ("allocation_recording_stopped", "io_error",
         "io_error: [Errno 28] No space left on device")]
    response = d.step(decode_request_ids=["a"], append_request_ids=["a"], append_token_ids=[5])
    assert response.num_free_blocks == 14  # a: 5 tokens, 2 blocks
    d.recorder.close()  # nothing left to close: harmless


def test_recording_after_a_restart_appends_a_segment(tmp_path: Path) -> None:
    # An allocator killed mid-write leaves a cut line; the next one ends it and appends its
    # own header; the replay reads both segments, skipping the cut line with a warning.
    path = tmp_path / "rec.jsonl"
    d = Driver(path)
    d.step(items=[new("a", [1, 2, 3])])
    d.step(free_request_ids=["a"])
    d.recorder.flush()
    d.recorder.file.settle()
    with path.open("a") as file:
        file.write('{"k":"step","t":9.0,"po')
    again = Driver(path)
    again.step(items=[new("b", [1, 2, 3, 4, 5])])
    again.recorder.close()
    lines = path.read_text().splitlines()
    assert lines[-5] == '{"k":"step","t":9.0,"po' and json.loads(lines[-4])["format"]
    recording = read_recording(str(path))
    assert [r.request_id for r in recording.pools["p"].requests] == ["a", "b"]
    assert recording.warnings == (f"line {len(lines) - 4}: a record cut short (the allocator "
                                  "stopped mid-write) was skipped",)


@pytest.mark.parametrize(("argv", "message"), [
    (["--record-token-ids"], "--record-token-ids needs --record-allocations PATH"),
    (["--record-allocations", "x", "--record-max-bytes", "100"],
     "--record-max-bytes must be >= 4096"),
])
def test_recording_bad_flags_are_usage_errors(argv: list[str], message: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse_settings(["--insecure", *argv])
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_recording_flags_reach_the_settings() -> None:
    assert parse_settings(["--insecure"]).recording is None
    recording = parse_settings(["--insecure", "--record-allocations", "r.jsonl",
                                "--record-token-ids", "--record-max-bytes", "65536"]).recording
    assert recording == RecordingSettings("r.jsonl", True, 65536)
    sharded = parse_settings(["--insecure", "--record-allocations", "r.jsonl", "--num-shards",
                              "2", "--shard-index", "1"]).recording
    assert sharded is not None and sharded.path == "r.jsonl.shard1"  # one file per shard


@pytest.mark.e2e  # (a Python subprocess)
def test_recording_an_unwritable_path_stops_the_start(tmp_path: Path) -> None:
    path = tmp_path / "missing" / "rec.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "allocator_svc", "--port", "0", "--metrics-port", "-1",
         "--record-allocations", str(path)],
        cwd=REPO_ROOT, env={**os.environ, **ALLOCATOR_ENV},
        capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert f"--record-allocations {path}: cannot append to it" in done.stdout + done.stderr


@pytest.mark.e2e  # (a Python subprocess)
def test_recording_a_real_allocator_until_sigterm(tmp_path: Path) -> None:
    # Over gRPC: the calls are recorded; SIGTERM flushes the buffer and writes the stop record
    # with the requests still held.
    path = tmp_path / "rec.jsonl"
    server = start_allocator(tmp_path, "--record-allocations", str(path), "--metrics-port",
                             "-1", "--verify-pool-resets", "false")
    try:
        with AUTH.channel(server.address) as channel:
            stub = allocator_pb2_grpc.AllocatorServiceStub(channel)
            lease = stub.CreateLease(pb.CreateLeaseRequest()).lease_id
            pool = stub.RegisterPool(pb.RegisterPoolRequest(
                pool_id="p", num_blocks=8, block_size=BS, model_fingerprint="fp",
                executor_instance_id="i", enable_prefix_caching=True)).pool
            stub.Step(pb.StepRequest(pool_id="p", epoch=pool.epoch, lease_id=lease,
                                     items=[new("a", [1, 2, 3, 4, 5])]))
            with pytest.raises(grpc.RpcError):  # refused: not recorded
                stub.Step(pb.StepRequest(pool_id="p", epoch=pool.epoch, lease_id=lease,
                                         free_request_ids=["ghost"]))
    finally:
        assert stop_process(server) == 0
    kinds = [json.loads(line).get("k", "header") for line in path.read_text().splitlines()]
    assert kinds == ["header", "pool", "step", "stop"]
    stop = json.loads(path.read_text().splitlines()[-1])
    assert stop["reason"] == "shutdown" and stop["live"][0][1][:3] == ["a", "l", 5]
