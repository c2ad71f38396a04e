"""Executors joining and leaving a running gateway (--executor-addrs-file), under load: real
subprocesses (simulated executors); every stream ends with their greedy tokens and every block
comes back."""

from __future__ import annotations

import threading
from pathlib import Path

from e2e_stack import (
    MODEL,
    SIMULATED_ARGS,
    SIMULATED_TOKENS,
    Clients,
    generate,
    prompts,
    sampling,
    wait_for,
)

from pagedkv.gateway.v1 import gateway_pb2 as gpb
from tools.launch import Stack, StackSpec


def test_executors_join_and_leave_a_running_gateway_under_load(tmp_path: Path):
    listed = tmp_path / "executors.txt"
    stack = Stack(StackSpec(
        model=MODEL, num_executors=2, allocator_port=0, executor_port=0, gateway_port=0,
        log_dir=str(tmp_path), executor_module="executor_svc.simulated",
        executor_args=SIMULATED_ARGS,
        gateway_args=("--executor-addrs-file", str(listed), "--discovery-interval-s", "0.2"),
    )).start_backends()
    clients = None
    try:
        first, second = stack.executor_addrs()
        def list_executors(*addresses: str) -> None:
            """Replaced by a rename, as a user should: never read half written."""
            staged = tmp_path / "executors.staged"
            staged.write_text("".join(f"{a}  # listed\n" for a in addresses))
            staged.replace(listed)

        list_executors(first)
        stack.start_gateway("gateway")
        clients = Clients(stack)

        def executors() -> list[str]:
            info = clients.gateway.GetModelInfo(gpb.GetModelInfoRequest(), timeout=10)
            return sorted(e.address for e in info.executors)

        assert executors() == [first]
        batch = list(prompts(16, 16, seed=601))
        results: list[tuple[list[int], list[int]]] = []

        def run(prompt: list[int]) -> None:
            done = generate(clients.gateway, gpb.GenerateRequest(  # type: ignore[union-attr]
                token_ids=gpb.TokenIds(ids=prompt), sampling=sampling(32, ignore_eos=True)))
            results.append((prompt, done[0].token_ids))

        threads = [threading.Thread(target=run, args=(p,)) for p in batch[:8]]
        for thread in threads:
            thread.start()
        # A second executor joins mid-load; requests sent from then on use both.
        list_executors(first, second)
        wait_for(lambda: executors() == sorted([first, second]), "the second executor")
        late = [threading.Thread(target=run, args=(p,)) for p in batch[8:]]
        for thread in late:
            thread.start()
        wait_for(lambda: all(p.num_requests or p.num_prefix_queries
                              for p in clients.pools()), "requests on both pools")  # type: ignore[union-attr]
        # Then it leaves while it still runs some: they move to the first (a KV hand-off, or
        # they finish there if they cannot); no new ones go to it.
        list_executors(first)
        wait_for(lambda: executors() == [first], "the second executor to drain and leave",
                  timeout_s=120)
        for thread in [*threads, *late]:
            thread.join(180)
        assert len(results) == len(batch)
        # It comes back: a new engine on the same pool and lease, whose Steps the allocator
        # must take (their numbers go on from the ones before).
        list_executors(first, second)
        wait_for(lambda: executors() == sorted([first, second]), "the second executor again")
        again = [threading.Thread(target=run, args=(p,)) for p in prompts(8, 16, seed=602)]
        for thread in again:
            thread.start()
        wait_for(lambda: all(p.num_requests or p.num_prefix_queries
                              for p in clients.pools()), "requests on both pools again")  # type: ignore[union-attr]
        for thread in again:
            thread.join(180)
        assert len(results) == len(batch) + len(again)
        for prompt, tokens in results:
            assert list(tokens) == SIMULATED_TOKENS.generate(prompt, 32)
        clients.wait_all_blocks_back()
        log = Path(stack.by_name("gateway").log_path or "").read_text()
        assert "executor_joined" in log and "executor_left" in log
    finally:
        if clients is not None:
            clients.close()
        stack.stop()


def test_a_gateway_that_finds_no_executor_says_why(tmp_path: Path):
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "gateway", "--insecure", "--model", MODEL, "--http-port", "-1",
         "--port", "0", "--allocator-addr", "127.0.0.1:1",
         "--executor-dns", "no-such-executor.invalid:50053", "--connect-timeout-s", "1"],
        capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert ("no executor found by --executor-dns no-such-executor.invalid:50053"
            in done.stderr + done.stdout)
    assert "does not resolve" in done.stderr + done.stdout
