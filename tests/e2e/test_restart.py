"""The allocator restarts under a streaming request: the gateway takes a new lease,
re-registers its pool, readmits the request (recompute) and the output is unchanged."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

from e2e_stack import (
    ROOT,
    Clients,
    Streamed,
    generate,
    prompts,
    reference_greedy,
    sampling,
    start_stack,
)

from pagedkv.gateway.v1 import gateway_pb2 as gpb


def test_allocator_restart_mid_stream_keeps_output(tmp_path: Path):
    # Kill the allocator after the first tokens, start a new one on the same port.
    stack = start_stack(tmp_path)
    clients = Clients(stack)
    restarted: subprocess.Popen[bytes] | None = None
    try:
        prompt = next(prompts(1, 20, seed=61))
        result: dict[str, dict[int, Streamed] | Exception] = {}

        def run() -> None:
            try:
                result["ok"] = generate(clients.gateway, gpb.GenerateRequest(
                    token_ids=gpb.TokenIds(ids=prompt),
                    sampling=sampling(300, ignore_eos=True)), timeout=90)
            except Exception as exc:  # noqa: BLE001 - reported by the assertion below
                result["error"] = exc

        thread = threading.Thread(target=run)
        thread.start()
        time.sleep(1.0)
        port = stack.allocator_addr.rsplit(":", 1)[1]
        stack.kill("allocator")
        time.sleep(1.0)
        with open(tmp_path / "allocator-restarted.log", "wb") as log:
            restarted = subprocess.Popen([sys.executable, "-m", "allocator_svc", "--port", port],
                                         cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        thread.join(120)
        assert not thread.is_alive(), "the request hung after the allocator restarted"
        assert "error" not in result, result.get("error")
        done = result["ok"]
        assert isinstance(done, dict)
        assert tuple(done[0].token_ids) == reference_greedy(tuple(prompt), 300, ignore_eos=True)
        clients.wait_all_blocks_back()
        gateway_log = (tmp_path / "gateway.log").read_text()
        assert "requests_readmitted" in gateway_log and "lease_acquired" in gateway_log
    finally:
        clients.close()
        if restarted is not None:
            restarted.terminate()
            restarted.wait(10)
        stack.stop()
