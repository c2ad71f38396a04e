"""Allocator flags: a value that cannot work stops it with a usage error naming the flag;
without internal credentials it refuses to start unless told --insecure."""

from __future__ import annotations

import pytest

from allocator_svc.settings import parse_settings
from common.credentials import (
    CALLER_DIGESTS_ENV,
    LEGACY_TOKEN_ENV,
    ROLE_TOKEN_ENV,
    RoleTokens,
)


@pytest.mark.parametrize(("argv", "message"), [
    (["--max-blocks-per-tenant", "-1"], "--max-blocks-per-tenant must be >= 0"),
    (["--max-pools", "0"], "--max-pools must be >= 1"),
    (["--max-lease-ttl-ms", "0"], "--max-lease-ttl-ms must be >= 1"),
    (["--default-lease-ttl-ms", "700000"], "--default-lease-ttl-ms must be <= --max-lease-ttl"),
    (["--port", "70000"], "--port must be in 0..65535"),
    (["--nice", "20"], "--nice must be in 0..19, not 20"),
    (["--nice", "-5"], "--nice must be in 0..19, not -5"),
    (["--metrics-port", "70000"], "--metrics-port must be in -1..65535 (0: any free port, "
                                  "-1: off), not 70000"),
    (["--metrics-port", "-2"], "--metrics-port must be in -1..65535"),
    (["--metrics-port", "50052"], "--metrics-port 50052 is the gRPC --port too"),
    (["--metrics-port", "nine"], "argument --metrics-port: invalid int value: 'nine'"),
    (["--verify-pool-resets", "maybe"], "--verify-pool-resets"),
    (["--num-shards", "0"], "--num-shards must be in 1..256"),
    (["--num-shards", "2", "--shard-index", "2"], "--shard-index must be in 0..1"),
    (["--shard-index", "-1"], "--shard-index must be in 0..0"),
    (["--prefill-service-weight", "0"], "--prefill-service-weight must be in (0, 1000]"),
    (["--decode-service-weight", "1e9"], "--decode-service-weight must be in (0, 1000]"),
    (["--preemption-policy", "cheapest"],
     "--preemption-policy must be one of tail, cost, not 'cheapest'"),
])
def test_a_bad_flag_is_a_usage_error_naming_it(argv: list[str], message: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse_settings(["--insecure", *argv])
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_credentials_are_required_and_bounds_reach_the_limits(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in (ROLE_TOKEN_ENV, CALLER_DIGESTS_ENV, LEGACY_TOKEN_ENV):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit) as info:
        parse_settings([])
    assert info.value.code == 2 and "no internal credentials" in capsys.readouterr().err
    tokens = RoleTokens.new()
    for name, value in tokens.env("allocator").items():
        monkeypatch.setenv(name, value)
    settings = parse_settings(["--max-blocks-per-tenant", "64", "--max-lease-ttl-ms", "60000"])
    assert settings.auth.token == tokens.token("allocator")
    assert {role for _, role in settings.auth.callers} == {"gateway", "allocator", "executor"}
    assert (settings.limits.max_blocks_per_tenant, settings.limits.max_lease_ttl_s) == (64, 60.0)
    assert settings.host == "127.0.0.1"


def test_metrics_port_default_is_best_effort_and_a_port_asked_for_is_required(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # 9092 unless told; by flag or environment variable it must be bound (common.metrics).
    monkeypatch.delenv("PAGEDKV_METRICS_PORT", raising=False)
    default = parse_settings(["--insecure"]).metrics
    assert (default.port, default.required, default.port_file) == (9092, False, None)
    flag = parse_settings(["--insecure", "--metrics-port", "0", "--metrics-port-file", "f"])
    assert (flag.metrics.port, flag.metrics.required, flag.metrics.port_file) == (0, True, "f")
    monkeypatch.setenv("PAGEDKV_METRICS_PORT", "-1")
    off = parse_settings(["--insecure"]).metrics
    assert (off.enabled, off.required) == (False, True)
    monkeypatch.setenv("PAGEDKV_METRICS_PORT", "70000")
    with pytest.raises(SystemExit) as info:
        parse_settings(["--insecure"])
    assert info.value.code == 2 and "--metrics-port must be in -1..65535" in (
        capsys.readouterr().err)


def test_pool_resets_are_verified_and_only_gateways_call_by_default() -> None:
    settings = parse_settings(["--insecure"])
    assert settings.verify_pool_resets and settings.tls_gateway_names == {"gateway"}
    settings = parse_settings(["--insecure", "--verify-pool-resets", "false",
                               "--tls-gateway-names", "gw-a, gw-b"])
    assert not settings.verify_pool_resets and settings.tls_gateway_names == {"gw-a", "gw-b"}


def test_the_shared_internal_token_is_refused_at_start_pointing_to_the_role_tokens(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path
) -> None:
    # Issue 30: one shared token made every holder every role; it is not mapped to any.
    token = tmp_path / "internal-token"
    token.write_text("a-token-of-enough-characters\n")
    for argv, env in ((["--internal-token-file", str(token)], {}),
                      ([], {LEGACY_TOKEN_ENV: "a-token-of-enough-characters"})):
        for name, value in {**RoleTokens.new().env("allocator"), **env}.items():
            monkeypatch.setenv(name, value)
        with pytest.raises(SystemExit) as info:
            parse_settings(argv)
        err = capsys.readouterr().err
        assert info.value.code == 2 and "the shared internal token is gone" in err, err
        assert "--role-token-file" in err and "--caller-digests-file" in err
        monkeypatch.delenv(LEGACY_TOKEN_ENV, raising=False)


def test_a_server_without_caller_digests_or_tls_is_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Its own token alone would leave the port open to every caller.
    monkeypatch.delenv(CALLER_DIGESTS_ENV, raising=False)
    monkeypatch.setenv(ROLE_TOKEN_ENV, RoleTokens.new().token("allocator"))
    with pytest.raises(SystemExit) as info:
        parse_settings([])
    assert info.value.code == 2 and "would accept every caller" in capsys.readouterr().err
