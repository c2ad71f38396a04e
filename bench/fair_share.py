"""Fair share across tenants, fleet-wide: `--admission-order fair-share` against `fcfs`.

    python -m bench.fair_share [--repeats 3] [--quick]

One allocator, one simulated executor (`executor_svc.simulated`, Llama-3-8B on an H100 by
its cost model: what is measured is the order of admission, not this CPU's arithmetic) and
four gateways with the same API keys, each running at most `--max-num-seqs 4` sequences, so
that requests queue at the gateways. A heavy tenant sends 24 requests to each gateway at
once; 0.5 s later a light tenant sends 2 to each. Every request: a random 256-token prompt,
64 generated tokens.

Reported per admission order (medians over repeats): the light tenant's TTFT p50 and p90
and the time its last request ends, its share of the tokens generated while its requests
were in flight, every request's output tok/s; and the heavy tenant alone (is throughput
lost when one tenant is active?). Each repeat starts fresh stacks, the orders alternating.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from bench.common import markdown_table, percentile, write_results
from pagedkv.gateway.v1 import gateway_pb2 as gpb
from pagedkv.gateway.v1 import gateway_pb2_grpc as gpb_grpc
from tools.launch import Stack, StackSpec

MODEL = "models/tiny-llama"  # its tokenizer and shapes; the simulated executor's times
KEYS = {"heavy": "bench-key-of-the-heavy-tenant-0123", "light": "bench-key-of-the-light-0123"}
ORDERS = ("fcfs", "fair-share")
NUM_GATEWAYS = 4
PROMPT, OUTPUT = 256, 64


@dataclass
class Sent:
    tenant: str
    sent_s: float
    token_times: list[float] = field(default_factory=list)
    error: str = ""


def start(order: str, log_dir: Path) -> tuple[Stack, list[str]]:
    keys = log_dir / "api-keys"
    keys.write_text("".join(f"{key} {tenant}\n" for tenant, key in KEYS.items()))
    stack = Stack(StackSpec(
        model=MODEL, allocator_port=0, executor_port=0, gateway_port=0, log_dir=str(log_dir),
        executor_module="executor_svc.simulated",
        executor_args=("--simulate-profile", "llama3-8b-h100", "--time-scale", "1",
                       "--num-blocks", "4096"),
        gateway_args=("--api-keys-file", str(keys), "--max-num-seqs", "4",
                      "--admission-order", order),
    )).start()
    try:
        extra = [stack.start_gateway(f"gateway-{i}") for i in range(2, NUM_GATEWAYS + 1)]
    except BaseException:
        stack.stop()
        raise
    return stack, [stack.gateway_addr, *(g.address for g in extra)]


async def one(stub: gpb_grpc.GatewayServiceStub, tenant: str, prompt: list[int],
              origin: float, delay_s: float) -> Sent:
    await asyncio.sleep(delay_s)
    sent = Sent(tenant, time.perf_counter() - origin)
    request = gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=prompt), sampling=gpb.SamplingParams(
        max_tokens=OUTPUT, temperature=0.0, ignore_eos=True))
    try:
        async for response in stub.Generate(
                request, metadata=(("authorization", f"Bearer {KEYS[tenant]}"),), timeout=600):
            now = time.perf_counter() - origin
            sent.token_times.extend([now] * len(response.token_ids))
    except grpc.aio.AioRpcError as exc:
        sent.error = f"{exc.code().name}: {exc.details()}"
    return sent


async def drive(addresses: list[str], heavy_each: int, light_each: int,
                seed: int) -> tuple[list[Sent], float]:
    rng = random.Random(seed)
    channels = [grpc.aio.insecure_channel(a) for a in addresses]
    stubs = [gpb_grpc.GatewayServiceStub(c) for c in channels]
    origin = time.perf_counter()
    jobs = []
    for stub in stubs:
        for tenant, count, delay in (("heavy", heavy_each, 0.0), ("light", light_each, 0.5)):
            for _ in range(count):
                prompt = [rng.randrange(3, 500) for _ in range(PROMPT)]
                jobs.append(one(stub, tenant, prompt, origin, delay))
    sent = await asyncio.gather(*jobs)
    wall = time.perf_counter() - origin
    for channel in channels:
        await channel.close()
    return list(sent), wall


def summary(sent: list[Sent], wall: float) -> dict[str, Any]:
    errors = sorted({s.error for s in sent if s.error})
    done = [s for s in sent if not s.error and len(s.token_times) == OUTPUT]
    light = [s for s in done if s.tenant == "light"]
    row: dict[str, Any] = {"completed": len(done), "requests": len(sent), "errors": errors[:3],
                           "tok_per_s": sum(len(s.token_times) for s in done) / wall}
    if light:
        ttft = [s.token_times[0] - s.sent_s for s in light]
        start, end = min(s.sent_s for s in light), max(s.token_times[-1] for s in light)
        window = [t for s in done for t in s.token_times if start <= t <= end]
        mine = [t for s in light for t in s.token_times]
        row.update(light_ttft_p50_s=percentile(ttft, 50), light_ttft_p90_s=percentile(ttft, 90),
                   light_done_s=end - start, light_share=len(mine) / max(len(window), 1))
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fair_share", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="12 heavy requests a gateway, not 24")
    args = p.parse_args(argv)
    heavy_each = 12 if args.quick else 24
    runs: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        for order in (ORDERS if repeat % 2 == 0 else ORDERS[::-1]):
            for mix, light_each in (("heavy and light", 2), ("heavy alone", 0)):
                log_dir = Path(tempfile.mkdtemp(prefix="pagedkv-fair-share-"))
                stack, addresses = start(order, log_dir)
                try:
                    sent, wall = asyncio.run(drive(addresses, heavy_each, light_each,
                                                   seed=repeat))
                finally:
                    stack.stop()
                run = {"order": order, "mix": mix, "repeat": repeat, **summary(sent, wall)}
                runs.append(run)
                print(f"[fair_share] #{repeat} {order} {mix}: {run['tok_per_s']:.0f} tok/s, "
                      f"light TTFT p50 {run.get('light_ttft_p50_s', 0):.2f} s, share "
                      f"{run.get('light_share', 0):.0%}", file=sys.stderr, flush=True)
    rows = []
    for mix in ("heavy and light", "heavy alone"):
        base = {r["repeat"]: r for r in runs if r["mix"] == mix and r["order"] == "fcfs"}
        for order in ORDERS:
            mine = [r for r in runs if r["mix"] == mix and r["order"] == order]

            def med(key: str, mine: list[dict[str, Any]] = mine) -> float | None:
                values = [r[key] for r in mine if key in r]
                return statistics.median(values) if values else None

            rows.append({"mix": mix, "order": order, "tok_per_s": med("tok_per_s"),
                         "ratios": [r["tok_per_s"] / base[r["repeat"]]["tok_per_s"]
                                    for r in mine],
                         "light_ttft_p50_s": med("light_ttft_p50_s"),
                         "light_ttft_p90_s": med("light_ttft_p90_s"),
                         "light_done_s": med("light_done_s"), "light_share": med("light_share"),
                         "completed": min(r["completed"] for r in mine),
                         "requests": mine[0]["requests"]})

    def fmt(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    print(f"### Fair share: {NUM_GATEWAYS} gateways, heavy tenant {heavy_each} requests a "
          f"gateway, light 2 a gateway 0.5 s later; medians of {args.repeats} repeats\n")
    print(markdown_table(
        ["tenants", "admission", "tok/s", "vs fcfs each repeat", "light TTFT p50 s",
         "light TTFT p90 s", "light done in s", "light share while in flight", "done"],
        [[r["mix"], r["order"], fmt(r["tok_per_s"], ".0f"),
          " ".join(f"{x:.2f}" for x in r["ratios"]), fmt(r["light_ttft_p50_s"], ".2f"),
          fmt(r["light_ttft_p90_s"], ".2f"), fmt(r["light_done_s"], ".2f"),
          fmt(r["light_share"], ".0%"), f"{r['completed']}/{r['requests']}"] for r in rows]))
    write_results("fair_share", {"benchmark": "fair_share", "model": MODEL,
                                 "simulate_profile": "llama3-8b-h100", "repeats": args.repeats,
                                 "heavy_per_gateway": heavy_each, "light_per_gateway": 2,
                                 "rows": rows, "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
