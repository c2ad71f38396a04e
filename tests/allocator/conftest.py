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

import pytest

from allocator_svc.core.allocator import Allocator, Limits
from allocator_svc.core.pool import Pool, PoolConfig
from allocator_svc.core.request import Commit
from allocator_svc.core.step import PreemptionMode, StepCall, StepItem, StepResult
from common.credentials import ROLES, RoleTokens
from pagedkv.allocator.v1 import allocator_pb2 as pb
from pagedkv.allocator.v1 import allocator_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parents[2]


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
        items: list[StepItem],
        commits: dict[str, int] | None = None,
        free: list[str] | None = None,
        abort: list[str] | None = None,
        step_id: int = 0,
        commit_through: int = 0,
    ) -> StepResult:
        result = self.allocator.step(StepCall(
            self.pool.config.pool_id,
            self.pool.epoch,
            self.lease_id,
            items,
            self.mode,
            commits=[Commit(k, v) for k, v in (commits or {}).items()],
            free_ids=free or [],
            abort_ids=abort or [],
            step_id=step_id,
            commit_through=commit_through,
        ))
        self.allocator.check_invariants()
        return result

    def table(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.pool.requests[request_id].blocks]


def new(
    request_id: str, prompt: list[int], num_tokens: int | None = None, salt: str = ""
) -> StepItem:
    return StepItem(request_id, len(prompt) if num_tokens is None else num_tokens, prompt, salt)


def decode(request_id: str, token: int) -> StepItem:
    return StepItem(request_id, 1, None, "", [token])


def make_harness(
    num_blocks: int = 8, block_size: int = 4, num_cpu_blocks: int = 0, caching: bool = True,
    num_cpu_cache_blocks: int = 0,
) -> Harness:
    now = [0.0]
    allocator = Allocator(Limits(max_batch_items=64), clock=lambda: now[0])
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
