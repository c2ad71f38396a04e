"""Disaggregated prefill and decode: what moving each request, with its KV, from a prefill
executor to a decode executor does to latency, against the same two executors each doing both.

    python -m bench.disaggregation [--quick] [--rounds 2] [--time-scale 1]

Two simulated executors (`executor_svc.simulated`: a step sleeps time_scale x the cost model's
GPU time for Llama-3-8B on an H100, the hand-off's KV transfer its bytes over the modelled
link), one allocator, one gateway, real subprocesses (tools.launch). The same workload on two
layouts, interleaved round by round:

    colocated       both executors --role both; requests routed by cached prefix, then load
    disaggregated   executor 0 --role prefill, executor 1 --role decode (--prefill-executors 1)

The workload: `chat` requests (a short prompt, a long answer) from --chat-clients closed-loop
clients, and `long` requests (a long prompt, a short answer) arriving every --long-every-s,
open loop. A long prefill shares the executor's steps with the chat decodes when colocated
(chunked by --max-num-batched-tokens), which stretches their inter-token latency; separated,
the decode executor never computes a prompt. Reported, per layout, the median over rounds of:
chat inter-token latency p50 / p99 / max, TTFT p50 / p99 of each kind, output tokens/s, and
the hand-offs the gateway counted. The gap from a chat request's first token to its second is
reported apart: disaggregated, it holds the request's hand-off. Latencies are wall times as
the clients see them.
Figures, not tests: this machine has 2 cores, shared by every process.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import grpc

from bench.common import markdown_table, median, percentile, write_results
from common.model_dirs import PRESETS_DIR
from pagedkv.gateway.v1 import gateway_pb2 as gpb
from pagedkv.gateway.v1 import gateway_pb2_grpc as gpb_grpc
from tools.launch import Stack, StackSpec

MODEL = str(PRESETS_DIR / "small-llama")  # the gateway's tokenizer; vocabulary 32,000
LAYOUTS = ("colocated", "disaggregated")


@dataclass(frozen=True, slots=True)
class Workload:
    duration_s: float = 30.0
    warmup_s: float = 5.0
    chat_clients: int = 16
    chat_prompt: int = 256
    chat_output: int = 128
    long_every_s: float = 0.5
    long_prompt: int = 3500  # (the preset's max_model_len is 4,096)
    long_output: int = 8
    seed: int = 0


@dataclass(slots=True)
class Seen:
    """One request as its client saw it (seconds since the run's start)."""

    kind: str
    sent_s: float
    times: list[float] = field(default_factory=list)  # one per response with tokens
    error: str | None = None


def stack_spec(layout: str, log_dir: Path, time_scale: float, batched_tokens: int) -> StackSpec:
    return StackSpec(
        model=MODEL, num_executors=2, log_dir=str(log_dir),
        num_prefill_executors=1 if layout == "disaggregated" else 0,
        executor_module="executor_svc.simulated",
        allocator_port=0, executor_port=0, gateway_port=0,
        allocator_args=("--log-level", "warning"),
        executor_args=("--simulate-profile", "llama3-8b-h100", "--time-scale", f"{time_scale:g}",
                       "--log-level", "warning"),
        gateway_args=("--log-level", "warning", "--max-num-batched-tokens", str(batched_tokens)),
    )


class Driver:
    def __init__(self, address: str, workload: Workload) -> None:
        self.address = address
        self.workload = workload
        self.rng = random.Random(workload.seed)
        self.start = time.perf_counter()
        self.seen: list[Seen] = []

    def now(self) -> float:
        return time.perf_counter() - self.start

    def prompt(self, length: int) -> list[int]:
        return [self.rng.randrange(3, 32000) for _ in range(length)]  # unique: no prefix hits

    async def one(self, kind: str, prompt: list[int], output: int) -> None:
        seen = Seen(kind, self.now())
        self.seen.append(seen)
        request = gpb.GenerateRequest(
            token_ids=gpb.TokenIds(ids=prompt),
            sampling=gpb.SamplingParams(max_tokens=output, temperature=0.0, ignore_eos=True))
        try:
            async for response in self.stub.Generate(request, timeout=300):
                if response.token_ids:
                    seen.times.extend([self.now()] * len(response.token_ids))
        except grpc.aio.AioRpcError as exc:
            seen.error = f"{exc.code().name}: {exc.details()}"

    async def chat_client(self, stop_s: float) -> None:
        w = self.workload
        while self.now() < stop_s:
            await self.one("chat", self.prompt(w.chat_prompt), w.chat_output)

    async def long_arrivals(self, stop_s: float) -> None:
        w = self.workload
        pending: list[asyncio.Task[None]] = []
        while self.now() < stop_s:
            pending.append(asyncio.create_task(
                self.one("long", self.prompt(w.long_prompt), w.long_output)))
            await asyncio.sleep(w.long_every_s)
        await asyncio.gather(*pending)

    async def run(self) -> None:
        w = self.workload
        stop_s = w.warmup_s + w.duration_s
        async with grpc.aio.insecure_channel(self.address) as channel:  # (on this loop)
            self.stub = gpb_grpc.GatewayServiceStub(channel)
            self.start = time.perf_counter()
            await asyncio.gather(self.long_arrivals(stop_s),
                                 *(self.chat_client(stop_s) for _ in range(w.chat_clients)))


def hand_offs(stack: Stack) -> int:
    """The gateway's count of requests moved (pagedkv_hand_offs{outcome="moved"})."""
    port = stack.by_name("gateway").http_ports["--http-port"]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    found = re.search(r'pagedkv_hand_offs_total\{[^}]*outcome="moved"[^}]*\} (\S+)', text)
    return int(float(found.group(1))) if found else 0


def summarise(seen: list[Seen], workload: Workload) -> dict[str, Any]:
    """Requests sent after the warm-up."""
    window = [s for s in seen if s.sent_s >= workload.warmup_s]
    errors = [s.error for s in window if s.error]
    done = [s for s in window if s.times and not s.error]
    chat = [s for s in done if s.kind == "chat"]
    long = [s for s in done if s.kind == "long"]
    gaps = [(b - a) * 1e3 for s in chat for a, b in zip(s.times, s.times[1:], strict=False)]
    # The first gap holds a disaggregated request's hand-off (its first token came from the
    # prefill executor, the second from the decode one).
    second = [(s.times[1] - s.times[0]) * 1e3 for s in chat if len(s.times) > 1]
    span = max((s.times[-1] for s in done), default=0.0) - workload.warmup_s

    def ttft(group: list[Seen], q: float) -> float:
        return percentile([(s.times[0] - s.sent_s) * 1e3 for s in group], q) if group else 0.0

    return {
        "num_chat": len(chat), "num_long": len(long), "num_errors": len(errors),
        "errors": errors[:3],
        "chat_itl_p50_ms": percentile(gaps, 50) if gaps else 0.0,
        "chat_itl_p99_ms": percentile(gaps, 99) if gaps else 0.0,
        "chat_itl_max_ms": max(gaps, default=0.0),
        "chat_second_gap_p50_ms": percentile(second, 50) if second else 0.0,
        "chat_second_gap_p99_ms": percentile(second, 99) if second else 0.0,
        "chat_ttft_p50_ms": ttft(chat, 50), "chat_ttft_p99_ms": ttft(chat, 99),
        "long_ttft_p50_ms": ttft(long, 50), "long_ttft_p99_ms": ttft(long, 99),
        "output_tok_s": sum(len(s.times) for s in done) / span if span > 0 else 0.0,
    }


def run_layout(layout: str, workload: Workload, time_scale: float,
               batched_tokens: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"disagg-{layout}-") as log_dir:
        stack = Stack(stack_spec(layout, Path(log_dir), time_scale, batched_tokens)).start()
        try:
            driver = Driver(stack.gateway_addr, workload)
            asyncio.run(driver.run())
            result = summarise(driver.seen, workload)
            result["hand_offs"] = hand_offs(stack)
        finally:
            stack.stop()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="20 s windows, 8 chat clients")
    p.add_argument("--rounds", type=int, default=2, help="rounds (each layout once a round)")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="simulated step times x this (1: the cost model's own)")
    p.add_argument("--long-every-s", type=float, default=Workload().long_every_s,
                   help="seconds between two long requests")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="the gateway's step budget (a long prompt's chunk size)")
    args = p.parse_args()
    workload = Workload(duration_s=20.0, chat_clients=8) if args.quick else Workload()
    workload = replace(workload, long_every_s=args.long_every_s)
    runs: dict[str, list[dict[str, Any]]] = {layout: [] for layout in LAYOUTS}
    for round_index in range(args.rounds):
        for layout in LAYOUTS:
            result = run_layout(layout, workload, args.time_scale, args.max_num_batched_tokens)
            print(f"round {round_index + 1} {layout}: {result}", flush=True)
            runs[layout].append(result)
    keys = [k for k in runs[LAYOUTS[0]][0] if k != "errors"]
    medians = {layout: {k: median([r[k] for r in runs[layout]]) for k in keys}
               for layout in LAYOUTS}
    headers = ["layout", "chat ITL p50 / p99 / max ms", "first to second token p50 / p99 ms",
               "chat TTFT p50 / p99 ms",
               "long TTFT p50 / p99 ms", "output tok/s", "hand-offs"]
    rows = [[layout, f"{m['chat_itl_p50_ms']:.1f} / {m['chat_itl_p99_ms']:.1f} / "
             f"{m['chat_itl_max_ms']:.0f}",
             f"{m['chat_second_gap_p50_ms']:.1f} / {m['chat_second_gap_p99_ms']:.1f}",
             f"{m['chat_ttft_p50_ms']:.0f} / {m['chat_ttft_p99_ms']:.0f}",
             f"{m['long_ttft_p50_ms']:.0f} / {m['long_ttft_p99_ms']:.0f}",
             f"{m['output_tok_s']:.0f}", f"{m['hand_offs']:.0f}"]
            for layout, m in medians.items()]
    print(markdown_table(headers, rows))
    path = write_results("disaggregation", {
        "workload": asdict(workload),
        "time_scale": args.time_scale, "max_num_batched_tokens": args.max_num_batched_tokens,
        "rounds": runs, "medians": medians})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
