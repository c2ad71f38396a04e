"""Settings: flags, PAGEDKV_* environment variables, and validation messages."""

from __future__ import annotations

import pytest

from executor_svc.settings import DEFAULT_PORT, ExecutorSettings, SettingsError, parse_bytes
from executor_svc.settings import parse_settings as parse_with_credentials


def parse_settings(argv: list[str]):
    """The flags under test, on an executor told to run without internal credentials."""
    return parse_with_credentials(["--insecure", *argv])


def refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The usage error (exit 2) that `argv` stops the executor with."""
    with pytest.raises(SystemExit) as info:
        parse_settings(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2, err
    return err.splitlines()[-1]


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
        (["--role", "sideways"], "--role must be one of prefill, decode, both, not 'sideways'"),
        (["--dtype", "int8"], "--dtype must be one of auto, float32, bfloat16, float16"),
        (["--kv-cache-memory", "0"], "--kv-cache-memory must be positive, e.g. 256MiB"),
    ],
)
def test_settings_rejects_bad_values_with_a_remedy(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Each bad value names its flag and what would work, as a usage error.
    assert message in refused(argv, capsys)


@pytest.mark.parametrize(("values", "message"), [
    ({"block_size": 12}, "--block-size must be a power of two, e.g. 16, not 12"),
    ({"role": "sideways"}, "--role must be one of prefill, decode, both, not 'sideways'"),
    ({"gpu_memory_utilization": float("nan")}, "--gpu-memory-utilization must be in (0, 1]"),
    ({"backend": "flashinfer"}, "--backend flashinfer needs --device cuda"),
])
def test_settings_made_in_process_are_checked_as_flags_are(
    values: dict[str, object], message: str
) -> None:
    with pytest.raises(SettingsError) as info:
        ExecutorSettings(**values)  # type: ignore[arg-type]
    assert message in str(info.value)


def test_settings_role_defaults_to_both_and_takes_its_env_var(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # --role (PAGEDKV_ROLE): both unless told prefill or decode; a bad env value is refused
    # like a bad flag, naming --role.
    assert parse_settings([]).role == "both"
    assert parse_settings(["--role", "prefill"]).role == "prefill"
    monkeypatch.setenv("PAGEDKV_ROLE", "decode")
    assert parse_settings([]).role == "decode"
    monkeypatch.setenv("PAGEDKV_ROLE", "Decode")
    assert "PAGEDKV_ROLE='Decode': must be one of prefill, decode, both" in refused([], capsys)


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
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
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
        assert message in refused(argv, capsys)
    monkeypatch.setenv("PAGEDKV_METRICS_PORT", "9100")
    from_env = parse_settings([]).metrics
    assert (from_env.port, from_env.required) == (9100, True)
    monkeypatch.setenv("PAGEDKV_METRICS_PORT", "-5")
    assert "--metrics-port must be in -1..65535" in refused([], capsys)
