"""The allocator's metrics port and request logs, on a real `python -m allocator_svc`:
a known workload, then the metrics scraped over HTTP and the JSON log lines read back.

Each test uses pools of its own, so its per-pool values are exact; the RPC counters are
shared by the module and compared before and after."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from pagedkv.allocator.v1 import allocator_pb2 as pb
from pagedkv.allocator.v1 import allocator_pb2_grpc
from tests.allocator.conftest import ALLOCATOR_ENV, AUTH, REPO_ROOT
from tests.common.scrape import Samples, scrape

pytestmark = pytest.mark.e2e

SERVICE = "pagedkv.allocator.v1.AllocatorService"
# Sequence ids as a gateway sends them: namespace / tenant tag / the client's request id.
NS = "0a1b2c3d/9f8e7d6c/"


@dataclass
class Served:
    process: subprocess.Popen[bytes]
    stub: Any
    lease_id: str
    metrics_port: int
    log_path: Path

    def scrape(self) -> Samples:
        return scrape(self.metrics_port)

    def log_events(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.log_path.read_text().splitlines()]


def _wait_for(path: Path, process: subprocess.Popen[bytes]) -> int:
    deadline = time.monotonic() + 30
    while not path.exists() or not path.read_text().strip():
        assert process.poll() is None, "allocator exited during start-up"
        assert time.monotonic() < deadline, "allocator did not start within 30 s"
        time.sleep(0.05)
    return int(path.read_text())


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("alloc-metrics")
    log_path = tmp / "allocator.log"
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(
            [sys.executable, "-m", "allocator_svc", "--port", "0", "--port-file",
             str(tmp / "port"), "--metrics-port", "0", "--metrics-port-file",
             str(tmp / "metrics.port"), "--log-json", "--log-level", "debug"],
            cwd=REPO_ROOT, env={**os.environ, **ALLOCATOR_ENV},
            stdout=subprocess.DEVNULL, stderr=log_file)
    port = _wait_for(tmp / "port", process)
    metrics_port = _wait_for(tmp / "metrics.port", process)
    channel = AUTH.channel(f"127.0.0.1:{port}")
    stub = allocator_pb2_grpc.AllocatorServiceStub(channel)
    lease_id = stub.CreateLease(pb.CreateLeaseRequest(ttl_ms=60_000)).lease_id
    yield Served(process, stub, lease_id, metrics_port, log_path)
    channel.close()
    process.terminate()
    assert process.wait(timeout=15) == 0


def _register(served: Served, pool_id: str, num_blocks: int, num_cpu_blocks: int = 0) -> Any:
    return served.stub.RegisterPool(pb.RegisterPoolRequest(
        pool_id=pool_id, num_blocks=num_blocks, block_size=4, num_cpu_blocks=num_cpu_blocks,
        model_fingerprint="tiny", executor_instance_id="inst-1", enable_prefix_caching=True,
    )).pool


def _step(served: Served, pool: Any, items: tuple[Any, ...] = (), **kwargs: Any) -> Any:
    """`items`: StepItems, and _append's (request id, token) pairs: an item of one token
    whose value goes in the call's appends."""
    pairs = [i for i in items if isinstance(i, tuple)]
    if pairs:
        kwargs["append_request_ids"] = [r for r, _ in pairs]
        kwargs["append_token_ids"] = [t for _, t in pairs]
    rows = [pb.StepItem(request_id=i[0], num_tokens=1) if isinstance(i, tuple) else i
            for i in items]
    return served.stub.Step(pb.StepRequest(pool_id=pool.pool_id, epoch=pool.epoch,
                                           lease_id=served.lease_id, items=rows, **kwargs))


def _new(request_id: str, prompt: list[int]) -> Any:
    return pb.StepItem(request_id=request_id, prompt_token_ids=prompt, num_tokens=len(prompt))


def _append(request_id: str, token: int) -> tuple[str, int]:
    return request_id, token


def _pool_values(samples: Samples, pool_id: str, *names: str) -> list[float]:
    return [samples.get(f"pagedkv_allocator_{name}", pool_id=pool_id) for name in names]


def test_allocator_metrics_blocks_prefix_hits_and_an_eviction(served: Served) -> None:
    # 8 blocks of 4. a (9 tokens) takes 3 blocks; committed and freed, its 2 full blocks stay
    # cached. b (same prompt) hits 8 tokens and takes 1 block more; freed. c (28 new tokens)
    # takes 7 blocks: the 6 uncached free blocks, then 1 cached one, evicted.
    pool = _register(served, "pool-blocks", 8)
    fields = ("blocks", "blocks_used", "blocks_free", "blocks_cached", "requests")
    _step(served, pool, [_new("a", list(range(9)))])
    assert _pool_values(served.scrape(), "pool-blocks", *fields) == [8, 3, 5, 0, 1]
    _step(served, pool, commits=[pb.Commit(request_id="a", num_computed_tokens=9)],
          free_request_ids=["a"])
    assert _pool_values(served.scrape(), "pool-blocks", *fields) == [8, 0, 8, 2, 0]
    (grant,) = _step(served, pool, [_new("b", list(range(9)))]).grants
    assert grant.num_cached_tokens == 8
    _step(served, pool, free_request_ids=["b"])
    _step(served, pool, [_new("c", list(range(100, 128)))])
    samples = served.scrape()
    assert _pool_values(samples, "pool-blocks", *fields) == [8, 7, 1, 1, 1]
    assert _pool_values(samples, "pool-blocks", "evictions_total", "prefix_cache_queries_total",
                        "prefix_cache_hits_total", "preemptions_total") == [1, 9 + 9 + 28, 8, 0]


def test_allocator_metrics_copy_on_write_and_swaps(served: Served) -> None:
    # p (6 tokens: a full and a partial block) forks two children; the first to write into
    # the shared partial block gets a copy. s (8 tokens, 2 blocks) is swapped out to the
    # pool's 4 CPU blocks, then swapped back in with one more token (3 blocks).
    pool = _register(served, "pool-cow", 16, num_cpu_blocks=4)
    _step(served, pool, [_new(NS + "p", [1, 2, 3, 4, 5, 6])])
    served.stub.Fork(pb.ForkRequest(pool_id=pool.pool_id, epoch=pool.epoch,
                                    lease_id=served.lease_id, parent_request_id=NS + "p",
                                    child_request_ids=[NS + "p-0", NS + "p-1"]))
    response = _step(served, pool, [_append(NS + "p-0", 7)])
    assert len(response.copies) == 1
    _step(served, pool, [_new(NS + "s", list(range(8)))])
    served.stub.SwapOut(pb.SwapOutRequest(pool_id=pool.pool_id, epoch=pool.epoch,
                                          lease_id=served.lease_id, request_id=NS + "s"))
    samples = served.scrape()
    assert _pool_values(samples, "pool-cow", "cow_copies_total", "swap_outs_total",
                        "swapped_out_blocks_total", "preemptions_total", "cpu_blocks",
                        "cpu_blocks_free", "blocks_used") == [1, 1, 2, 1, 4, 2, 3]
    response = _step(served, pool, [_append(NS + "s", 8)])
    assert len(response.swap_in) == 2
    samples = served.scrape()
    assert _pool_values(samples, "pool-cow", "swap_ins_total", "swapped_in_blocks_total",
                        "cpu_blocks_free", "blocks_used") == [1, 2, 4, 6]


def test_allocator_metrics_count_rpcs_by_status_and_leases(served: Served) -> None:
    # Three DescribePool calls answered, one for an unknown pool (NOT_FOUND); a Step without
    # a lease (INVALID_ARGUMENT); one more lease.
    before = served.scrape()
    _register(served, "pool-rpc", 4)
    for _ in range(3):
        served.stub.DescribePool(pb.DescribePoolRequest(pool_id="pool-rpc"))
    for call, request, code in [
        (served.stub.DescribePool, pb.DescribePoolRequest(pool_id="nope"), "NOT_FOUND"),
        (served.stub.Step, pb.StepRequest(pool_id="pool-rpc"), "INVALID_ARGUMENT"),
    ]:
        with pytest.raises(grpc.RpcError) as info:
            call(request)
        assert info.value.code().name == code
    served.stub.CreateLease(pb.CreateLeaseRequest(ttl_ms=60_000))
    after = served.scrape()

    def delta(name: str, **labels: str) -> float:
        return after.get(name, service=SERVICE, **labels) - before.get(name, service=SERVICE,
                                                                       **labels)

    assert delta("pagedkv_rpc_total", method="DescribePool", code="OK") == 3
    assert delta("pagedkv_rpc_total", method="DescribePool", code="NOT_FOUND") == 1
    assert delta("pagedkv_rpc_total", method="Step", code="INVALID_ARGUMENT") == 1
    assert delta("pagedkv_rpc_total", method="RegisterPool", code="OK") == 1
    assert delta("pagedkv_rpc_duration_seconds_count", method="DescribePool") == 4
    assert delta("pagedkv_rpc_duration_seconds_count", method="Step") == 1
    assert after.get("pagedkv_allocator_leases") == before.get("pagedkv_allocator_leases") + 1


def test_allocator_logs_name_each_request_it_touches(served: Served) -> None:
    # 4 blocks of 4. client-42 (3 tokens) decodes twice in columns (its 5th token takes a
    # second block) and is freed; client-43 is aborted; r1 and r2 fill the pool and r1's
    # next token preempts r2. Every line about them names them: the client's id as
    # request_id, the wire id as seq_id.
    pool = _register(served, "pool-logs", 4)
    _step(served, pool, [_new(NS + "client-42", [1, 2, 3]), _new(NS + "client-43", [4])])
    for token in (9, 10):
        _step(served, pool, decode_request_ids=[NS + "client-42"],
              append_request_ids=[NS + "client-42"], append_token_ids=[token])
    _step(served, pool, free_request_ids=[NS + "client-42"], abort_request_ids=[NS + "client-43"])
    _step(served, pool, [_new(NS + "r1", list(range(8))), _new(NS + "r2", list(range(8)))])
    response = _step(served, pool, [_append(NS + "r1", 1), _append(NS + "r2", 1)])
    assert [p.request_id for p in response.preempted] == [NS + "r2"]
    time.sleep(0.2)  # the log lines are flushed as written; leave the writer a moment
    events = [e for e in served.log_events() if e.get("pool_id") == "pool-logs"
              and "seq_id" in e]
    for event in events:
        assert event["seq_id"] == NS + event["request_id"]
    about = [(e["event"], e["level"], e["request_id"]) for e in events]
    assert about == [
        ("request_admitted", "debug", "client-42"),
        ("request_admitted", "debug", "client-43"),
        ("blocks_allocated", "debug", "client-42"),  # the 5th token: a second block
        ("request_aborted", "info", "client-43"),
        ("request_freed", "debug", "client-42"),
        ("request_admitted", "debug", "r1"),
        ("request_admitted", "debug", "r2"),
        ("request_preempted", "info", "r2"),
        ("blocks_allocated", "debug", "r1"),
    ]
    forked = [e for e in served.log_events() if e["event"] == "request_forked"]
    assert [(e["request_id"], e["child_seq_ids"]) for e in forked] == [
        ("p", [NS + "p-0", NS + "p-1"])]
    swapped = [(e["event"], e["request_id"]) for e in served.log_events()
               if e["event"].startswith("request_swapped")]
    assert swapped == [("request_swapped_out", "s"), ("request_swapped_in", "s")]


def test_allocator_refuses_to_start_on_a_metrics_port_asked_for_and_taken(
        tmp_path: Path) -> None:
    # --metrics-port names a port another process holds: exit 2 with the remedy.
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "allocator_svc", "--port", "0", "--metrics-port", str(port)],
            cwd=REPO_ROOT, env={**os.environ, **ALLOCATOR_ENV},
            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert f"cannot bind the metrics port 127.0.0.1:{port}" in result.stderr
    assert "allocator_failed_to_start" in result.stderr
