"""The test kinds of tests/conftest.py: what make test-fast refuses, and what it lets run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.conftest import KINDS, SHARED_STACKS, UnitTestStartedSomething, _NoPythonPopen, _refuse


def test_a_python_subprocess_is_refused_naming_what_was_started():
    with pytest.raises(UnitTestStartedSomething, match="a Python subprocess .*-m allocator_svc"):
        _NoPythonPopen([sys.executable, "-m", "allocator_svc", "--port", "0"])
    with pytest.raises(UnitTestStartedSomething, match="python3 -c"):
        _NoPythonPopen("python3 -c pass", shell=True)


def test_a_tool_that_is_not_a_service_runs():
    process = _NoPythonPopen(["true"])
    assert process.wait(timeout=10) == 0


def test_a_server_is_refused_naming_the_marks_to_use():
    with pytest.raises(UnitTestStartedSomething, match=r"pytest.mark.service.*pytest.mark.e2e"):
        _refuse("a gRPC server")()


def test_every_collected_test_has_exactly_one_kind(request: pytest.FixtureRequest):
    kinds = {item.nodeid: {k for k in KINDS if item.get_closest_marker(k)}
             for item in request.session.items}
    assert kinds[request.node.nodeid] == {"unit"}  # this one starts nothing: left unmarked
    assert {nodeid: k for nodeid, k in kinds.items() if len(k) != 1} == {}


def test_every_file_said_to_share_a_stack_exists():
    # A renamed file would silently leave its group (and start its stack again).
    root = Path(__file__).resolve().parent.parent
    missing = [path for path in SHARED_STACKS if not (root / path).is_file()]
    assert not missing, f"SHARED_STACKS names files that do not exist: {missing}"
