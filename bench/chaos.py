"""`python -m bench.chaos`: what a client sees when parts of the stack fail under load.

Each scenario starts a fresh stack (the three services as subprocesses, the tiny-llama preset
with seeded dummy weights: the faults, not the model, are measured), runs streaming clients
and injects one fault while they stream:

- kill -9 of the allocator, of one of two executors, of the gateway (each restarted on its
  port at once, as the launcher does);
- allocator outages of 1 s and 15 s (SIGSTOP, then SIGCONT: it hangs, then answers again);
- many more streams than the KV pool holds (10% of their demand: preemption throughout);
- a cancel storm (half the streams cancelled at random moments).

The fault comes once a quarter of the tokens have streamed. Per scenario: requests completed,
completed with output identical to a calm run of the same requests (greedy), failed (by status
code), blocks still in use at the allocator after the run (leaked), and recovery: from the
fault's end (the restarted service serving again, or the hung one resumed) until a new
request completes.
Figures, not tests: nothing here asserts.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx

from bench.common import machine, markdown_table, write_results
from bench.load import pool_stats, stack
from pagedkv.gateway.v1 import gateway_pb2 as gpb
from pagedkv.gateway.v1 import gateway_pb2_grpc as gpb_grpc
from tools.launch import Stack

MODEL = str(Path(__file__).resolve().parents[1] / "models" / "tiny-llama")
PROMPT_LEN, OUTPUT_LEN, BLOCK_SIZE = 32, 64, 16


@dataclass(slots=True)
class Outcome:
    tokens: list[int] = field(default_factory=list)
    code: str = ""  # "" when completed


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    num_streams: int
    fault: Callable[[Stack], Awaitable[float]] | None  # returns when the fault ended
    num_executors: int = 1
    num_blocks: int = 1024
    cancel_fraction: float = 0.0


def prompts(num: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1, *(rng.randrange(3, 500) for _ in range(PROMPT_LEN - 1))] for _ in range(num)]


async def _in_thread(fn: Callable[[], Any]) -> Any:
    return await asyncio.get_running_loop().run_in_executor(None, fn)


def kill_and_restart(name: str) -> Callable[[Stack], Awaitable[float]]:
    async def fault(running: Stack) -> float:
        await _in_thread(lambda: running.kill(name))
        await _in_thread(running.restart_exited)  # returns once it serves again
        return time.monotonic()
    return fault


def allocator_outage(seconds: float) -> Callable[[Stack], Awaitable[float]]:
    async def fault(running: Stack) -> float:
        pid = running.by_name("allocator").process.pid
        os.kill(pid, signal.SIGSTOP)
        await asyncio.sleep(seconds)
        os.kill(pid, signal.SIGCONT)
        return time.monotonic()
    return fault


async def _stream(stub: Any, prompt: list[int], outcome: Outcome, cancel_after: float | None,
                  ) -> None:
    request = gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=prompt), sampling=gpb.SamplingParams(
        max_tokens=OUTPUT_LEN, temperature=0.0, ignore_eos=True))

    async def consume() -> None:
        async for response in stub.Generate(request, timeout=600):
            outcome.tokens.extend(response.token_ids)

    try:
        if cancel_after is None:
            await consume()
        else:
            await asyncio.wait_for(consume(), cancel_after)
    except TimeoutError:
        outcome.code = "CANCELLED (by the client)"
    except grpc.aio.AioRpcError as exc:
        outcome.code = exc.code().name


async def _recovery(stub: Any, since: float) -> float:
    """Seconds from `since` until a new request completes."""
    request = gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=[1, 5, 6, 7]),
                                  sampling=gpb.SamplingParams(max_tokens=2, temperature=0.0))
    while True:
        try:
            async for _ in stub.Generate(request, timeout=30):
                pass
            return time.monotonic() - since
        except grpc.aio.AioRpcError:
            await asyncio.sleep(0.05)


async def _drive(running: Stack, scenario: Scenario, batch: list[list[int]],
                 seed: int) -> tuple[list[Outcome], float | None]:
    rng = random.Random(seed)
    outcomes = [Outcome() for _ in batch]
    cancels = [rng.uniform(0.2, 3.0) if rng.random() < scenario.cancel_fraction else None
               for _ in batch]
    async with grpc.aio.insecure_channel(running.gateway_addr) as channel:
        stub = gpb_grpc.GatewayServiceStub(channel)
        streams = [asyncio.ensure_future(_stream(stub, p, o, c))
                   for p, o, c in zip(batch, outcomes, cancels, strict=True)]
        recovery = None
        if scenario.fault is not None:
            # Mid-stream: a quarter of the tokens delivered.
            while sum(len(o.tokens) for o in outcomes) < len(batch) * OUTPUT_LEN // 4:
                await asyncio.sleep(0.01)
            ended = await scenario.fault(running)
        await asyncio.gather(*streams)
    if scenario.fault is not None:
        # A fresh channel: a killed gateway's old one may still be backing off.
        async with grpc.aio.insecure_channel(running.gateway_addr) as channel:
            recovery = await _recovery(gpb_grpc.GatewayServiceStub(channel), ended)
    return outcomes, recovery


def _leaked(running: Stack, timeout_s: float = 20.0) -> int:
    """Blocks still referenced once every request is over (the lease of a killed gateway
    must expire first: up to its ttl)."""
    deadline = time.monotonic() + timeout_s
    while True:
        pools = pool_stats(running)
        used = sum(p.num_used_blocks for p in pools)
        if used == 0 or time.monotonic() > deadline:
            return used
        time.sleep(0.2)


def run(scenario: Scenario, reference: dict[tuple[int, ...], list[int]],
        seed: int) -> dict[str, Any]:
    batch = prompts(scenario.num_streams, seed)
    with stack(MODEL, executor_args=("--num-blocks", str(scenario.num_blocks)),
               gateway_args=("--lease-ttl-ms", "3000"),
               num_executors=scenario.num_executors) as running:
        started = time.monotonic()
        outcomes, recovery = asyncio.run(_drive(running, scenario, batch, seed))
        wall = time.monotonic() - started
        leaked = _leaked(running)
    completed = [(p, o) for p, o in zip(batch, outcomes, strict=True) if not o.code]
    identical = sum(o.tokens == reference.get(tuple(p)) for p, o in completed)
    failures = collections.Counter(o.code for o in outcomes if o.code)
    return {
        "scenario": scenario.name, "streams": scenario.num_streams,
        "completed": len(completed), "identical": identical,
        "failed": dict(failures), "blocks_leaked": leaked,
        "recovery_s": None if recovery is None else round(recovery, 2),
        "wall_s": round(wall, 1),
    }


def calm_reference(num: int, seed: int) -> dict[tuple[int, ...], list[int]]:
    """The same requests on a calm stack: what every completed output must equal."""
    scenario = Scenario("calm", num, None)
    batch = prompts(num, seed)
    with stack(MODEL, executor_args=("--num-blocks", str(scenario.num_blocks))) as running:
        outcomes, _ = asyncio.run(_drive(running, scenario, batch, seed))
    return {tuple(p): o.tokens for p, o in zip(batch, outcomes, strict=True) if not o.code}


def _rss_mib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) // 1024
    return 0


def oversized_prompts(repeats: int = 5) -> dict[str, Any]:
    """Prompts of 60 MB (over the gateway's message limit) and 2 MB (over --max-prompt-bytes)
    sent while a 300-token stream runs: the time to each refusal as the client sees it (its
    own serialization and the loopback transfer included), the gateway's memory, and the
    stream's inter-token gaps."""
    import statistics
    import threading

    big = [("60 MB", "x" * 60_000_000), ("2 MB", "y" * 2_000_000)]
    out: dict[str, Any] = {}
    with stack(MODEL) as running:
        options = [("grpc.max_send_message_length", 100 << 20)]
        with grpc.insecure_channel(running.gateway_addr, options=options) as channel:
            stub = gpb_grpc.GatewayServiceStub(channel)
            pid = running.by_name("gateway").process.pid
            stub.Complete(gpb.CompleteRequest(text="warm up", sampling=gpb.SamplingParams(
                max_tokens=2)))
            out["gateway_rss_mib_before"] = _rss_mib(pid)
            gaps: list[float] = []

            def stream() -> None:
                last = time.monotonic()
                request = gpb.GenerateRequest(
                    token_ids=gpb.TokenIds(ids=prompts(1, 99)[0]),
                    sampling=gpb.SamplingParams(max_tokens=300, temperature=0.0,
                                                ignore_eos=True))
                for _ in stub.Generate(request, timeout=120):
                    now = time.monotonic()
                    gaps.append(now - last)
                    last = now

            thread = threading.Thread(target=stream)
            thread.start()
            time.sleep(0.3)
            http = f"http://127.0.0.1:{running.by_name('gateway').http_ports['--http-port']}"
            for name, text in big:
                # The same prompt as an OpenAI-compatible HTTP body (Content-Length first).
                body = json.dumps({"model": "tiny-llama", "prompt": text, "max_tokens": 2})
                times, codes = [], set()
                for _ in range(repeats):
                    started = time.monotonic()
                    response = httpx.post(f"{http}/v1/completions", content=body, timeout=60,
                                          headers={"content-type": "application/json"})
                    codes.add(str(response.status_code))
                    times.append((time.monotonic() - started) * 1e3)
                out[f"{name} over HTTP"] = {
                    "codes": sorted(codes),
                    "refused_ms_median": round(statistics.median(times), 1),
                    "refused_ms": [round(t, 1) for t in times]}
                if len(body) > 4 << 20:  # over the body limit: refused on its headers alone
                    # The time to that answer (a client that sends its headers, then
                    # waits, as `Expect: 100-continue` clients do), without the upload.
                    out[f"{name} over HTTP, answer to the headers"] = _refusal_on_headers(
                        http, len(body.encode()), repeats)
                times, codes = [], set()
                for _ in range(repeats):
                    started = time.monotonic()
                    try:
                        stub.Complete(gpb.CompleteRequest(
                            text=text, sampling=gpb.SamplingParams(max_tokens=2)), timeout=60)
                        codes.add("OK")
                    except grpc.RpcError as exc:
                        codes.add(exc.code().name)
                    times.append((time.monotonic() - started) * 1e3)
                out[name] = {"codes": sorted(codes), "refused_ms_median": round(
                    statistics.median(times), 1), "refused_ms": [round(t, 1) for t in times]}
            thread.join()
            out["gateway_rss_mib_after"] = _rss_mib(pid)
            out["stream_gap_ms"] = {"p50": round(statistics.median(gaps[1:]) * 1e3, 1),
                                    "max": round(max(gaps[1:]) * 1e3, 1)}
    return out


def _refusal_on_headers(http: str, length: int, repeats: int) -> dict[str, Any]:
    import socket
    import statistics

    host, port = http.removeprefix("http://").split(":")
    times, statuses = [], set()
    for _ in range(repeats):
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            started = time.monotonic()
            sock.sendall(f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: "
                         f"application/json\r\ncontent-length: {length}\r\n\r\n".encode())
            head = sock.recv(64).decode(errors="replace")
            times.append((time.monotonic() - started) * 1e3)
            statuses.add(head.split(" ")[1] if " " in head else head)
    return {"codes": sorted(statuses), "refused_ms_median": round(statistics.median(times), 1)}


def scenarios(quick: bool) -> list[Scenario]:
    overload = 200 if quick else 1000
    demand = overload * (PROMPT_LEN + OUTPUT_LEN) // BLOCK_SIZE
    return [
        Scenario("kill -9 allocator", 32, kill_and_restart("allocator")),
        Scenario("kill -9 one of two executors", 32, kill_and_restart("executor-1"),
                 num_executors=2),
        Scenario("kill -9 gateway", 32, kill_and_restart("gateway")),
        Scenario("allocator outage 1 s", 32, allocator_outage(1.0)),
        Scenario("allocator outage 15 s", 32, allocator_outage(15.0)),
        Scenario(f"{overload} streams, pool at 10% of demand", overload, None,
                 num_blocks=demand // 10),
        Scenario("cancel storm (half cancelled)", 200 if quick else 400, None,
                 cancel_fraction=0.5),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="200 streams instead of 1,000")
    parser.add_argument("--only", default="", help="comma-separated scenario name prefixes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--oversized-only", action="store_true",
                        help="only the oversized prompts beside a stream (gRPC and HTTP)")
    args = parser.parse_args(argv)
    if args.oversized_only:
        print("oversized prompts beside a stream:", oversized_prompts())
        return 0
    chosen = [s for s in scenarios(args.quick)
              if not args.only or any(s.name.startswith(p) for p in args.only.split(","))]
    most = max(s.num_streams for s in chosen)
    reference = calm_reference(most, args.seed)
    rows = []
    for scenario in chosen:
        row = run(scenario, reference, args.seed)
        rows.append(row)
        print(row, flush=True)
    table = markdown_table(
        ["scenario", "streams", "completed", "identical", "failed (status: count)",
         "blocks leaked", "recovery s"],
        [[r["scenario"], r["streams"], r["completed"], r["identical"],
          ", ".join(f"{k}: {v}" for k, v in r["failed"].items()) or "-",
          r["blocks_leaked"], "-" if r["recovery_s"] is None else r["recovery_s"]]
         for r in rows])
    print(table)
    oversized = oversized_prompts()
    print("oversized prompts beside a stream:", oversized)
    write_results("chaos", {"machine": machine(), "model": "tiny-llama (dummy weights)",
                            "prompt_len": PROMPT_LEN, "output_len": OUTPUT_LEN,
                            "quick": args.quick, "seed": args.seed, "rows": rows,
                            "oversized_prompts": oversized})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
