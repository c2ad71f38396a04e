"""Bad input to the replay: a corrupt or cut recording, a record naming an unknown pool, a block
size that is not positive, a pool too small for one request. Each gets a precise message and
exit status; the recording is not changed, and no output is written, not even half of one."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from tools.replay.__main__ import main
from tools.replay.records import RecordingError
from tools.replay.trace import read_recording

HEADER = {"format": "pagedkv-allocations", "version": 1, "created_unix": 0.0,
          "hash_profile": "pagedkv-block-hash-v1", "hash_prefix_bytes": 8, "token_ids": False}
POOL = {"k": "pool", "t": 0.0, "pool": "p", "num_blocks": 16, "block_size": 4,
        "num_cpu_blocks": 0, "prefix_caching": True, "reset": False}
HASHES = "00112233445566778899aabbccddeeff"  # two blocks


def records(**changes: Any) -> list[dict[str, Any]]:
    """A good recording: a (9 prompt tokens) decodes twice and is freed at 11."""
    steps = [
        {"k": "step", "t": 0.1, "pool": "p", "rows": 1, "used": 3, "admit": [["a", 9, 0, 0]]},
        {"k": "step", "t": 0.2, "pool": "p", "rows": 1, "used": 3},
        {"k": "step", "t": 0.3, "pool": "p", "rows": 1, "used": 3,
         "end": [["a", "f", 11, HASHES]]},
    ]
    return [{**HEADER, **changes.get("header", {})}, {**POOL, **changes.get("pool", {})}, *steps]


def write(path: Path, lines: list[Any]) -> Path:
    path.write_text("".join((json.dumps(x) if isinstance(x, dict) else x) + "\n"
                            for x in lines))
    return path


def expect_error(path: Path, message: str) -> None:
    with pytest.raises(RecordingError) as info:
        read_recording(str(path))
    assert str(info.value) == f"{path}, {message}"


def test_replay_bad_input_a_good_recording_reads(tmp_path: Path) -> None:
    recording = read_recording(str(write(tmp_path / "r", records())))
    (request,) = recording.pools["p"].requests
    assert (request.num_prompt_tokens, request.num_tokens, request.num_hashed_blocks) == (9, 11, 2)
    assert recording.warnings == ()


@pytest.mark.parametrize(("lines", "message"), [
    (["not json at all"], "line 1: not a pagedkv allocation recording: expected a header "
     '{"format": "pagedkv-allocations", "version": 1, ...}'),
    ([{"format": "something-else", "version": 1}], "line 1: not a pagedkv allocation "
     'recording: expected a header {"format": "pagedkv-allocations", "version": 1, ...}'),
    (records(header={"version": 2}), "line 1: recording format version 2: this replay reads "
     "version 1 (replay it with the pagedkv that wrote it)"),
    (records(header={"token_ids": "no"}), "line 1: header record: token_ids must be bool, "
     "got 'no'"),
    (records(pool={"block_size": 0}), "line 2: pool record: block_size must be a positive "
     "integer, got 0"),
    (records(pool={"num_blocks": -3}), "line 2: pool record: num_blocks must be a positive "
     "integer, got -3"),
    ([*records()[:3], '{"k": "step", "t": 0.2, "po', *records()[3:]],
     "line 4: not a JSON record (not JSON), and not the last line of a segment"),
    ([*records()[:2], {"k": "step", "t": 0.1, "pool": "q", "rows": 1, "used": 0}],
     "line 3: a step record for pool 'q', which no pool record before it registered"),
    ([*records()[:2], {"k": "teleport", "t": 0.1}], "line 3: unknown record kind 'teleport'"),
    ([*records()[:4], {"k": "step", "t": 0.05, "pool": "p", "rows": 1, "used": 3}],
     "line 5: t=0.05 goes back in time (the record before: 0.2)"),
    ([*records()[:4], {"k": "step", "t": 0.3, "pool": "p", "rows": 1, "used": 3,
                       "end": [["a", "f", 7, HASHES[:16]]]}],
     "line 5: 'a' ends with 7 tokens, fewer than the 9 it was admitted with"),
    ([*records()[:4], {"k": "step", "t": 0.3, "pool": "p", "rows": 1, "used": 3,
                       "end": [["a", "f", 11, HASHES * 2]]}],
     "line 5: end entry of 'a': 4 hashes for 11 tokens at block size 4"),
    ([*records()[:4], {"k": "step", "t": 0.3, "pool": "p", "rows": 1, "used": 3,
                       "end": [["a", "f", 11, "zz" * 8]]}],
     "line 5: end entry of 'a': hashes are not hex"),
    ([*records()[:2], {"k": "step", "t": 0.1, "pool": "p", "rows": 1, "used": 3,
                       "admit": [["a", 9, 12, 0]]}],
     "line 3: an admission must be [id, prompt tokens, cached tokens <= prompt tokens, "
     "resumed 0 or 1], got ['a', 9, 12, 0]"),
])
def test_replay_bad_input_a_corrupt_recording_names_its_line(
        tmp_path: Path, lines: list[Any], message: str) -> None:
    expect_error(write(tmp_path / "r", lines), message)


def test_replay_bad_input_an_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "r"
    path.write_text("")
    with pytest.raises(RecordingError, match="empty: not a pagedkv allocation recording"):
        read_recording(str(path))


def test_replay_bad_input_gzip_reads_and_a_truncated_one_fails(tmp_path: Path) -> None:
    # A compressed recording reads as the plain one; cut short, it is refused by name.
    plain = write(tmp_path / "r", records())
    packed = tmp_path / "r.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    assert read_recording(str(packed)).pools["p"].requests[0].num_tokens == 11
    cut = tmp_path / "cut.gz"
    cut.write_bytes(packed.read_bytes()[:-12])
    with pytest.raises(RecordingError, match=f"{cut}: cannot read it .*end-of-stream"):
        read_recording(str(cut))


def test_replay_bad_input_a_cut_last_line_is_skipped_with_a_warning(tmp_path: Path) -> None:
    # An allocator killed mid-write: the records before the cut still replay.
    path = write(tmp_path / "r", records())
    with path.open("a") as file:
        file.write('{"k": "step", "t": 0.4, "pool": "p", "ro')
    recording = read_recording(str(path))
    assert len(recording.pools["p"].requests) == 1
    assert recording.warnings == ("line 6: the last record was cut short (the allocator "
                                  "stopped mid-write) and was skipped",)


def test_replay_bad_input_the_cli_exit_status_and_no_output(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A corrupt recording: status 1, the message, the file untouched, no --json output.
    bad = write(tmp_path / "bad", [*records()[:2], "garbage", *records()[2:]])
    before = bad.read_bytes()
    out = tmp_path / "out.json"
    assert main([str(bad), "--json", str(out)]) == 1
    assert capsys.readouterr().err == (f"error: {bad}, line 3: not a JSON record (not JSON), "
                                       "and not the last line of a segment\n")
    assert bad.read_bytes() == before and not out.exists()
    # A pool too small for its largest request, after a replay that ran: status 2, the
    # message, and still no output (nothing half-written; no temporary file left).
    good = write(tmp_path / "good", records())
    assert main([str(good), "--num-blocks", "100%,2", "--json", str(out)]) == 2
    assert capsys.readouterr().err == (
        "error: num_blocks=2 at block size 4 cannot hold request 'a' alone: its 11 tokens "
        "need 3 blocks; use --num-blocks 3 or more\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad", "good"]
    # An unknown pool.
    assert main([str(good), "--pool", "q"]) == 2
    assert capsys.readouterr().err == f"error: no pool 'q' in {good} (it has: p)\n"
    # Good: the table and the output, whole.
    assert main([str(good), "--num-blocks", "3,100%", "--json", str(out)]) == 0
    assert "| p | replay | 3 | 4 | recompute | 1 |" in capsys.readouterr().out
    assert [r["config"]["num_blocks"] for r in
            json.loads(out.read_text())["pools"]["p"]["replays"]] == [3, 16]


@pytest.mark.parametrize(("argv", "message"), [
    (["--block-size", "0"], "argument --block-size: 0 is not a positive integer"),
    (["--block-size", "16,-4"], "argument --block-size: -4 is not a positive integer"),
    (["--block-size", "sixteen"], "argument --block-size: 'sixteen' is not an integer"),
    (["--num-blocks", "0"], "argument --num-blocks: 0 is not a positive integer"),
    (["--num-blocks=-5%"], "argument --num-blocks: -5% is not a positive percentage"),
    (["--preemption-mode", "drop"], "argument --preemption-mode: invalid choice: 'drop'"),
    (["--preemption-policy", "fair"], "argument --preemption-policy: invalid choice: 'fair'"),
    (["--step-ms", "0"], "--step-ms must be > 0"),
])
def test_replay_bad_input_bad_flags_are_usage_errors(
        tmp_path: Path, argv: list[str], message: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    good = write(tmp_path / "good", records())
    with pytest.raises(SystemExit) as info:
        main([str(good), *argv])
    assert info.value.code == 2 and message in capsys.readouterr().err
