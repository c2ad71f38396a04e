"""--routing and --kv-events-lag-s: defaults, and wrong values stop the gateway at start."""

from __future__ import annotations

import pytest

from gateway.settings import load_settings


def settings(argv: list[str]):
    return load_settings(["--insecure", *argv])


def test_routing_defaults_to_exact_and_takes_each_policy(monkeypatch: pytest.MonkeyPatch):
    # exact with a 1 s lag by default; each policy by flag; approx by environment variable.
    default = settings([])
    assert (default.routing, default.kv_events_lag_s) == ("exact", 1.0)
    for policy in ("exact", "approx", "round-robin"):
        assert settings(["--routing", policy]).routing == policy
    assert settings(["--routing", "approx", "--kv-events-lag-s", "0.25"]).kv_events_lag_s == 0.25
    monkeypatch.setenv("PAGEDKV_ROUTING", "approx")
    assert settings([]).routing == "approx"


def test_an_unknown_routing_policy_is_a_usage_error(capsys: pytest.CaptureFixture[str]):
    # Refused at start (exit 2), naming the value and the three policies.
    with pytest.raises(SystemExit) as info:
        settings(["--routing", "bogus"])
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert "--routing" in err and "'bogus'" in err
    assert "exact" in err and "approx" in err and "round-robin" in err


@pytest.mark.parametrize("lag", ["0", "-1", "nan", "inf"])
def test_a_lag_that_is_not_a_positive_number_of_seconds_stops_the_gateway(
    lag: str, capsys: pytest.CaptureFixture[str]
):
    with pytest.raises(SystemExit) as info:
        settings(["--routing", "approx", "--kv-events-lag-s", lag])
    assert info.value.code == 2
    assert ("error: --kv-events-lag-s must be a finite number of seconds > 0 (between two "
            f"reads of the pools' cache events), not {float(lag)!r}") in capsys.readouterr().err


def test_a_lag_that_is_not_a_number_is_a_usage_error(capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as info:
        settings(["--kv-events-lag-s", "soon"])
    assert info.value.code == 2 and "--kv-events-lag-s" in capsys.readouterr().err
