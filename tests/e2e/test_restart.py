"""The allocator restarts under a streaming request: the gateway takes a new lease,
re-registers its pool, readmits the request (recompute) and the output is unchanged.

Simulated executors (e2e_stack.start_simulated_stack): what is tested is recovery, and their
tokens, a digest of what each slot holds, change when a block table or a recompute is wrong;
the model's numbers are tested elsewhere (test_generate.py, test_real_model.py).

The tests share one stack (leases of 1 s, allocator calls of 2 s): each restarts what it
killed, and `recovered` checks every service is back and every block free before the next.
The long outage, which needs a short wait for the allocator, has a stack of its own."""

from __future__ import annotations

import signal
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from e2e_stack import (
    SIMULATED_TOKENS,
    Clients,
    Streamed,
    generate,
    prompts,
    sampling,
    start_simulated_stack,
    wait_for,
)

from pagedkv.gateway.v1 import gateway_pb2 as gpb
from tools.health_probe import is_serving
from tools.launch import Stack


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = start_simulated_stack(tmp_path_factory.mktemp("restart"), gateway_args=(
        "--lease-ttl-ms", "1000", "--allocator-timeout-s", "2"))
    yield stack
    stack.stop()


@dataclass(slots=True)
class Recovered:
    clients: Clients
    gateway_log: Path
    log_offset: int  # the gateway's log before this test

    def new_gateway_log(self) -> str:
        """What the gateway logged during this test."""
        with self.gateway_log.open("rb") as log:
            log.seek(self.log_offset)
            return log.read().decode(errors="replace")


@pytest.fixture
def recovered(stack: Stack) -> Iterator[Recovered]:
    """The shared stack as a new one: every service up, serving, the pool registered, every
    block free."""
    stack.restart_exited()
    clients = Clients(stack)
    try:
        wait_for(lambda: is_serving(stack.gateway_addr), "the gateway serving", 60)
        wait_for(lambda: clients.pools() and clients.gateway.GetModelInfo(
            gpb.GetModelInfoRequest()).executors[0].healthy, "the pool registered", 60)
        clients.wait_all_blocks_back()
        log = Path(stack.spec.log_dir or "") / "gateway.log"
        yield Recovered(clients, log, log.stat().st_size)
    finally:
        clients.close()


def test_allocator_restart_mid_stream_keeps_output(stack: Stack, recovered: Recovered):
    # Kill the allocator after the first tokens, start a new one on the same port.
    clients = recovered.clients
    prompt = next(prompts(1, 20, seed=61))
    result: dict[str, dict[int, Streamed] | Exception] = {}
    streaming = threading.Event()

    def run() -> None:
        try:
            result["ok"] = generate(clients.gateway, gpb.GenerateRequest(
                token_ids=gpb.TokenIds(ids=prompt),
                sampling=sampling(300, ignore_eos=True)), timeout=90,
                on_tokens=lambda n: n >= 10 and streaming.set())
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            result["error"] = exc
        streaming.set()

    thread = threading.Thread(target=run)
    thread.start()
    # Mid-stream: after its first tokens (a fixed sleep let a fast run finish first).
    assert streaming.wait(60), "no tokens within 60 s"
    assert "ok" not in result, "the request finished before the allocator was killed"
    address = stack.allocator_addr
    stack.kill("allocator")
    time.sleep(1.0)
    # What the launcher does: the same command, on the same port.
    assert [s.name for s in stack.restart_exited()] == ["allocator"]
    assert stack.allocator_addr == address
    thread.join(120)
    assert not thread.is_alive(), "the request hung after the allocator restarted"
    assert "error" not in result, result.get("error")
    done = result["ok"]
    assert isinstance(done, dict)
    assert list(done[0].token_ids) == SIMULATED_TOKENS.generate(prompt, 300)
    clients.wait_all_blocks_back()
    gateway_log = recovered.new_gateway_log()
    assert "requests_readmitted" in gateway_log and "lease_acquired" in gateway_log


def test_only_executor_lost_fails_cleanly_then_restart_serves_again(
    stack: Stack, recovered: Recovered
):
    # The only executor dies mid-stream: UNAVAILABLE, not a hang. A new executor on the same
    # port (a new instance: the pool is reset) is picked up and serves the next request.
    clients = recovered.clients
    prompt = next(prompts(1, 20, seed=67))
    call = clients.gateway.Generate(gpb.GenerateRequest(
        token_ids=gpb.TokenIds(ids=prompt), sampling=sampling(2000, ignore_eos=True)),
        timeout=60)
    next(iter(call))
    stack.kill("executor-0")
    with pytest.raises(grpc.RpcError) as err:
        for _ in call:
            pass
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert [s.name for s in stack.restart_exited()] == ["executor-0"]
    deadline = time.monotonic() + 60
    while True:
        info = clients.gateway.GetModelInfo(gpb.GetModelInfoRequest())
        if info.executors[0].healthy:
            break
        assert time.monotonic() < deadline, "the gateway never reconnected"
        time.sleep(0.5)
    done = generate(clients.gateway, gpb.GenerateRequest(
        token_ids=gpb.TokenIds(ids=prompt), sampling=sampling(8)))[0]
    assert list(done.token_ids) == SIMULATED_TOKENS.generate(prompt, 8)
    clients.wait_all_blocks_back()
    # Killed while the gateway is idle: with no request to fail, the gateway still
    # notices (its idle probe), and its health says so (compose and k8s probes read it).
    # (The gateway's health follows its engines' on a poll of its own: waited for.)
    wait_for(lambda: is_serving(stack.gateway_addr), "the gateway serving before the kill")
    stack.kill("executor-0")
    wait_for(lambda: not clients.gateway.GetModelInfo(
        gpb.GetModelInfoRequest()).executors[0].healthy, "the idle gateway noticing")
    wait_for(lambda: not is_serving(stack.gateway_addr), "the gateway's health saying so")
    assert [s.name for s in stack.restart_exited()] == ["executor-0"]
    wait_for(lambda: is_serving(stack.gateway_addr), "the gateway serving again", 60)


def test_after_a_long_allocator_outage_the_next_request_succeeds_once_it_is_back(
    tmp_path: Path,
):
    # An outage of 4 s, longer than the gateway's wait (3 s here, 10 by default): the request
    # sent during it fails with UNAVAILABLE; once the allocator serves again, the next request
    # succeeds. (It used to fail at once for as long again: the outage clock kept counting
    # from the outage's start, and gRPC's reconnect backoff kept the channel from dialling the
    # allocator.)
    stack = start_simulated_stack(tmp_path, gateway_args=("--allocator-retry-s", "3"))
    clients = Clients(stack)
    try:
        prompt = next(prompts(1, 12, seed=71))
        request = gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=prompt), sampling=sampling(4))
        assert generate(clients.gateway, request)[0].finish_reason
        started = time.monotonic()
        stack.kill("allocator")
        with pytest.raises(grpc.RpcError) as err:
            generate(clients.gateway, request, timeout=60)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "the allocator has not answered" in (err.value.details() or "")
        time.sleep(max(0.0, 4.0 - (time.monotonic() - started)))
        assert [s.name for s in stack.restart_exited()] == ["allocator"]  # serving again
        done = generate(clients.gateway, request, timeout=60)[0]
        assert list(done.token_ids) == SIMULATED_TOKENS.generate(prompt, 4)
    finally:
        clients.close()
        stack.stop()


def test_an_idle_gateway_registers_its_pool_with_a_restarted_allocator(
    stack: Stack, recovered: Recovered
):
    # No request comes: the gateway's keep-alive finds its lease gone, takes a new one, and
    # its idle engine registers the pool again (it used to wait for the next request).
    clients = recovered.clients
    assert len(clients.pools()) == 1
    stack.kill("allocator")
    assert [s.name for s in stack.restart_exited()] == ["allocator"]
    deadline = time.monotonic() + 15
    while not clients.pools():
        assert time.monotonic() < deadline, "the pool was not registered again"
        time.sleep(0.2)
    assert "lease_lost" in recovered.new_gateway_log()


def test_a_restart_whose_old_metrics_port_was_taken_meanwhile_takes_another(
    stack: Stack, recovered: Recovered
):
    # The suite runs in parallel and every service binds port 0, so the port a dead
    # service's /metrics had may be another's by its restart (it was once: "Address already
    # in use", and the allocator could not come back). Its gRPC port is the same; /metrics,
    # which no one was told in advance, moves.
    allocator = stack.by_name("allocator")
    old_metrics = allocator.http_ports["--metrics-port"]
    address = stack.allocator_addr
    stack.kill("allocator")
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", old_metrics))
        squatter.listen()
        assert [s.name for s in stack.restart_exited()] == ["allocator"]
        assert stack.allocator_addr == address
        new_metrics = allocator.http_ports["--metrics-port"]
        assert new_metrics != old_metrics
        with urllib.request.urlopen(f"http://127.0.0.1:{new_metrics}/metrics", timeout=10) as r:
            assert b"pagedkv_allocator" in r.read()
    wait_for(lambda: recovered.clients.pools(), "the pool registered again", 30)


def test_an_allocator_that_hangs_past_the_lease_leaks_nothing(
    stack: Stack, recovered: Recovered
):
    # SIGSTOP the allocator for 5 s under 8 streams: Steps time out (2 s), the lease (1 s)
    # expires meanwhile, and calls queued in the allocator's socket run when it resumes. The
    # streams still complete with the reference's tokens, and every block comes back. (A Step
    # sent under the new lease before the engine had taken the renewal used to admit
    # requests the engine then believed forgotten: 32 of 32 requests' blocks stayed held.)
    clients = recovered.clients
    batch = list(prompts(8, 24, seed=79))
    results: dict[int, dict[int, Streamed]] = {}
    streaming = threading.Event()

    def run(i: int) -> None:
        results[i] = generate(clients.gateway, gpb.GenerateRequest(
            token_ids=gpb.TokenIds(ids=batch[i]), sampling=sampling(200, ignore_eos=True)),
            timeout=120, on_tokens=lambda n: n >= 4 and streaming.set())

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(batch))]
    for thread in threads:
        thread.start()
    assert streaming.wait(60)
    allocator = stack.by_name("allocator").process
    allocator.send_signal(signal.SIGSTOP)
    time.sleep(5.0)
    allocator.send_signal(signal.SIGCONT)
    for thread in threads:
        thread.join(120)
    for i, prompt in enumerate(batch):
        assert list(results[i][0].token_ids) == SIMULATED_TOKENS.generate(prompt, 200)
    clients.wait_all_blocks_back(timeout_s=10)


def test_dead_gateway_blocks_come_back_when_its_lease_expires(
    stack: Stack, recovered: Recovered
):
    # SIGKILL the gateway mid-stream: nobody frees its request, the lease (1 s) expires and
    # the allocator frees everything. (Last: the next test would wait for a new gateway.)
    clients = recovered.clients
    call = clients.gateway.Generate(gpb.GenerateRequest(
        token_ids=gpb.TokenIds(ids=next(prompts(1, 40, seed=73))),
        sampling=sampling(2000, ignore_eos=True)), timeout=60)
    next(iter(call))
    assert clients.pools()[0].num_used_blocks > 0
    stack.kill("gateway")
    clients.wait_all_blocks_back(timeout_s=10)
