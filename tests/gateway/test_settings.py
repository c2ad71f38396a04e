"""Gateway flags: a wrong value stops the process with a message naming the flag."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.settings import load_settings


def test_defaults_are_sensible():
    settings = load_settings([])
    assert (settings.allocator_timeout_s, settings.execute_timeout_s) == (10.0, 60.0)
    assert settings.max_num_seqs >= 1 and settings.lease_ttl_ms >= 300


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--allocator-timeout-s", "0"], "--allocator-timeout-s"),
        (["--allocator-timeout-s", "-1"], "--allocator-timeout-s"),
        (["--execute-timeout-s", "0"], "--execute-timeout-s"),
        (["--max-num-seqs", "0"], "--max-num-seqs"),
        (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens"),
        (["--lease-ttl-ms", "100"], "--lease-ttl-ms"),
        (["--max-model-len", "1"], "--max-model-len"),
        (["--executor-addrs", " , "], "--executor-addrs"),
    ],
)
def test_a_wrong_flag_stops_with_a_message_naming_it(argv: list[str], flag: str):
    with pytest.raises(SystemExit) as info:
        load_settings(argv)
    assert str(info.value).startswith("gateway: ") and flag in str(info.value)


def test_an_unknown_preemption_mode_is_refused_by_the_parser(capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as info:
        load_settings(["--preemption-mode", "drop"])
    assert info.value.code == 2 and "--preemption-mode" in capsys.readouterr().err


def test_async_depth_is_two_by_default_and_takes_one_or_two(capsys: pytest.CaptureFixture[str]):
    assert load_settings([]).async_depth == 2
    assert load_settings(["--async-depth", "1"]).async_depth == 1
    for wrong in ("3", "0", "deep"):
        with pytest.raises(SystemExit) as info:
            load_settings(["--async-depth", wrong])
        assert info.value.code == 2 and "--async-depth" in capsys.readouterr().err


def test_step_log_is_off_by_default_and_names_a_file():
    assert load_settings([]).step_log == ""
    assert load_settings(["--step-log", "/tmp/steps.jsonl"]).step_log == "/tmp/steps.jsonl"


def test_a_step_log_that_cannot_be_written_is_refused_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as info:
        load_settings(["--step-log", str(tmp_path / "missing-dir" / "steps.jsonl")])
    assert str(info.value).startswith("gateway: --step-log ") and "cannot append" in str(
        info.value)
