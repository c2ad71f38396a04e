"""The fleet benchmark: the gateways' routing policies at fleet scale, on one machine.

    python -m bench.fleet [--quick | --full] [--policies exact,approx,round-robin]
    make bench-fleet                        (--quick: 16 executors, about 4 minutes)
    make bench-fleet BENCH_ARGS=--full      (64 executors, about 15 minutes)

One allocator, four gateways and 16 (--quick) or 64 (--full) simulated executors
(`executor_svc.simulated`: the executor contract without a model; each step sleeps
time_scale x the Llama-3-8B-on-H100 cost model's time), real subprocesses started by
tools.launch.Stack, a fresh fleet for each policy. One asyncio process (bench.fleet_client)
keeps thousands of streaming Generate calls in flight, closed loop, each sent to the next
gateway in turn as a load balancer would. The requests (bench.fleet_workload) come from
several tenants, each with a few long system prompts shared by many requests and a unique
suffix per request, with Zipf popularity; tenants are kept apart by cache salt. Every
policy serves the same request stream:

    exact        the allocator's exact prefix index (one MatchPrefix per request)
    approx       the gateway's own index of the pools' KV events, read --kv-events-lag-s apart
    round-robin  no prefix awareness

After a warm-up (the clients ramp up, the caches fill), over a measured window: the
prefix-cache hit rate (the allocator's counters; the clients' cached_prompt_tokens against
the most any router could get, every full system-prompt block a hit), TTFT and inter-token
latency as the clients see them (requests sent in the window), output tokens/s, Steps/s,
the allocator's Step and MatchPrefix p99 and the gateways' control-plane time per step
(their histograms, at bucket resolution), the busiest pool's share of prompt tokens
against the mean, and the CPU each kind of process used. At the window's end the clients
stop sending; once every request sent in the window has its first token (or after
--ttft-wait-s: those TTFTs are then lower bounds, counted as censored) the rest are
cancelled. Latencies are wall times: a step takes time_scale x its modelled GPU time.
Figures, not tests: this machine has 2 cores, shared by every process of the fleet.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import grpc
import psutil

from bench.common import RESULTS_DIR, markdown_table, write_results
from bench.fleet_client import Driver, api_key
from bench.fleet_metrics import Snapshot, gateways, take_snapshot
from bench.fleet_report import TABLE, plot, summarise, table_row
from bench.fleet_workload import TenantMix, iter_requests
from common.model_dirs import PRESETS_DIR
from pagedkv.gateway.v1 import gateway_pb2_grpc as gpb_grpc
from tools.flag_routing import service_flags
from tools.launch import Stack, StackSpec

POLICIES = ("exact", "approx", "round-robin")
MODEL = str(PRESETS_DIR / "small-llama")  # the gateways' tokenizer; vocabulary 32,000
BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class FleetConfig:
    num_executors: int
    num_gateways: int
    concurrency: int  # closed-loop clients
    ramp_s: float  # the clients start evenly over this
    warmup_s: float  # from the first request to the measured window (the ramp included)
    measure_s: float
    ttft_wait_s: float  # after the window, for the first tokens of the requests sent in it
    time_scale: float  # a simulated step takes this x its modelled time
    num_blocks: int  # per executor: short of all the system prompts, on purpose
    kv_events_lag_s: float
    api_keys: bool = False  # tenants as API keys (else as a cache_salt each)
    profile: str = "llama3-8b-h100"
    mix: TenantMix = TenantMix()
    seed: int = 0


# The KV-events lag is wall time: 0.5 s at time scale 8 is 62 ms of modelled time, as is
# 2 s at 32.
QUICK = FleetConfig(num_executors=16, num_gateways=4, concurrency=1024, ramp_s=5.0,
                    warmup_s=15.0, measure_s=30.0, ttft_wait_s=10.0, time_scale=8.0,
                    num_blocks=2048, kv_events_lag_s=0.5)
# Four times the fleet, the clients and the tenants at a quarter of the step rate each (the
# same CPU for the control plane); a request lives four times as long, so does the warm-up.
FULL = replace(QUICK, num_executors=64, concurrency=4096, ramp_s=20.0, warmup_s=80.0,
               measure_s=120.0, ttft_wait_s=40.0, time_scale=32.0, kv_events_lag_s=2.0,
               mix=TenantMix(num_tenants=32))


def routing_args(policy: str, lag_s: float) -> tuple[str, ...]:
    if policy == "approx":
        return ("--routing", "approx", "--kv-events-lag-s", f"{lag_s:g}")
    return ("--routing", policy)


def missing_routing(policy: str, lag_s: float) -> str | None:
    """Why this checkout's gateway cannot run `policy` (a flag or a choice it lacks), or
    None."""
    flags = service_flags()["gateway"]
    for flag in (a for a in routing_args(policy, lag_s) if a.startswith("--")):
        if flag not in flags:
            return f"the gateway has no {flag} flag"
    choices = flags["--routing"].choices
    if choices is not None and policy not in choices:
        return f"--routing takes {', '.join(map(str, choices))}, not {policy}"
    return None


@contextmanager
def fleet(config: FleetConfig, policy: str, log_dir: Path) -> Iterator[Stack]:
    """The allocator, the executors and the gateways, healthy; every process is stopped on
    the way out, whatever happens (an exception, Ctrl-C, SIGTERM)."""
    tenancy: tuple[str, ...] = ()
    if config.api_keys:
        keys = log_dir / "api-keys"
        keys.write_text("".join(f"{api_key(t)} tenant-{t}\n"
                                for t in range(config.mix.num_tenants)))
        tenancy = ("--api-keys-file", str(keys))
    stack = Stack(StackSpec(
        model=MODEL, num_executors=config.num_executors, log_dir=str(log_dir),
        executor_module="executor_svc.simulated",
        allocator_port=0, executor_port=0, gateway_port=0,
        allocator_args=("--log-level", "warning", "--max-pools", "256"),
        executor_args=("--simulate-profile", config.profile,
                       "--time-scale", f"{config.time_scale:g}",
                       "--num-blocks", str(config.num_blocks), "--log-level", "warning"),
        gateway_args=(*tenancy, "--log-level", "warning",
                      "--max-waiting", str(max(1024, config.concurrency)),
                      *routing_args(policy, config.kv_events_lag_s)),
    ))
    try:
        stack.start_backends()
        # Side by side: each start waits for its gateway's health (its tokenizer, its links).
        with ThreadPoolExecutor(config.num_gateways) as pool:
            list(pool.map(stack.start_gateway,
                          [f"gateway-{i}" for i in range(config.num_gateways)]))
        yield stack
    finally:
        # The gateways all at once (each ends its streams and frees its blocks), then the
        # rest in reverse start order.
        for service in gateways(stack):
            if service.process.poll() is None:
                service.process.send_signal(signal.SIGTERM)
        stack.stop()


async def drive(stack: Stack, config: FleetConfig,
                processes: dict[str, psutil.Process]) -> dict[str, Any]:
    """Ramp up, warm up, the measured window (a snapshot at each end), the first tokens of
    the window's requests; then the clients are cancelled."""
    channels = [grpc.aio.insecure_channel(g.address) for g in gateways(stack)]
    driver = Driver([gpb_grpc.GatewayServiceStub(c) for c in channels],
                    iter_requests(config.mix, vocab_size(), config.seed), config.api_keys,
                    BLOCK_SIZE)
    window_end = config.warmup_s + config.measure_s

    async def snapshot_at(at_s: float) -> Snapshot:
        await asyncio.sleep(max(0.0, at_s - driver.now()))
        return await asyncio.to_thread(take_snapshot, stack, processes, time.perf_counter())

    clients = [asyncio.create_task(driver.client(k * config.ramp_s / config.concurrency,
                                                 window_end))
               for k in range(config.concurrency)]
    progress = asyncio.create_task(driver.report_progress())
    try:
        before, after = await asyncio.gather(snapshot_at(config.warmup_s),
                                             snapshot_at(window_end))
        while (driver.waiting_for_first_token(window_end)
               and driver.now() < window_end + config.ttft_wait_s):
            await asyncio.sleep(0.2)
    finally:
        for task in [progress, *clients]:
            task.cancel()
        await asyncio.gather(progress, *clients, return_exceptions=True)
        for channel in channels:
            await channel.close()
    return summarise(driver, before, after)


def vocab_size() -> int:
    return int(json.loads((Path(MODEL) / "config.json").read_text())["vocab_size"])


def run_policy(config: FleetConfig, policy: str, log_dir: str | None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"pagedkv-fleet-{policy}-") as tmp:
        logs = Path(log_dir) / policy if log_dir else Path(tmp)
        logs.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        with fleet(config, policy, logs) as stack:
            start_s = time.perf_counter() - started
            processes = {s.name: psutil.Process(s.process.pid) for s in stack.services}
            processes["client"] = psutil.Process()
            row = asyncio.run(drive(stack, config, processes))
            stopping = time.perf_counter()
        return {"policy": policy, "start_s": round(start_s, 1),
                "stop_s": round(time.perf_counter() - stopping, 1), **row}


def interrupt(signum: int, frame: object) -> None:
    """SIGTERM as Ctrl-C: the fleet is stopped on the way out."""
    raise KeyboardInterrupt


def parse_config(argv: list[str] | None) -> tuple[argparse.Namespace, FleetConfig]:
    parser = argparse.ArgumentParser(prog="python -m bench.fleet", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="16 executors (the default)")
    size.add_argument("--full", action="store_true", help="64 executors")
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help="comma-separated routing policies, run in this order")
    for name, kind in (("num_executors", int), ("num_gateways", int), ("concurrency", int),
                       ("warmup_s", float), ("measure_s", float), ("ttft_wait_s", float),
                       ("time_scale", float), ("num_blocks", int),
                       ("kv_events_lag_s", float), ("seed", int)):
        parser.add_argument(f"--{name.replace('_', '-')}", type=kind,
                            help="instead of the size's (see FleetConfig)")
    parser.add_argument("--api-keys", action="store_true", default=None,
                        help="tenants as API keys (--api-keys-file), not a cache_salt each")
    parser.add_argument("--allow-missing", action="store_true",
                        help="skip a policy this gateway cannot run yet instead of failing")
    parser.add_argument("--name", help="results file name (fleet; --full: fleet_full)")
    parser.add_argument("--log-dir", help="keep the services' logs here (a folder a policy)")
    args = parser.parse_args(argv)
    overrides = {k: v for k, v in vars(args).items()
                 if k in FleetConfig.__dataclass_fields__ and v is not None}
    config = replace(FULL if args.full else QUICK, **overrides)
    args.name = args.name or ("fleet_full" if args.full else "fleet")
    args.policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    for policy in args.policies:
        problem = missing_routing(policy, config.kv_events_lag_s)
        if problem and not args.allow_missing:
            parser.error(f"{policy}: {problem} (--allow-missing skips it)")
    return args, config


def main(argv: list[str] | None = None) -> int:
    args, config = parse_config(argv)
    signal.signal(signal.SIGTERM, interrupt)
    started = time.perf_counter()
    rows, skipped = [], {}
    for policy in args.policies:
        if problem := missing_routing(policy, config.kv_events_lag_s):
            print(f"fleet: skipping {policy}: {problem}", flush=True)
            skipped[policy] = problem
            continue
        print(f"fleet: {policy}", flush=True)
        rows.append(run_policy(config, policy, args.log_dir))
        print({k: v for k, v in rows[-1].items()
               if not k.endswith(("_samples", "_series", "executors_busy"))},
              flush=True)
    elapsed = time.perf_counter() - started
    print(markdown_table(TABLE, [table_row(r) for r in rows]))
    print(f"{len(rows)} policies in {elapsed:.0f} s")
    write_results(args.name, {"config": asdict(config), "model": Path(MODEL).name,
                              "skipped": skipped, "total_s": round(elapsed, 1), "rows": rows})
    if rows:
        plot(rows, RESULTS_DIR / f"{args.name}.png")
    return 1 if any(r["failed"] for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
