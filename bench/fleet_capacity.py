"""One allocator's capacity: how many executor pools, each stepping at --rate steps/s with
--batch running decodes, one allocator process carries with its p99 Step latency under 5 ms;
and, with --shards, the same fleet split across allocator shards.

    python -m bench.fleet_capacity [--quick] [--rate 50] [--batch 32] [--shards 1,2]

Each pool is driven as a gateway's engine drives one executor: register the pool, admit
`batch` requests of 128 prompt tokens, then one numbered Step every 1/rate s with every request
decoding (compact columns, commit_through the step before); every 64 steps a quarter of the
requests are freed and as many new ones admitted, so frees, admissions and prefix lookups ride
along. The pools step concurrently from one asyncio driver process (grpc.aio, its own cores
permitting); the allocator is a real subprocess with its own lease sweeper and metrics off.
For each fleet size: offered and achieved Steps/s, items/s (decode rows + admissions), the
share of Steps the allocator served within 5 ms and its p50/p99 (its own per-RPC histogram,
pagedkv_rpc_duration_seconds: handler time, at bucket resolution), the round trip as the
driver sees it (its own event loop's delays included: an upper bound), and the allocator
process's CPU. Sharded (--shards N), N allocators run with --num-shards N, each pool goes to
the shard its id hashes to (common/sharding.py), and each shard gets a driver process of its
own: the figures are the shards' sums (Steps within 5 ms and CPU: per shard). Figures, not
tests: this machine has 2 cores, shared by the drivers and the allocators.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import httpx
import psutil

from bench.common import machine, markdown_table, percentile, write_results
from common.sharding import shard_of
from pagedkv.allocator.v1 import allocator_pb2 as pb
from pagedkv.allocator.v1 import allocator_pb2_grpc

BLOCK_SIZE = 16
PROMPT_LEN = 128
CHURN_EVERY = 64
P99_BUDGET_MS = 5.0


def start_allocator(tmp: Path, shard: int = 0,
                    num_shards: int = 1) -> tuple[subprocess.Popen[bytes], str, str]:
    port_file, metrics_file = tmp / f"port-{shard}", tmp / f"metrics-port-{shard}"
    process = subprocess.Popen(
        [sys.executable, "-m", "allocator_svc", "--host", "127.0.0.1", "--port", "0",
         "--port-file", str(port_file), "--log-level", "warning", "--insecure",
         "--metrics-port", "0", "--metrics-port-file", str(metrics_file),
         "--max-pools", "1024", "--max-batch-items", "4096",
         # Each fleet size re-registers the pools with a new instance id (a reset): there
         # are no executors to confirm it with.
         "--verify-pool-resets", "false",
         "--num-shards", str(num_shards), "--shard-index", str(shard)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not (port_file.exists() and port_file.read_text()
               and metrics_file.exists() and metrics_file.read_text()):
        assert process.poll() is None, "the allocator exited at start"
        time.sleep(0.05)
    return (process, f"127.0.0.1:{port_file.read_text().strip()}",
            f"http://127.0.0.1:{metrics_file.read_text().strip()}/metrics")


def step_buckets(metrics_url: str) -> dict[float, float]:
    """The allocator's cumulative Step latency histogram: upper bound (s) -> count."""
    from prometheus_client.parser import text_string_to_metric_families

    buckets = {}
    for family in text_string_to_metric_families(httpx.get(metrics_url, timeout=10).text):
        for sample in family.samples:
            if (sample.name == "pagedkv_rpc_duration_seconds_bucket"
                    and sample.labels.get("method") == "Step"):
                buckets[float(sample.labels["le"])] = sample.value
    return buckets


def served_within(before: dict[float, float], after: dict[float, float]) -> dict[str, Any]:
    """Between two scrapes: the share of Steps within the budget, and p50/p99 as the upper
    bound of the bucket that holds them."""
    counts = {le: after[le] - before.get(le, 0.0) for le in sorted(after)}
    total = counts[float("inf")] or 1.0

    def quantile(q: float) -> float:
        return next(le for le, n in counts.items() if n >= q * total) * 1e3

    return {"within_5ms_percent": round(100 * counts[P99_BUDGET_MS / 1e3] / total, 2),
            "server_p50_ms_at_most": quantile(0.5), "server_p99_ms_at_most": quantile(0.99)}


class PoolDriver:
    """One executor's pool, stepped as a gateway's engine steps it."""

    def __init__(self, stub: Any, lease_id: str, pool_id: str, batch: int, run: str,
                 num_shards: int) -> None:
        self.stub, self.lease_id, self.batch, self.run_name = stub, lease_id, batch, run
        self.num_shards = num_shards
        self.pool_id = pool_id
        self.epoch = 0
        self.step_id = 0
        self.next_id = 0
        self.running: list[str] = []
        self.latencies_ms: list[float] = []
        self.items = 0

    async def register(self) -> None:
        pool = (await self.stub.RegisterPool(pb.RegisterPoolRequest(
            pool_id=self.pool_id, num_blocks=self.batch * 64, block_size=BLOCK_SIZE,
            model_fingerprint="fleet-bench", executor_instance_id=self.run_name,
            enable_prefix_caching=True, num_shards=self.num_shards))).pool
        self.epoch = pool.epoch
        await self._step(admit=self.batch)

    def _prompt(self, number: int) -> list[int]:
        # A shared 64-token system prompt, then the request's own tokens.
        return [*range(64), *(1000 + (number * 7 + i) % 5000 for i in range(PROMPT_LEN - 64))]

    async def _step(self, admit: int = 0, free: int = 0, timed: bool = False) -> None:
        freed, self.running = self.running[:free], self.running[free:]
        new = [f"{self.pool_id}-r{self.next_id + i}" for i in range(admit)]
        items = [pb.StepItem(request_id=r, prompt_token_ids=self._prompt(self.next_id + i),
                             num_tokens=PROMPT_LEN) for i, r in enumerate(new)]
        self.next_id += admit
        self.step_id += 1
        request = pb.StepRequest(
            pool_id=self.pool_id, epoch=self.epoch, lease_id=self.lease_id,
            step_id=self.step_id, commit_through_step_id=self.step_id - 1,
            free_request_ids=freed, items=items, decode_request_ids=self.running,
            append_request_ids=self.running,
            append_token_ids=[self.step_id % 1000] * len(self.running))
        started = time.perf_counter()
        await self.stub.Step(request)
        if timed:
            self.latencies_ms.append((time.perf_counter() - started) * 1e3)
            self.items += len(self.running) + len(items)
        self.running += new

    async def run(self, rate: float, until: float, measure_from: float) -> None:
        period = 1.0 / rate
        next_at = time.monotonic()
        while next_at < until:
            churn = self.batch // 4 if self.step_id % CHURN_EVERY == 0 else 0
            await self._step(admit=churn, free=churn, timed=next_at >= measure_from)
            next_at += period
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))


def pool_ids(num_pools: int, shard: int, num_shards: int) -> list[str]:
    """The fleet's pools that hash to `shard`."""
    return [pool_id for pool_id in (f"executor-{i}" for i in range(num_pools))
            if shard_of(pool_id, num_shards) == shard]


async def measure(address: str, metrics_url: str, pools: list[str], rate: float, batch: int,
                  seconds: float, allocator_pid: int, run: str,
                  num_shards: int) -> dict[str, Any]:
    """Drive `pools` at one allocator (one shard) and measure it."""
    allocator = psutil.Process(allocator_pid)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = allocator_pb2_grpc.AllocatorServiceStub(channel)
        lease_id = (await stub.CreateLease(pb.CreateLeaseRequest(ttl_ms=600_000))).lease_id
        drivers = [PoolDriver(stub, lease_id, pool_id, batch, run, num_shards)
                   for pool_id in pools]
        for driver in drivers:
            await driver.register()
        warm_until = time.monotonic() + 1.0
        await asyncio.gather(*(d.run(rate, warm_until, float("inf")) for d in drivers))
        before = await asyncio.to_thread(step_buckets, metrics_url)
        allocator.cpu_percent()
        window_start = time.monotonic()
        await asyncio.gather(*(d.run(rate, window_start + seconds, 0.0) for d in drivers))
        window = time.monotonic() - window_start  # longer than asked when the driver lags
        cpu = allocator.cpu_percent()
        after = await asyncio.to_thread(step_buckets, metrics_url)
        latencies = [x for d in drivers for x in d.latencies_ms]
        return {
            "pools": len(pools), "offered_steps_per_s": round(len(pools) * rate),
            "steps_per_s": round(len(latencies) / window),
            "items_per_s": round(sum(d.items for d in drivers) / window),
            **served_within(before, after),
            "round_trip_p50_ms": round(percentile(latencies, 50), 2),
            "round_trip_p99_ms": round(percentile(latencies, 99), 2),
            "allocator_cpu_percent": round(cpu),
            "latencies_ms": latencies,
        }


def _measure_in_process(args: tuple[Any, ...]) -> dict[str, Any]:
    return asyncio.run(measure(*args))


def measure_fleet(shards: list[tuple[subprocess.Popen[bytes], str, str]], num_pools: int,
                  rate: float, batch: int, seconds: float) -> dict[str, Any]:
    """The fleet split across the shards, a driver process per shard (one: in this process)."""
    run = f"fleet-{len(shards)}-{num_pools}"
    jobs = [(address, metrics_url, pool_ids(num_pools, index, len(shards)), rate, batch,
             seconds, process.pid, run, len(shards))
            for index, (process, address, metrics_url) in enumerate(shards)]
    if len(jobs) == 1:
        parts = [_measure_in_process(jobs[0])]
    else:
        with multiprocessing.get_context("spawn").Pool(len(jobs)) as workers:
            parts = workers.map(_measure_in_process, jobs)
    latencies = [x for part in parts for x in part.pop("latencies_ms")]
    steps = sum(part["steps_per_s"] for part in parts) or 1
    return {
        "shards": len(shards), "pools": num_pools, "offered_steps_per_s": round(num_pools * rate),
        "steps_per_s": sum(part["steps_per_s"] for part in parts),
        "items_per_s": sum(part["items_per_s"] for part in parts),
        "within_5ms_percent": round(sum(part["within_5ms_percent"] * part["steps_per_s"]
                                        for part in parts) / steps, 2),
        "server_p50_ms_at_most": max(part["server_p50_ms_at_most"] for part in parts),
        "server_p99_ms_at_most": max(part["server_p99_ms_at_most"] for part in parts),
        "round_trip_p50_ms": round(percentile(latencies, 50), 2),
        "round_trip_p99_ms": round(percentile(latencies, 99), 2),
        "allocator_cpu_percent": [part["allocator_cpu_percent"] for part in parts],
        "per_shard": parts,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fleet_capacity", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="5 s per fleet size, fewer sizes")
    parser.add_argument("--rate", type=float, default=50.0, help="Steps/s per pool")
    parser.add_argument("--batch", type=int, default=32, help="running requests per pool")
    parser.add_argument("--shards", default="1",
                        help="comma-separated allocator shard counts to measure, e.g. 1,2")
    args = parser.parse_args(argv)
    shard_counts = [int(n) for n in args.shards.split(",")]
    sizes = [4, 8, 16, 32, 64] if args.quick else [4, 8, 16, 24, 32, 48, 64, 96, 128]
    seconds = 5.0 if args.quick else 15.0
    rows = []
    for num_shards in shard_counts:
        with tempfile.TemporaryDirectory() as tmp:
            shards = [start_allocator(Path(tmp), i, num_shards) for i in range(num_shards)]
            try:
                for size in sizes:
                    if size < num_shards:
                        continue
                    row = measure_fleet(shards, size, args.rate, args.batch, seconds)
                    rows.append(row)
                    print({k: v for k, v in row.items() if k != "per_shard"}, flush=True)
                    if row["steps_per_s"] < 0.9 * row["offered_steps_per_s"]:
                        break  # saturated: the next size only queues more
            finally:
                for process, _, _ in shards:
                    process.send_signal(signal.SIGTERM)
                for process, _, _ in shards:
                    process.wait(timeout=15)
    carried = {n: max((r["pools"] for r in rows if r["shards"] == n
                       and r["within_5ms_percent"] >= 99.0
                       and r["steps_per_s"] >= 0.95 * r["offered_steps_per_s"]), default=0)
               for n in shard_counts}
    print(markdown_table(
        ["shards", "pools", "offered Steps/s", "Steps/s", "items/s",
         "Steps within 5 ms (allocator)", "allocator p99 <=", "round trip p50 / p99 ms",
         "allocator CPU % (per shard)"],
        [[r["shards"], r["pools"], r["offered_steps_per_s"], r["steps_per_s"], r["items_per_s"],
          f"{r['within_5ms_percent']}%", f"{r['server_p99_ms_at_most']:g} ms",
          f"{r['round_trip_p50_ms']} / {r['round_trip_p99_ms']}",
          " / ".join(str(c) for c in r["allocator_cpu_percent"])] for r in rows]))
    for n, pools in carried.items():
        print(f"{n} shard(s): pools carried at {args.rate:g} Steps/s with p99 <= "
              f"{P99_BUDGET_MS} ms: {pools}")
    write_results("fleet_capacity", {"machine": machine(), "rate": args.rate,
                                     "batch": args.batch, "quick": args.quick, "rows": rows,
                                     "max_pools_within_budget": carried})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
