"""Allocator figures (issue 2): in-process step costs and the gRPC round trip.

    python -m bench.allocator_bench [--quick]

Anchors (BENCHMARKS.md, vLLM 0.33 in-process on this kind of machine, block size 16, SHA-256):
one-token decode allocate_slots ~5.1 us per request; prefix lookup ~25 us plus allocation
~64 us for a 1,024-token prompt with a 512-token hit; ~4,500 request lifecycles per second.
"""

from __future__ import annotations

import argparse
import gc
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

from allocator_svc.core.allocator import Allocator, Limits
from allocator_svc.core.pool import PoolConfig
from bench.common import markdown_table, median, percentile, write_results
from common.step_records import Commit, StepCall, StepItem
from pagedkv.allocator.v1 import allocator_pb2 as pb
from pagedkv.allocator.v1 import allocator_pb2_grpc

BLOCK_SIZE = 16
NUM_BLOCKS = 65536
PROMPT_LEN = 1024
SHARED_LEN = 512
VLLM = {"decode_us_per_request": 5.1, "admit_us": 25 + 64, "lifecycles_per_s": 4500}


def make_pool() -> tuple[Allocator, int]:
    allocator = Allocator(Limits(max_batch_items=4096))
    pool, _ = allocator.register_pool(
        PoolConfig("bench", NUM_BLOCKS, BLOCK_SIZE, 0, "bench-model", "i", True)
    )
    gc.freeze()  # as the service does after registering a pool
    return allocator, pool.epoch


def decode_step_us(num_running: int, num_steps: int, columns: bool = False) -> list[float]:
    """Microseconds per batched decode step (commits of the last step + one token each).

    `columns`: the decodes as the wire's decode_request_ids column, with their values in
    the appends column (the gateway's form); otherwise a `StepItem` each (the general path).
    Under a lease, as the gateway steps: every named request is checked against it."""
    allocator, epoch = make_pool()
    lease = allocator.create_lease(600.0).lease_id
    ids = [f"r{i}" for i in range(num_running)]
    allocator.step(
        "bench", epoch, lease,
        StepCall([StepItem(r, 128, list(range(i, i + 128))) for i, r in enumerate(ids)], step_id=1))
    samples = []
    for token in range(num_steps):
        start = time.perf_counter()
        # Each step confirms the one before, as the gateway's do.
        step_id = token + 2
        if columns:
            allocator.step(
                "bench", epoch, lease,
                StepCall(decode_request_ids=list(ids), append_request_ids=list(ids),
                    append_token_ids=[token] * num_running, step_id=step_id,
                    commit_through_step_id=step_id - 1))
        else:
            items = [StepItem(r, 1) for r in ids]
            allocator.step(
                "bench", epoch, lease,
                StepCall(items, step_id=step_id, append_request_ids=list(ids),
                    append_token_ids=[token] * num_running, commit_through_step_id=step_id - 1))
        samples.append((time.perf_counter() - start) * 1e6)
    return samples


def shared_prompts(count: int) -> list[list[int]]:
    shared = list(range(SHARED_LEN))
    return [
        shared + [10_000 + i * PROMPT_LEN + j for j in range(PROMPT_LEN - SHARED_LEN)]
        for i in range(count)
    ]


def admit_us(repeat: int) -> tuple[list[float], list[float]]:
    """Prefix lookup alone, and admission (lookup + allocation) of a 1,024-token prompt."""
    allocator, epoch = make_pool()
    prompts = shared_prompts(repeat + 1)
    allocator.step("bench", epoch, None, StepCall([StepItem("warm", PROMPT_LEN, prompts[0])]))
    allocator.free("bench", epoch, [Commit("warm", PROMPT_LEN)], ["warm"])
    pool = allocator.pools["bench"]
    lookups, admits = [], []
    for i, prompt in enumerate(prompts[1:]):
        start = time.perf_counter()
        hits, _ = pool.match_prefix(pool.root(""), prompt)
        lookups.append((time.perf_counter() - start) * 1e6)
        assert len(hits) * BLOCK_SIZE == SHARED_LEN
        item = StepItem(f"a{i}", PROMPT_LEN, prompt)
        start = time.perf_counter()
        allocator.step("bench", epoch, None, StepCall([item]))
        admits.append((time.perf_counter() - start) * 1e6)
        allocator.abort("bench", epoch, [f"a{i}"])
    return lookups, admits


def lifecycles_per_s(num_requests: int) -> float:
    """Admit (512 cached) + commit + free for each of `num_requests` 1,024-token prompts."""
    allocator, epoch = make_pool()
    prompts = shared_prompts(num_requests)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        rid = f"l{i}"
        allocator.step("bench", epoch, None, StepCall([StepItem(rid, PROMPT_LEN, prompt)]))
        allocator.free("bench", epoch, [Commit(rid, PROMPT_LEN)], [rid])
    return num_requests / (time.perf_counter() - start)


def grpc_step_ms(num_running: int, num_steps: int) -> list[float]:
    """Round trip of the same decode step through a real allocator subprocess."""
    with tempfile.TemporaryDirectory() as tmp:
        port_file = Path(tmp) / "port"
        server = subprocess.Popen(
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
                "--log-level",
                "warning",
                "--insecure",  # the RPC cost alone: a token check is one compare
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            while not port_file.exists() or not port_file.read_text():
                time.sleep(0.05)
            return _grpc_steps(f"127.0.0.1:{port_file.read_text()}", num_running, num_steps)
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=15)


def _grpc_steps(address: str, num_running: int, num_steps: int) -> list[float]:
    channel = grpc.insecure_channel(address)
    stub = allocator_pb2_grpc.AllocatorServiceStub(channel)
    pool = stub.RegisterPool(
        pb.RegisterPoolRequest(
            pool_id="bench",
            num_blocks=NUM_BLOCKS,
            block_size=BLOCK_SIZE,
            model_fingerprint="bench-model",
            executor_instance_id="i",
            enable_prefix_caching=True,
        )
    ).pool
    ids = [f"r{i}" for i in range(num_running)]
    # Under a lease, as the gateway steps (every named request is checked against it).
    lease_id = stub.CreateLease(pb.CreateLeaseRequest(ttl_ms=600_000)).lease_id
    stub.Step(
        pb.StepRequest(
            pool_id="bench",
            epoch=pool.epoch,
            lease_id=lease_id,
            items=[
                pb.StepItem(request_id=r, prompt_token_ids=list(range(i, i + 128)), num_tokens=128)
                for i, r in enumerate(ids)
            ],
            step_id=1,
        )
    )
    samples = []
    for token in range(num_steps):
        request = pb.StepRequest(
            pool_id="bench",
            epoch=pool.epoch,
            lease_id=lease_id,
            step_id=token + 2,
            commit_through_step_id=token + 1,
            decode_request_ids=ids,
            append_request_ids=ids,
            append_token_ids=[token] * len(ids),
        )
        start = time.perf_counter()
        stub.Step(request)
        samples.append((time.perf_counter() - start) * 1e3)
    channel.close()
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = parser.parse_args()
    steps = 64 if args.quick else 256
    rows, results = [], {}
    for n, columns in [(n, c) for c in (True, False) for n in (1, 64, 256)]:
        # Building the items (or columns) is timed too: the service builds them per call.
        step_us = median(decode_step_us(n, steps, columns))
        form = "columns" if columns else "items"
        results[f"decode_step_us_{n}" + ("" if columns else "_items")] = step_us
        rows.append(
            [
                f"in-process decode step, {n} running ({form})",
                f"{step_us:.1f} us",
                f"{step_us / n:.2f} us/request",
                f"{VLLM['decode_us_per_request']} us/request",
                f"{VLLM['decode_us_per_request'] / (step_us / n):.1f}x",
            ]
        )
    lookups, admits = admit_us(50 if args.quick else 200)
    results["prefix_lookup_us"], results["admit_us"] = median(lookups), median(admits)
    rows.append(
        [
            "prefix lookup, 1,024 tokens, 512 hit",
            f"{median(lookups):.1f} us",
            "",
            "25 us",
            f"{25 / median(lookups):.1f}x",
        ]
    )
    rows.append(
        [
            "admit (lookup + allocate), same prompt",
            f"{median(admits):.1f} us",
            "",
            f"{VLLM['admit_us']} us",
            f"{VLLM['admit_us'] / median(admits):.1f}x",
        ]
    )
    rates = [lifecycles_per_s(1000) for _ in range(3 if args.quick else 5)]
    results["lifecycles_per_s"] = median(rates)
    rows.append(
        [
            "request lifecycles (admit + commit + free)",
            f"{median(rates):,.0f} /s",
            "",
            "4,500 /s",
            f"{median(rates) / VLLM['lifecycles_per_s']:.1f}x",
        ]
    )
    for n in (1, 64, 256):
        samples = grpc_step_ms(n, 200 if args.quick else 1000)
        p50, p99 = percentile(samples, 50), percentile(samples, 99)
        results[f"grpc_step_ms_{n}"] = {"p50": p50, "p99": p99}
        target = "p50 < 1 ms, p99 < 3 ms" if n == 256 else ""
        rows.append(
            [
                f"gRPC decode step round trip, {n} running",
                f"p50 {p50:.3f} ms",
                f"p99 {p99:.3f} ms",
                target,
                "",
            ]
        )
    table = markdown_table(
        ["measure", "pagedkv", "", "vLLM 0.33 anchor / target", "speed-up"], rows
    )
    print(table)
    path = write_results(
        "allocator",
        {
            "quick": args.quick,
            "block_size": BLOCK_SIZE,
            "results": results,
            "vllm_anchor": VLLM,
            "table": table,
        },
    )
    print(f"\nwritten to {path}")


if __name__ == "__main__":
    main()
