"""Settings: flags, PAGEDKV_* environment variables, and validation messages."""

from __future__ import annotations

import pytest

from executor_svc.settings import DEFAULT_PORT, SettingsError, parse_bytes
from executor_svc.settings import parse_settings as parse_with_credentials


def parse_settings(argv: list[str]):
    """The flags under test, on an executor told to run without internal credentials."""
    return parse_with_credentials(["--insecure", *argv])


def test_settings_defaults_are_the_contract() -> None:
    # Port 50053, block 16, attention auto on CPU, the embedded real model, its own weights.
    settings = parse_settings([])
    assert (settings.port, settings.block_size, settings.backend, settings.device) == (
        DEFAULT_PORT,
        16,
        "auto",
        "cpu",
    )
    assert settings.model.endswith("models/smollm2-135m-instruct")
    assert settings.load_format == "auto"


def test_settings_environment_sets_default_and_flag_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    # PAGEDKV_BLOCK_SIZE=32 applies unless --block-size is given.
    monkeypatch.setenv("PAGEDKV_BLOCK_SIZE", "32")
    monkeypatch.setenv("PAGEDKV_KV_CACHE_MEMORY", "64MiB")
    assert parse_settings([]).block_size == 32
    assert parse_settings([]).kv_cache_memory == 64 * 2**20
    assert parse_settings(["--block-size", "8"]).block_size == 8


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--block-size", "12"], "--block-size must be a power of two"),
        (["--backend", "flashinfer"], "--backend flashinfer needs --device cuda"),
        (["--backend", "cpu", "--device", "cuda"], "--backend cpu runs on --device cpu"),
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be in"),
        (["--model", "/nonexistent"], "is not a directory"),
        (["--max-num-seqs", "0"], "--max-num-seqs must be positive"),
        (["--idle-release-s", "-1"], "--idle-release-s must be >= 0"),
        (["--pool-name", "p" * 257], "--pool-name must be at most 256 printable ASCII"),
        (["--pool-name", "bad\nname"], "--pool-name must be at most 256 printable ASCII"),
        (["--role", "sideways"], "--role must be one of prefill, decode, both"),
    ],
)
def test_settings_rejects_bad_values_with_a_remedy(argv: list[str], message: str) -> None:
    # Each bad value names its flag and what would work.
    with pytest.raises(SettingsError, match=message):
        parse_settings(argv)


def test_settings_role_defaults_to_both_and_takes_its_env_var(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    # --role (PAGEDKV_ROLE): both unless told prefill or decode; a bad env value is refused
    # like a bad flag, naming --role.
    assert parse_settings([]).role == "both"
    assert parse_settings(["--role", "prefill"]).role == "prefill"
    monkeypatch.setenv("PAGEDKV_ROLE", "decode")
    assert parse_settings([]).role == "decode"
    monkeypatch.setenv("PAGEDKV_ROLE", "Decode")
    with pytest.raises(SettingsError, match="--role must be one of prefill, decode, both"):
        parse_settings([])


def test_settings_parse_bytes_understands_units() -> None:
    # Plain bytes and binary units.
    assert parse_bytes("1024") == 1024
    assert parse_bytes("256MiB") == 256 * 2**20
    assert parse_bytes("1.5G") == 3 * 2**29


def test_settings_tune_malloc_is_on_by_default_and_takes_only_a_boolean(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert parse_settings([]).tune_malloc
    assert not parse_settings(["--tune-malloc", "false"]).tune_malloc
    with pytest.raises(SystemExit) as info:
        parse_settings(["--tune-malloc", "sometimes"])
    assert info.value.code == 2 and "--tune-malloc" in capsys.readouterr().err


def test_settings_metrics_port_defaults_off_any_and_validation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 9093 by default (given up with a warning when taken); a port set by flag or
    # environment is required; -1 is off, 0 any free port; out of range or the gRPC port:
    # an error naming the flag.
    monkeypatch.delenv("PAGEDKV_METRICS_PORT", raising=False)
    default = parse_settings([]).metrics
    assert (default.port, default.required, default.enabled) == (9093, False, True)
    explicit = parse_settings(["--metrics-port", "0", "--metrics-port-file", "/tmp/m"]).metrics
    assert (explicit.port, explicit.required, explicit.port_file) == (0, True, "/tmp/m")
    assert not parse_settings(["--metrics-port", "-1"]).metrics.enabled
    for argv, message in [
        (["--metrics-port", "70000"], "--metrics-port must be in -1..65535"),
        (["--metrics-port", "50053"], "--metrics-port 50053 is the gRPC --port too"),
    ]:
        with pytest.raises(SettingsError, match=message):
            parse_settings(argv)
    monkeypatch.setenv("PAGEDKV_METRICS_PORT", "9100")
    from_env = parse_settings([]).metrics
    assert (from_env.port, from_env.required) == (9100, True)
    monkeypatch.setenv("PAGEDKV_METRICS_PORT", "-5")
    with pytest.raises(SettingsError, match="--metrics-port must be in -1..65535"):
        parse_settings([])
