"""Gateway flags: a wrong value stops the process with a message naming the flag."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.settings import load_settings as load_with_credentials


def load_settings(argv: list[str]):
    """The flags under test, on a gateway told to run without internal credentials."""
    return load_with_credentials(["--insecure", *argv])


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
        (["--allocator-retry-s", "0"], "--allocator-retry-s"),
        (["--max-num-seqs", "0"], "--max-num-seqs"),
        (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens"),
        (["--lease-ttl-ms", "100"], "--lease-ttl-ms"),
        (["--max-model-len", "1"], "--max-model-len"),
        (["--executor-addrs", " , "], "--executor-addrs"),
        (["--public-tls-cert", "cert.pem"], "--public-tls-cert and --public-tls-key"),
        (["--tenant-max-requests", "-1"], "--tenant-max-requests"),
        (["--tenant-max-running", "-1"], "--tenant-max-running"),
        (["--max-prompt-bytes", "0"], "--max-prompt-bytes"),
        (["--http-port", "70000"], "--http-port"),
        (["--http-port", "-2"], "--http-port"),
        (["--nice", "20"], "--nice must be in 0..19"),
        (["--nice", "-1"], "--nice must be in 0..19"),
        (["--max-sse-buffer", "0"], "--max-sse-buffer"),
        (["--executor-dns", "executor"], "--executor-dns"),
        (["--executor-dns", "e:1", "--executor-addrs-file", "f"], "give one of them"),
        (["--discovery-interval-s", "0"], "--discovery-interval-s"),
        (["--rebalance-min-gap", "-1"], "--rebalance-min-gap must be >= 0"),
        (["--allocator-addr", " , "], "--allocator-addr is empty"),
        (["--allocator-addr", "a:1,b"], "--allocator-addr 'b': expected host:port"),
        (["--allocator-addr", "a:1,b:2,a:1"], "lists a shard twice"),
        (["--shutdown-grace-s", "-1"], "--shutdown-grace-s"),
        (["--shutdown-grace-s", "inf"], "--shutdown-grace-s"),
        (["--public-tls-cert", "/nonexistent.pem", "--public-tls-key", "/nonexistent.pem"],
         "--public-tls-cert"),
    ],
)
def test_a_wrong_flag_stops_with_a_message_naming_it(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
):
    with pytest.raises(SystemExit) as info:
        load_settings(argv)
    (error,) = capsys.readouterr().err.splitlines()  # one line, no usage: the flag parsed
    assert info.value.code == 2
    assert error.startswith("python -m gateway: error: ") and flag in error


def test_an_unknown_preemption_mode_is_refused_by_the_parser(capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as info:
        load_settings(["--preemption-mode", "drop"])
    assert info.value.code == 2 and "--preemption-mode" in capsys.readouterr().err


def test_an_unknown_admission_order_is_refused_by_the_parser(
        capsys: pytest.CaptureFixture[str]):
    assert load_settings([]).admission_order == "fcfs"
    assert load_settings(["--admission-order", "fair-share"]).admission_order == "fair-share"
    with pytest.raises(SystemExit) as info:
        load_settings(["--admission-order", "fair"])
    assert info.value.code == 2
    assert "--admission-order must be one of fcfs, fair-share, not 'fair'" in (
        capsys.readouterr().err)


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


def test_a_step_log_that_cannot_be_written_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        load_settings(["--step-log", str(tmp_path / "missing-dir" / "steps.jsonl")])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "error: --step-log " in err and "cannot append" in err


def test_without_internal_credentials_the_gateway_refuses_to_start(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.delenv("PAGEDKV_ROLE_TOKEN", raising=False)
    with pytest.raises(SystemExit) as info:
        load_with_credentials([])
    assert info.value.code == 2 and "no internal credentials" in capsys.readouterr().err


def test_credentials_come_from_a_token_file_the_environment_or_tls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
):
    token_file = tmp_path / "token"
    token_file.write_text("a-token-of-enough-characters\n")
    settings = load_with_credentials(["--role-token-file", str(token_file)])
    # The gateway is a client of the internal services only: its own token, no digests.
    assert settings.internal_auth.token == "a-token-of-enough-characters"
    assert settings.internal_auth.callers == ()
    monkeypatch.setenv("PAGEDKV_ROLE_TOKEN", "another-token-from-the-env")
    assert load_with_credentials([]).internal_auth.token == "another-token-from-the-env"
    monkeypatch.setenv("PAGEDKV_ROLE_TOKEN", "short")
    with pytest.raises(SystemExit):
        load_with_credentials([])
    assert "the role token has 5 characters; use at least 16" in capsys.readouterr().err
    monkeypatch.delenv("PAGEDKV_ROLE_TOKEN")
    for argv, message in [
        (["--tls-cert", "c.pem"], "mutual TLS needs all three of"),
        (["--tls-cert", "c", "--tls-key", "k", "--tls-ca", "ca"], "cannot read TLS file c"),
        (["--role-token-file", str(tmp_path / "absent")], "cannot read it"),
        (["--internal-token-file", str(token_file)], "the shared internal token is gone"),
    ]:
        with pytest.raises(SystemExit) as info:
            load_with_credentials(argv)
        assert info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(("name", "value", "message"), [
    ("PAGEDKV_PORT", "abc", "environment variable PAGEDKV_PORT='abc': invalid literal"),
    ("PAGEDKV_ENABLE_PREFIX_CACHING", "maybe", "expected true or false, got 'maybe'"),
    ("PAGEDKV_LOG_JSON", "perhaps", "expected true or false, got 'perhaps'"),
    ("PAGEDKV_PREEMPTION_MODE", "drop", "PAGEDKV_PREEMPTION_MODE='drop': must be one of "
     "recompute, swap"),
    ("PAGEDKV_MAX_NUM_SEQS", "0", "PAGEDKV_MAX_NUM_SEQS='0': must be >= 1"),
])
def test_a_bad_environment_value_is_a_usage_error_naming_it(
    name: str, value: str, message: str, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
):
    monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as info:
        load_settings([])
    err = capsys.readouterr().err
    assert info.value.code == 2 and message in err and "usage:" in err


def test_http_api_defaults():
    settings = load_settings([])
    assert (settings.http_port, settings.max_sse_buffer, settings.served_model_name) == (
        8000, 256, "")
    assert load_settings(["--http-port", "-1"]).http_port == -1  # no HTTP API


def test_a_flag_given_wins_over_a_bad_environment_value(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
):
    # The variable is only the default: given the flag, its bad value is never used.
    monkeypatch.setenv("PAGEDKV_MAX_MODEL_LEN", "1")
    assert load_settings(["--max-model-len", "50"]).max_model_len == 50
    assert load_settings(["--max-model-len=60"]).max_model_len == 60
    with pytest.raises(SystemExit):
        load_settings([])
    assert "PAGEDKV_MAX_MODEL_LEN='1': must be >= 2" in capsys.readouterr().err
