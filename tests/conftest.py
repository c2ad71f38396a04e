"""Shared test fixtures: every suite talks to real servers on loopback (port 0).

Every test is one of three kinds, by what it starts:
- `unit`: nothing (plain objects in this process); the default, given to every unmarked test;
- `service`: real gRPC or HTTP servers in this process, on loopback (module: pytestmark);
- `e2e`: Python subprocesses: services, stacks, a nested pytest (module: pytestmark, or its
  folder; one test: @pytest.mark.e2e).

`make test-fast` runs the unit tests alone, and there a unit test that starts a server or a
Python process fails, naming what it started, so the marks stay true. Tools that are not
services (the compiler for the C++ kernels, kubectl) may run in unit tests.

Under `make test` (xdist, --dist loadfile) each file runs whole on one worker, so that its
module-scoped stack starts once; the files of SHARED_STACKS run on one worker together, so
that the session-scoped stack they share starts once too.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest

# The suite's references are float32 (transformers' own models, token-identical): every
# executor it starts computes in float32 unless a test names another dtype, whatever
# `--dtype auto` would pick on this CPU (bfloat16 where the CPU has bfloat16 hardware).
# PAGEDKV_DTYPE is --dtype's environment equivalent; the subprocesses inherit it.
os.environ["PAGEDKV_DTYPE"] = "float32"  # not setdefault: a shell's own value must not win

# Under xdist the workers are the parallelism: every process they start (services, executors,
# references) computing with an OpenMP team as wide as the machine oversubscribes the cores,
# and the teams' barriers then wait on each other. One thread a process: `make test` took
# 241 s against 313-320 s with teams as wide as the machine's 2 cores. A shell's own value wins.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

KINDS = ("unit", "service", "e2e")
E2E_FOLDERS = ("e2e", "client", "conformance")  # each of their tests starts services


# Test files (from the repository root) -> the session-scoped stack they share.
SHARED_STACKS = {
    **dict.fromkeys(
        ("tests/client/test_client_blocking.py", "tests/client/test_client_asyncio.py",
         "tests/e2e/test_generate.py", "tests/e2e/test_beam_search_stack.py",
         "tests/e2e/test_openai_api.py", "tests/e2e/test_prompt_logprobs.py",
         "tests/e2e/test_structured_output.py", "tests/client/test_client_packaging.py"),
        "tiny_stack"),
    # Their executors (tests/conformance/conftest.py, session fixtures).
    **dict.fromkeys(
        (f"tests/conformance/test_executor_{name}.py"
         for name in ("auth", "callers", "contract", "errors", "handoff",
                      "structured_output")),
        "conformance executors"),
}


@pytest.fixture(scope="session")
def tiny_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One real stack (tests/e2e/e2e_stack.py start_tiny_stack) for the files of SHARED_STACKS;
    each of their tests leaves it as it found it (every block back)."""
    from tests.e2e.e2e_stack import start_tiny_stack

    clients = start_tiny_stack(tmp_path_factory.mktemp("tiny-stack"))
    yield clients
    clients.close()
    clients.stack.stop()


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """--dist loadfile, with the files of one shared stack as one unit of work."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class FilesSharingAStack(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return SHARED_STACKS.get(path, path)

    return FilesSharingAStack(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tests_root = Path(__file__).parent
    for item in items:
        kinds = [k for k in KINDS if item.get_closest_marker(k) is not None]
        folder = Path(item.path).relative_to(tests_root).parts[0]
        if folder in E2E_FOLDERS and "e2e" not in kinds:
            item.add_marker(pytest.mark.e2e)
            kinds.append("e2e")
        if not kinds:
            item.add_marker(pytest.mark.unit)
    # Files that start processes first: --dist loadfile hands files out in this order, so the
    # long ones start early and the last minute is short unit files on both workers, not one
    # stack's file on one of them. (A file moves whole: its module fixtures start once.)
    starts_processes = {item.path for item in items if item.get_closest_marker("e2e")}
    items.sort(key=lambda item: item.path not in starts_processes)


class UnitTestStartedSomething(AssertionError):
    """A test run as `unit` started a server or a Python process: its mark is wrong."""


def _refuse(what: str) -> Any:
    def refused(*args: Any, **kwargs: Any) -> Any:
        raise UnitTestStartedSomething(
            f"a test run as `unit` started {what}: mark its module "
            "`pytestmark = pytest.mark.service` (servers) or `pytest.mark.e2e` (processes)")
    return refused


class _NoPythonPopen(subprocess.Popen):  # type: ignore[type-arg]
    """Popen that refuses to start Python (a service, a stack, a nested pytest). Tools
    (a compiler for the C++ kernels, kubectl) are not services: unit tests may run them."""

    def __init__(self, args: Any, *rest: Any, **kwargs: Any) -> None:
        argv = [args] if isinstance(args, str | bytes | Path) else list(args)
        first = str(argv[0]) if argv else ""
        if first == sys.executable or Path(first.split(" ")[0]).name.startswith("python"):
            _refuse(f"a Python subprocess ({' '.join(map(str, argv[:4]))} ...)")()
        super().__init__(args, *rest, **kwargs)


def pytest_configure(config: pytest.Config) -> None:
    # Only where unit tests run alone (make test-fast): there nothing may start a server or a
    # Python process, so a test marked (or left) unit that does is caught.
    if config.getoption("markexpr", "") != "unit":
        return
    patches = ((subprocess, "Popen", _NoPythonPopen),
               (grpc, "server", _refuse("a gRPC server")),
               (grpc.aio, "server", _refuse("a gRPC server")),
               (asyncio.BaseEventLoop, "create_server", _refuse("a server (asyncio)")))
    for module, name, replacement in patches:
        setattr(module, name, replacement)
