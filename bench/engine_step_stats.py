"""`python -m bench.engine_step_stats`: the per-step control-plane cost, measured.

Starts a local stack (tiny preset, CPU, dummy weights), runs N concurrent streaming requests
that decode together, and reads the gateway's `engine_step_stats` summaries (JSON logs) for
the windows in which all N sequences decoded. Control plane = gateway step time minus the
executor's forward pass and sampling: scheduling, the allocator round trip, serialization
both ways, the Execute round trip, and output processing (detokenization, streaming).

The gateway's own summaries (`--stats-every-steps`); `python -m bench.control_plane` splits
the same cost into its parts from the same engines' per-step records (`--step-log`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import grpc

from pagedkv.gateway.v1 import gateway_pb2 as pb
from pagedkv.gateway.v1 import gateway_pb2_grpc as pb_grpc
from tools.launch import Stack, StackSpec

WINDOW = 20


async def _stream(stub: pb_grpc.GatewayServiceStub, i: int, max_tokens: int) -> int:
    prompt = [1, *[(i * 13 + j) % 500 + 3 for j in range(15)]]
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt),
        sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )
    count = 0
    async for response in stub.Generate(request):
        count += len(response.token_ids)
    return count


async def _load(address: str, num_requests: int, max_tokens: int) -> float:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GatewayServiceStub(channel)
        start = time.perf_counter()
        counts = await asyncio.gather(*(_stream(stub, i, max_tokens)
                                        for i in range(num_requests)))
        assert all(c == max_tokens for c in counts), "a stream came back short"
        return time.perf_counter() - start


def _summaries(log_path: Path, num_seqs: int) -> list[dict[str, float]]:
    rows = []
    for line in log_path.read_text().splitlines():
        if '"engine_step_stats"' not in line:
            continue
        row = json.loads(line)
        if row.get("mean_seqs") == num_seqs:
            rows.append(row)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.engine_step_stats")
    parser.add_argument("--running", default="64,256", help="concurrent requests per run")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--model", default="models/tiny-llama", help="preset (small-llama: "
                        "the small CPU preset the share of step time is judged on)")
    args = parser.parse_args()
    sizes = [int(x) for x in args.running.split(",")]
    log_dir = Path(tempfile.mkdtemp(prefix="pagedkv-bench-"))
    spec = StackSpec(
        model=args.model, allocator_port=0, executor_port=0, gateway_port=0, log_dir=str(log_dir),
        executor_args=("--load-format", "dummy", "--dtype", "float32", "--num-blocks", "8192",
                       "--max-num-seqs", "512"),
        gateway_args=("--log-json", "--stats-every-steps", str(WINDOW), "--max-num-seqs", "512",
                      "--max-num-batched-tokens", "8192"),
    )
    stack = Stack(spec).start()
    try:
        print(f"model {args.model}, {args.max_tokens} tokens per request")
        print("| running | p50 step ms | p50 control-plane ms | p50 allocator ms | share |")
        print("|---|---|---|---|---|")
        for n in sizes:
            asyncio.run(_load(stack.gateway_addr, n, args.max_tokens))
            rows = _summaries(log_dir / "gateway.log", n)
            if not rows:
                print(f"| {n} | no full-batch window measured | | | |")
                continue
            step = statistics.median(r["p50_step_ms"] for r in rows)
            control = statistics.median(r["p50_control_ms"] for r in rows)
            alloc = statistics.median(r["p50_allocator_ms"] for r in rows)
            print(f"| {n} | {step:.2f} | {control:.2f} | {alloc:.2f} | {control / step:.0%} |")
    finally:
        stack.stop()
    print(f"(logs in {log_dir})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
