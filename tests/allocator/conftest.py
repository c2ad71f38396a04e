"""Helpers for driving the allocator core directly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from allocator_svc.core.allocator import Allocator, Limits
from allocator_svc.core.pool import Pool, PoolConfig
from allocator_svc.core.step import Appends, StepResult
from allocator_svc.core.victims import PreemptionPolicy
from common.credentials import ROLES, RoleTokens
from common.step_records import Commit, PreemptionMode, StepCall, StepItem
from pagedkv.allocator.v1 import allocator_pb2 as pb
from pagedkv.allocator.v1 import allocator_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Decode:
    """A running request learning its next token's value and computing it: an item of one
    token, with the value in the call's appends (the form a gateway at depth 1 sends)."""

    request_id: str
    token: int


def as_call_parts(rows: list[StepItem | Decode]) -> tuple[list[StepItem], Appends | None]:
    """Items in the given order, and the appends of the Decode rows among them."""
    # (Not isinstance(r, Decode): pytest imports this module twice, as conftest and as
    # tests.allocator.conftest, and each has its own Decode class.)
    items = [r if isinstance(r, StepItem) else StepItem(r.request_id, 1) for r in rows]
    values: list[Decode] = [r for r in rows if not isinstance(r, StepItem)]
    if not values:
        return items, None
    return items, Appends([r.request_id for r in values], [r.token for r in values])


def append_columns(appends: Appends | None) -> dict[str, list[Any]]:
    """An Appends as a StepCall's two append columns (keyword arguments)."""
    if appends is None:
        return {}
    return {"append_request_ids": list(appends.request_ids),
            "append_token_ids": list(appends.token_ids)}


@dataclass
class Harness:
    """One pool in one allocator, with a terse step() for tests."""

    allocator: Allocator
    pool: Pool
    mode: PreemptionMode = PreemptionMode.RECOMPUTE
    lease_id: str | None = None
    now: list[float] = field(default_factory=lambda: [0.0])

    def step(
        self,
        items: list[StepItem | Decode],
        commits: dict[str, int] | None = None,
        free: list[str] | None = None,
        abort: list[str] | None = None,
        step_id: int = 0,
        commit_through: int = 0,
        decode_ids: list[str] | None = None,
        appends: dict[str, list[int]] | None = None,
    ) -> StepResult:
        """`items` in priority order after `decode_ids` (one more token each, values
        unsent); `appends`: values learned, per request, before the Decode rows' own."""
        rows, row_values = as_call_parts(items)
        ids = [r for r, tokens in (appends or {}).items() for _ in tokens]
        tokens = [t for values in (appends or {}).values() for t in values]
        if row_values is not None:
            ids += row_values.request_ids
            tokens += row_values.token_ids
        result = self.allocator.step(self.pool.config.pool_id, self.pool.epoch, self.lease_id,
                                     StepCall(
            rows,
            self.mode,
            commits=[Commit(k, v) for k, v in (commits or {}).items()],
            free_request_ids=free or [],
            abort_request_ids=abort or [],
            append_request_ids=ids,
            append_token_ids=tokens,
            decode_request_ids=decode_ids or [],
            step_id=step_id,
            commit_through_step_id=commit_through,
        ))
        self.allocator.check_invariants()
        return result

    def table(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.pool.requests[request_id].blocks]


def new(
    request_id: str, prompt: list[int], num_tokens: int | None = None, salt: str = ""
) -> StepItem:
    return StepItem(request_id, len(prompt) if num_tokens is None else num_tokens, prompt, salt)


def decode(request_id: str, token: int) -> Decode:
    return Decode(request_id, token)


def make_harness(
    num_blocks: int = 8, block_size: int = 4, num_cpu_blocks: int = 0, caching: bool = True,
    num_cpu_cache_blocks: int = 0, policy: PreemptionPolicy = PreemptionPolicy.TAIL,
) -> Harness:
    now = [0.0]
    allocator = Allocator(Limits(max_batch_items=64), clock=lambda: now[0],
                          preemption_policy=policy)
    pool, _ = allocator.register_pool(
        PoolConfig("pool-a", num_blocks, block_size, num_cpu_blocks, "fp", "inst-1", caching,
                   num_cpu_cache_blocks)
    )
    return Harness(allocator, pool, now=now)


@pytest.fixture
def harness() -> Harness:
    return make_harness()


@dataclass
class ServerProcess:
    """A real `python -m allocator_svc` subprocess on a loopback port."""

    process: subprocess.Popen[bytes]
    address: str


# The role tokens of the test allocators (the services refuse to start without credentials
# unless --insecure): ALLOCATOR_ENV starts one; AUTH calls it as a gateway, EXECUTOR_AUTH as
# an executor (which may call nothing there).
# Fixed, not random: pytest imports this module twice (as conftest and as
# tests.allocator.conftest), and both must hold the same tokens.
ROLE_TOKENS = RoleTokens(tuple((role, f"{role}.test-token-0123456789") for role in ROLES))
ALLOCATOR_ENV = ROLE_TOKENS.env("allocator")
AUTH = ROLE_TOKENS.auth("gateway")
EXECUTOR_AUTH = ROLE_TOKENS.auth("executor")


def start_allocator(tmp_path, *flags: str) -> ServerProcess:
    port_file = tmp_path / "allocator.port"
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "allocator_svc",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--port-file",
            str(port_file),
            *flags,
        ],
        cwd=REPO_ROOT,
        env={**os.environ, **ALLOCATOR_ENV},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while not port_file.exists() or not port_file.read_text():
        assert process.poll() is None, "allocator exited during start-up"
        assert time.monotonic() < deadline, "allocator did not start within 30 s"
        time.sleep(0.05)
    return ServerProcess(process, f"127.0.0.1:{port_file.read_text()}")


def stop_process(server: ServerProcess) -> int:
    server.process.send_signal(signal.SIGTERM)
    return server.process.wait(timeout=15)


@pytest.fixture(scope="module")
def allocator_server(tmp_path_factory):
    server = start_allocator(
        tmp_path_factory.mktemp("alloc"),
        "--max-batch-items",
        "8",
        "--lease-check-interval-ms",
        "50",
        "--max-blocks-per-pool",
        "100000",
        "--verify-pool-resets",  # no executor to confirm a reset with (see test_service)
        "false",
    )
    yield server
    assert stop_process(server) == 0, "allocator did not shut down cleanly on SIGTERM"


@pytest.fixture(scope="module")
def stub(allocator_server):
    """An authenticated stub with a lease of its own (`stub.lease_id`), kept alive."""
    channel = AUTH.channel(allocator_server.address)
    stub = allocator_pb2_grpc.AllocatorServiceStub(channel)
    stub.lease_id = stub.CreateLease(pb.CreateLeaseRequest(ttl_ms=60_000)).lease_id
    stop = threading.Event()

    def keep_alive() -> None:
        while not stop.wait(10):
            stub.KeepAlive(pb.KeepAliveRequest(lease_id=stub.lease_id))

    thread = threading.Thread(target=keep_alive, daemon=True)
    thread.start()
    yield stub
    stop.set()
    thread.join()
    channel.close()
