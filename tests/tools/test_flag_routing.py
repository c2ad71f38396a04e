"""The launcher's flag routing refuses, before anything starts, what a service would refuse."""

from __future__ import annotations

import pytest

from tools.flag_routing import UsageError, route_flags, service_flags


@pytest.mark.parametrize(("argv", "message"), [
    (["--block-size", "12"], "executor: --block-size must be a power of two, e.g. 16, not 12"),
    (["--routing", "bogus"], "gateway: --routing must be one of exact, approx, round-robin, "
                             "not 'bogus'"),
    (["--max-num-seqs", "x"], "executor: argument --max-num-seqs: invalid int value: 'x'"),
])
def test_launch_refuses_a_value_the_service_would_refuse(argv: list[str], message: str):
    # Before any process starts: the services' own types and declared checks.
    with pytest.raises(UsageError) as info:
        route_flags(argv, service_flags())
    assert str(info.value) == message
