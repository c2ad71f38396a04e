"""Gateway flags: a wrong value stops the process with a message naming the flag."""

from __future__ import annotations

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


@pytest.mark.parametrize(("flag", "attr"), [("--pipeline-steps", "pipeline_steps"),
                                           ("--launch-ahead", "launch_ahead")])
def test_step_order_flags_are_on_by_default_and_take_only_a_boolean(
    capsys: pytest.CaptureFixture[str], flag: str, attr: str
):
    assert getattr(load_settings([]), attr)
    assert not getattr(load_settings([flag, "false"]), attr)
    with pytest.raises(SystemExit) as info:
        load_settings([flag, "sometimes"])
    assert info.value.code == 2 and flag in capsys.readouterr().err
