"""Allocation recording and offline replay: record a real run, replay it at other pool sizes,
block sizes and preemption modes, and measure what recording costs the allocator.

    python -m bench.allocation_replay [--quick] [--seconds 45] [--rate 4] [--recording PATH]

1. Record. The three services on the tiny-llama preset (dummy weights), the executor's pool at
   --num-blocks 512 (block 16), the allocator with --record-allocations; an open-loop Poisson
   workload through the gateway's streaming API: each prompt one of four shared system
   prompts (96 tokens; the first two drawn most) and a user part (log-normal, median 32,
   4-256), outputs log-normal (median 96, 8-384), greedy, ignore_eos. The allocator's own
   counters (GetStats) are read before the stack stops: the reference for the replay.
2. Replay (tools.replay, in this process): at the recorded configuration, at 100% / 25% / 12.5%
   of its tokens at block sizes 8, 16 and 32, swap at 12.5% (with as many CPU blocks), and the
   smallest pool that serves it without preemption at each block size; the replay's own
   speed (simulated steps/s). The same rows from the saved recording:
   python -m tools.replay bench/results/allocation_replay.jsonl.gz --block-size 8,16,32 \
       --num-blocks 100%,25%,12.5% --find-min-blocks (and --preemption-mode swap
       --num-blocks 12.5%)
3. Overhead. The servicer's Step in process, with and without a recorder, interleaved (the
   event loop thread's CPU time: wall time on this shared machine swings by 2x): a decode
   step at 32 and 256 running, and the step that frees a quarter of them and admits as many
   (their ends and admissions written); the Step round trip over gRPC at 256 running
   (bench.allocator_bench's), and one allocator under 32 pools at 50 Steps/s
   (bench.fleet_capacity's), each with and without PAGEDKV_RECORD_ALLOCATIONS.

Writes bench/results/allocation_replay.json (and the recording beside it, compressed).
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import logging
import os
import random
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import structlog

from allocator_svc.core.allocator import Allocator, Limits
from allocator_svc.recording import Recorder, RecordingSettings
from allocator_svc.service import AllocatorServicer
from bench.baselines import BenchRequest
from bench.common import RESULTS_DIR, markdown_table, median, write_results
from bench.load import poisson_arrivals, pool_stats, run_load
from bench.workloads import bounded_lognormal
from common.model_dirs import PRESETS_DIR
from pagedkv.allocator.v1 import allocator_pb2 as pb
from tools.launch import Stack, StackSpec
from tools.replay.search import find_min_blocks
from tools.replay.simulator import ReplayConfig, ReplayResult, replay
from tools.replay.trace import read_recording
from tools.replay.workload import Workload

MODEL = str(PRESETS_DIR / "tiny-llama")
NUM_BLOCKS, BLOCK_SIZE = 512, 16
SEED = 0
FIRST_ID, VOCAB = 3, 512


def make_requests(seconds: float, rate: float) -> list[BenchRequest]:
    rng = random.Random(SEED)
    systems = [[rng.randrange(FIRST_ID, VOCAB) for _ in range(96)] for _ in range(4)]
    arrivals = [t for t in poisson_arrivals(int(seconds * rate * 2), rate, SEED) if t < seconds]
    requests = []
    for arrival in arrivals:
        system = systems[min(3, int(rng.expovariate(1.0)))]
        user = [rng.randrange(FIRST_ID, VOCAB) for _ in range(bounded_lognormal(rng, 32, 0.8,
                                                                                 4, 256))]
        requests.append(BenchRequest(system + user, bounded_lognormal(rng, 96, 0.7, 8, 384),
                                     arrival))
    return requests


def record(path: Path, seconds: float, rate: float) -> dict[str, Any]:
    """A real run, recorded; the allocator's own counters for it."""
    requests = make_requests(seconds, rate)
    spec = StackSpec(model=MODEL, allocator_port=0, executor_port=0, gateway_port=0,
                     allocator_args=("--record-allocations", str(path)),
                     executor_args=("--load-format", "dummy", "--dtype", "float32",
                                    "--seed", str(SEED),
                                    "--num-blocks", str(NUM_BLOCKS), "--block-size",
                                    str(BLOCK_SIZE)),
                     log_dir=tempfile.mkdtemp(prefix="pagedkv-replay-bench-"))
    running = Stack(spec).start()
    try:
        results, wall = run_load(running.gateway_addr, requests, open_loop=True)
        (stats,) = pool_stats(running)
    finally:
        running.stop()  # SIGTERM: the recording's stop record
    failed = [r.error for r in results if not r.ok]
    assert not failed, f"{len(failed)} requests failed: {failed[:3]}"
    return {"num_requests": len(requests), "wall_s": wall,
            "output_tokens": sum(len(r.tokens) for r in results),
            "num_prefix_queries": stats.num_prefix_queries,
            "num_prefix_hits": stats.num_prefix_hits, "num_preemptions": stats.num_preemptions,
            "recording_bytes": path.stat().st_size}


def replays(path: Path) -> dict[str, Any]:
    trace = read_recording(str(path)).pools.popitem()[1]
    workload = Workload.from_trace(trace)
    shape = trace.shape
    base = ReplayConfig(shape.num_blocks, shape.block_size, "recompute", 0,
                        shape.prefix_caching, 256, 2048, trace.step_time)
    configs = [base]
    for block_size in (8, 16, 32):
        tokens = shape.num_blocks * shape.block_size
        for share in (1.0, 0.25, 0.125):
            num_blocks = round(share * tokens / block_size)
            configs.append(ReplayConfig(num_blocks, block_size, "recompute", 0, True, 256,
                                        2048, trace.step_time))
        eighth = round(0.125 * tokens / block_size)  # swap space as large (tools.replay's)
        configs.append(ReplayConfig(eighth, block_size, "swap", eighth, True, 256, 2048,
                                    trace.step_time))
    results: list[ReplayResult] = [replay(workload, configs[0])]
    results += [replay(workload, c) for c in configs[1:] if c != base]
    minimums = [find_min_blocks(workload, ReplayConfig(1, bs, "recompute", 0, True, 256, 2048,
                                                       trace.step_time)) for bs in (8, 16, 32)]
    return {"trace": trace, "results": results, "minimums": minimums}


class TimedRecorder(Recorder):
    """A recorder that counts the CPU time of its own part of each Step (its two hooks)."""

    spent_s = 0.0

    def before_step(self, pools: Any, pool_id: str, call: Any) -> Any:
        started = time.thread_time()
        try:
            return super().before_step(pools, pool_id, call)
        finally:
            self.spent_s += time.thread_time() - started

    def step(self, pool: Any, call: Any, result: Any, ending: Any) -> None:
        started = time.thread_time()
        super().step(pool, call, result, ending)
        self.spent_s += time.thread_time() - started


def servicer_step_us(num_running: int, recording: bool,
                     steps: int) -> tuple[float, float, float, float]:
    """Median us of the servicer's decode Step and of its churn Step (a quarter freed, as many
    admitted, every 64th step), in process: the event loop thread's CPU time (the recorder's
    writer thread runs apart); and, recording, the recorder's own share of each."""
    allocator = Allocator(Limits())
    own_decode: list[float] = []
    own_churn: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        recorder = (TimedRecorder.open(RecordingSettings(f"{tmp}/rec"), allocator.pools)
                    if recording else None)
        servicer = AllocatorServicer(allocator, recorder=recorder)
        loop = asyncio.new_event_loop()
        run = loop.run_until_complete
        lease = run(servicer.CreateLease(pb.CreateLeaseRequest(ttl_ms=600_000), None)).lease_id
        epoch = run(servicer.RegisterPool(pb.RegisterPoolRequest(
            pool_id="p", num_blocks=65536, block_size=BLOCK_SIZE, model_fingerprint="m",
            executor_instance_id="i", enable_prefix_caching=True), None)).pool.epoch
        ids = [f"gw/r{i}" for i in range(num_running)]

        def admit(new_ids: list[str], first: int) -> list[pb.StepItem]:
            return [pb.StepItem(request_id=r, num_tokens=128, prompt_token_ids=[
                *range(64), *range(1000 + 64 * (first + i), 1064 + 64 * (first + i))])
                for i, r in enumerate(new_ids)]

        run(servicer.Step(pb.StepRequest(pool_id="p", epoch=epoch, lease_id=lease, step_id=1,
                                         items=admit(ids, 0)), None))
        decode, churn, next_id = [], [], num_running
        for k in range(steps):
            fields: dict[str, Any] = {}
            if k % 64 == 63:
                quarter = num_running // 4
                freed, ids = ids[:quarter], ids[quarter:]
                new_ids = [f"gw/r{next_id + i}" for i in range(quarter)]
                fields = {"free_request_ids": freed, "items": admit(new_ids, next_id)}
                next_id += quarter
            request = pb.StepRequest(pool_id="p", epoch=epoch, lease_id=lease, step_id=k + 2,
                                     commit_through_step_id=k + 1, decode_request_ids=ids,
                                     append_request_ids=ids, append_token_ids=[k] * len(ids),
                                     **fields)
            if recorder is not None:
                recorder.spent_s = 0.0
            started = time.thread_time()  # CPU time: steady on a machine others share
            run(servicer.Step(request, None))
            (churn if fields else decode).append((time.thread_time() - started) * 1e6)
            if recorder is not None:
                (own_churn if fields else own_decode).append(recorder.spent_s * 1e6)
            if fields:
                ids = ids + new_ids
        if recorder is not None:
            recorder.close()
        loop.close()
    return (median(decode), median(churn), median(own_decode) if own_decode else 0.0,
            median(own_churn) if own_churn else 0.0)


def overhead(quick: bool) -> dict[str, Any]:
    from bench.allocator_bench import grpc_step_ms
    from bench.common import percentile

    repeats, steps = (3, 1024) if quick else (5, 4096)
    out: dict[str, Any] = {"in_process_us": {}}
    for n in (32, 256):
        samples: dict[bool, list[tuple[float, float, float, float]]] = {False: [], True: []}
        for _ in range(repeats):
            for recording in (False, True):
                samples[recording].append(servicer_step_us(n, recording, steps))
        out["in_process_us"][n] = {
            ("recording" if rec else "off"): {
                "decode": statistics.median(s[0] for s in runs),
                "churn": statistics.median(s[1] for s in runs),
                "recorder_decode": statistics.median(s[2] for s in runs),
                "recorder_churn": statistics.median(s[3] for s in runs)}
            for rec, runs in samples.items()}
    with tempfile.TemporaryDirectory() as tmp:
        grpc: dict[str, list[float]] = {"off": [], "recording": []}
        for _ in range(2):
            for mode in ("off", "recording"):
                if mode == "recording":
                    os.environ["PAGEDKV_RECORD_ALLOCATIONS"] = f"{tmp}/grpc.jsonl"
                try:
                    grpc[mode] += grpc_step_ms(256, 500 if quick else 2000)
                finally:
                    os.environ.pop("PAGEDKV_RECORD_ALLOCATIONS", None)
        out["grpc_step_ms_256"] = {mode: {"p50": percentile(s, 50), "p99": percentile(s, 99)}
                                   for mode, s in grpc.items()}
        out["fleet_32_pools"] = fleet(Path(tmp), 3.0 if quick else 5.0)
    return out


def fleet(tmp: Path, seconds: float) -> dict[str, Any]:
    import signal

    from bench.fleet_capacity import measure_fleet, start_allocator

    rows: dict[str, list[dict[str, Any]]] = {"off": [], "recording": []}
    for attempt in range(2):
        for mode in ("off", "recording"):
            workdir = tmp / f"{mode}-{attempt}"
            workdir.mkdir()
            if mode == "recording":
                os.environ["PAGEDKV_RECORD_ALLOCATIONS"] = str(tmp / f"fleet-{attempt}.jsonl")
            try:
                shard = start_allocator(workdir, 0, 1)
            finally:
                os.environ.pop("PAGEDKV_RECORD_ALLOCATIONS", None)
            try:
                row = measure_fleet([shard], 32, 50.0, 32, seconds)
            finally:
                shard[0].send_signal(signal.SIGTERM)
                shard[0].wait(timeout=30)
            rows[mode].append({k: row[k] for k in (
                "steps_per_s", "within_5ms_percent", "server_p50_ms_at_most",
                "server_p99_ms_at_most", "round_trip_p50_ms", "round_trip_p99_ms",
                "allocator_cpu_percent")})
    sizes = sorted(tmp.glob("fleet-*.jsonl"))
    return {"rows": rows, "recording_bytes_per_s": [p.stat().st_size / seconds for p in sizes]}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.allocation_replay",
                                     description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--seconds", type=float, default=45.0, help="the recorded run's length")
    parser.add_argument("--rate", type=float, default=4.0, help="requests per second")
    parser.add_argument("--skip-overhead", action="store_true")
    parser.add_argument("--recording", default=None,
                        help="replay this recording (e.g. the saved one) instead of recording")
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    seconds = 20.0 if args.quick else args.seconds
    recorded: dict[str, Any] | None = None
    if args.recording:
        replayed = replays(Path(args.recording))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "allocation_replay.jsonl"
            recorded = record(path, seconds, args.rate)
            replayed = replays(path)
            RESULTS_DIR.mkdir(parents=True, exist_ok=True)
            with path.open("rb") as raw, gzip.open(RESULTS_DIR / "allocation_replay.jsonl.gz",
                                                   "wb") as packed:
                shutil.copyfileobj(raw, packed)
    trace, results, minimums = replayed["trace"], replayed["results"], replayed["minimums"]
    run = trace.recorded
    rows = [["recorded", shape_row(trace), len(trace.requests), run.num_steps,
             f"{100 * run.peak_used_blocks / trace.shape.num_blocks:.1f}%",
             f"{100 * run.sum_used_blocks / max(run.num_steps, 1) / trace.shape.num_blocks:.1f}%",
             f"{100 * run.num_prefix_hits / max(run.num_prefix_queries, 1):.1f}%",
             run.num_preemptions, "-", "-", "-"]]
    for r in results:
        c = r.config
        rows.append(["replay", f"{c.num_blocks} x {c.block_size} ({c.preemption_mode})",
                     r.num_requests, r.num_steps, f"{100 * r.peak_utilization:.1f}%",
                     f"{100 * r.mean_utilization:.1f}%",
                     f"{100 * (r.hit_rate or 0):.1f}%", r.num_preemptions, r.num_swap_outs,
                     f"{r.wall_s:.2f}", f"{r.steps_per_s:,.0f}"])
    table = markdown_table(["run", "pool (blocks x size)", "requests", "steps", "peak used",
                            "mean used", "prefix hits", "preemptions", "swap-outs",
                            "replay s", "steps/s"], rows)
    min_table = markdown_table(
        ["block size", "smallest num_blocks without preemption", "tokens", "probes",
         "search s"],
        [[m.config.block_size, m.config.num_blocks, m.config.num_blocks * m.config.block_size,
          m.num_probes, f"{m.wall_s:.1f}"] for m in minimums])
    print(table, "\n", min_table, sep="\n")
    costs = None if args.skip_overhead else overhead(args.quick)
    if costs is not None:
        print(costs)
    write_results("allocation_replay", {
        "quick": args.quick, "seconds": seconds, "recording": args.recording,
        "rate": args.rate, "model": "tiny-llama",
        "num_blocks": NUM_BLOCKS, "block_size": BLOCK_SIZE, "recorded": recorded,
        "step_time": trace.step_time.describe(), "num_unfinished": trace.num_unfinished,
        "recorded_run": asdict(run),
        "replays": [{**asdict(r.config), "num_steps": r.num_steps, "sim_s": r.sim_s,
                     "peak_utilization": r.peak_utilization,
                     "mean_utilization": r.mean_utilization, "hit_rate": r.hit_rate,
                     "num_prefix_hits": r.num_prefix_hits,
                     "num_prefix_queries": r.num_prefix_queries,
                     "num_preemptions": r.num_preemptions, "num_swap_outs": r.num_swap_outs,
                     "wall_s": r.wall_s, "steps_per_s": r.steps_per_s} for r in results],
        "min_blocks": [{"block_size": m.config.block_size, "num_blocks": m.config.num_blocks,
                        "num_probes": m.num_probes, "wall_s": m.wall_s} for m in minimums],
        "overhead": costs, "table": table, "min_table": min_table,
    })


def shape_row(trace: Any) -> str:
    mode = "swap" if trace.swap else "recompute"
    return f"{trace.shape.num_blocks} x {trace.shape.block_size} ({mode})"


if __name__ == "__main__":
    main()
