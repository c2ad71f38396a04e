"""Admission by fair share through the whole stack (real subprocesses, simulated executor):
the service a tenant used through one gateway decides its place in another gateway's queue."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from e2e_stack import SIMULATED_TOKENS, Clients, generate, prompts, sampling, start_simulated_stack

from common.credentials import with_metadata
from pagedkv.gateway.v1 import gateway_pb2 as gpb
from pagedkv.gateway.v1 import gateway_pb2_grpc as gpb_grpc
from tools.launch import Stack

KEYS = {"busy": "key-of-a-busy-tenant-0123456789", "quiet": "key-of-a-quiet-tenant-012345",
        "blocker": "key-of-the-blocker-0123456789", "heavy": "key-of-a-heavy-tenant-012345",
        "light": "key-of-a-light-tenant-0123456"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    log_dir: Path = tmp_path_factory.mktemp("fair-share")
    keys = log_dir / "api-keys"
    keys.write_text("".join(f"{key} {tenant}\n" for tenant, key in KEYS.items()))
    # One sequence a step per gateway: whoever is admitted first finishes first.
    stack = start_simulated_stack(
        log_dir, executor_args=("--time-scale", "0.5"),
        gateway_args=("--api-keys-file", str(keys), "--max-num-seqs", "1",
                      "--admission-order", "fair-share"))
    try:
        stack.start_gateway("gateway-2")
        yield stack
    finally:
        stack.stop()


def stub(address: str, tenant: str) -> tuple[grpc.Channel, gpb_grpc.GatewayServiceStub]:
    channel = with_metadata(grpc.insecure_channel(address),
                            (("authorization", f"Bearer {KEYS[tenant]}"),))
    return channel, gpb_grpc.GatewayServiceStub(channel)


def run_in_order(stack: Stack, jobs: list[tuple[str, list[int], int, float]]) -> list[str]:
    """(tenant, prompt, max_tokens, delay after the previous) through the first gateway, one
    thread each; the tenants in the order their requests finished."""
    finished: list[str] = []
    opened = {tenant: stub(stack.gateway_addr, tenant) for tenant, *_ in jobs}

    def run(tenant: str, prompt: list[int], max_tokens: int) -> None:
        done = generate(opened[tenant][1], gpb.GenerateRequest(
            token_ids=gpb.TokenIds(ids=prompt), sampling=sampling(max_tokens, ignore_eos=True)))
        assert tuple(done[0].token_ids) == tuple(SIMULATED_TOKENS.generate(prompt, max_tokens))
        finished.append(tenant)

    threads = []
    try:
        for tenant, prompt, max_tokens, delay in jobs:
            time.sleep(delay)
            threads.append(threading.Thread(target=run, args=(tenant, prompt, max_tokens)))
            threads[-1].start()
        for thread in threads:
            thread.join(120)
    finally:
        for channel, _ in opened.values():
            channel.close()
    return finished


def test_a_tenant_that_joins_behind_a_backlog_goes_next_not_last(stack: Stack):
    # One slot: heavy runs one request and queues two more; light arrives last. Joining, light
    # starts level with heavy (lifted once, to the least backlogged service); while it waits,
    # heavy's running request is charged past it, so light goes next.
    batch = [list(p) for p in prompts(4, 12, seed=911)]
    finished = run_in_order(stack, [("heavy", batch[0], 100, 0.0), ("heavy", batch[1], 4, 0.2),
                                    ("heavy", batch[2], 4, 0.1), ("light", batch[3], 4, 0.1)])
    assert finished == ["heavy", "light", "heavy", "heavy"]
    clients = Clients(stack)
    clients.wait_all_blocks_back()
    clients.close()


def test_a_tenant_served_through_another_gateway_waits_behind_one_that_was_not(stack: Stack):
    batch = [list(p) for p in prompts(4, 12, seed=907)]
    # The busy tenant is served through gateway-2: an 800-token prompt, more than the
    # blocker below computes in all.
    channel, busy_2 = stub(stack.by_name("gateway-2").address, "busy")
    try:
        long_prompt = list(next(iter(prompts(1, 800, seed=908))))
        generate(busy_2, gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=long_prompt),
                                             sampling=sampling(2, ignore_eos=True)))
    finally:
        channel.close()
    # On the first gateway a blocker runs; the busy tenant's request arrives, then the quiet
    # one's. First come would run busy first; fair share runs quiet first.
    finished = run_in_order(stack, [("blocker", batch[1], 150, 0.0), ("busy", batch[2], 4, 0.3),
                                    ("quiet", batch[3], 4, 0.2)])
    assert finished == ["blocker", "quiet", "busy"]
    clients = Clients(stack)
    clients.wait_all_blocks_back()
    clients.close()
