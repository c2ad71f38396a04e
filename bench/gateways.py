"""Scaling out the gateways without scaling down the executor: the same requests through one
gateway, then split over four, onto one real executor.

    .venv/bin/python -m bench.gateways [--repeats 3] [--requests 32] [--dtype float32]

One stack: the allocator, one executor on the embedded SmolLM2-135M-Instruct (real weights)
and four gateways, all up for the whole run. Each repeat sends the same closed batch (every
request at once: 128 random prompt tokens, 64 output tokens, greedy, ignore_eos, streamed
over gRPC) through gateway 0 alone, and split round robin over the four, in turn (which goes
first alternates). The executor merges the calls waiting for it into one forward whatever
gateway sent them, so four gateways should cost about what one does. Reported per setting:
output tok/s over the batch, inter-token latency (the median of each request's mean) and
TTFT p50; the medians of the repeats, the per-repeat ratios four / one, and the executor's
forwards and the calls they merged. Writes bench/results/gateways.json.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import statistics
import time
import urllib.request
from collections.abc import Sequence
from typing import Any

import grpc

from bench.baselines import BenchRequest, RequestResult
from bench.common import machine, markdown_table, write_results
from bench.load import _one, stack
from common.model_dirs import DEFAULT_MODEL
from pagedkv.gateway.v1 import gateway_pb2_grpc as gpb_grpc
from tools.launch import Stack

NUM_GATEWAYS = 4
INPUT_LEN, OUTPUT_LEN = 128, 64


def batch(num: int, vocab_size: int, seed: int) -> list[BenchRequest]:
    rng = random.Random(seed)
    return [BenchRequest([rng.randrange(3, vocab_size) for _ in range(INPUT_LEN)], OUTPUT_LEN)
            for _ in range(num)]


async def _send(addresses: Sequence[str], requests: Sequence[BenchRequest]
                ) -> tuple[list[RequestResult], float]:
    """Request i through addresses[i % len]; all at once. Returns results and wall time."""
    results = [RequestResult() for _ in requests]
    channels = [grpc.aio.insecure_channel(a) for a in addresses]
    try:
        stubs = [gpb_grpc.GatewayServiceStub(c) for c in channels]
        origin = time.perf_counter()
        await asyncio.gather(*(
            _one(stubs[i % len(stubs)], r, results[i], origin, "", 600.0)
            for i, r in enumerate(requests)))
        return results, time.perf_counter() - origin
    finally:
        for channel in channels:
            await channel.close()


def _forwards(running: Stack) -> tuple[float, float]:
    """The executor's merged-calls histogram: (calls, forwards) so far."""
    port = running.by_name("executor-0").http_ports["--metrics-port"]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()

    def value(name: str) -> float:
        found = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
        return float(found.group(1)) if found else 0.0

    return (value("pagedkv_executor_batch_calls_sum"),
            value("pagedkv_executor_batch_calls_count"))


def measure(running: Stack, addresses: Sequence[str], requests: Sequence[BenchRequest]
            ) -> dict[str, Any]:
    calls_before, forwards_before = _forwards(running)
    results, wall_s = asyncio.run(_send(addresses, requests))
    failed = [r.error for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, e.g. {failed[0]}")
    calls, forwards = _forwards(running)
    tokens = sum(len(r.tokens) for r in results)
    return {
        "output_tok_s": tokens / wall_s,
        "itl_ms": statistics.median(r.tpot_s for r in results if r.tpot_s is not None) * 1e3,
        "ttft_p50_ms": statistics.median(r.ttft_s for r in results) * 1e3,
        "forwards": forwards - forwards_before,
        "calls_per_forward": (calls - calls_before) / max(forwards - forwards_before, 1),
        "outputs": [r.tokens for r in results],
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    args = parser.parse_args(argv)

    runs: dict[str, list[dict[str, Any]]] = {"one": [], "four": []}
    with stack(args.model, executor_args=("--dtype", args.dtype),
               load_format="auto") as running:
        gateways = [running.gateway_addr] + [
            running.start_gateway(f"gateway-{i}").address for i in range(1, NUM_GATEWAYS)]
        settings = {"one": gateways[:1], "four": gateways}
        requests = batch(args.requests, 49152, seed=0)
        measure(running, gateways, requests[:8])  # warm-up: every gateway, the executor
        for repeat in range(args.repeats):
            order = ("one", "four") if repeat % 2 == 0 else ("four", "one")
            for name in order:
                runs[name].append(measure(running, settings[name], requests))
                last = runs[name][-1]
                print(f"repeat {repeat} {name}: {last['output_tok_s']:.1f} tok/s, ITL "
                      f"{last['itl_ms']:.1f} ms, {last['calls_per_forward']:.2f} calls/forward",
                      flush=True)

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[name])

    ratios = {key: [f[key] / o[key] for o, f in zip(runs["one"], runs["four"], strict=True)]
              for key in ("output_tok_s", "itl_ms", "ttft_p50_ms")}
    same = all(o["outputs"] == f["outputs"] for o, f in zip(runs["one"], runs["four"],
                                                            strict=True))
    summary = {name: {key: med(name, key) for key in
                      ("output_tok_s", "itl_ms", "ttft_p50_ms", "forwards", "calls_per_forward")}
               for name in runs}
    for run in (*runs["one"], *runs["four"]):
        run.pop("outputs")
    write_results("gateways", {
        "machine": machine(),
        "config": {"requests": args.requests, "input_len": INPUT_LEN, "output_len": OUTPUT_LEN,
                   "dtype": args.dtype, "model": args.model, "repeats": args.repeats,
                   "num_gateways": NUM_GATEWAYS},
        "medians": summary, "ratios_four_over_one": ratios, "runs": runs,
        "outputs_identical": same,
    })
    rows = [[name, f"{s['output_tok_s']:.1f}", f"{s['itl_ms']:.1f}", f"{s['ttft_p50_ms']:.0f}",
             f"{s['forwards']:.0f}", f"{s['calls_per_forward']:.2f}"]
            for name, s in summary.items()]
    print(markdown_table(["gateways", "output tok/s", "ITL ms", "TTFT p50 ms", "forwards",
                          "calls / forward"], rows))
    print("four / one per repeat: tok/s " + ", ".join(f"{r:.2f}" for r in ratios["output_tok_s"])
          + "; ITL " + ", ".join(f"{r:.2f}" for r in ratios["itl_ms"])
          + f"; outputs identical: {same}")


if __name__ == "__main__":
    main()
