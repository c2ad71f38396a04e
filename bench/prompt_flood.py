"""One heavy client against one light one: sixteen huge prompts and a 5-token request.

    .venv/bin/python -m bench.prompt_flood [--num-big 16] [--big-bytes 1048576]

Starts a stack (the default model's tokenizer, max_model_len 2,048, a simulated executor),
sends `--num-big` prompts of `--big-bytes` each at once (every one too long for the model),
and 0.2 s later a 5-token request; prints the big ones' wall time and codes, the small one's
latency, and the gateway's resident memory before and after (VmRSS, VmHWM: its peak).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from pagedkv.gateway.v1 import gateway_pb2 as gpb
from pagedkv.gateway.v1 import gateway_pb2_grpc as gpb_grpc
from tools.launch import Stack, StackSpec

ROOT = Path(__file__).resolve().parents[1]


def _memory_mib(pid: int) -> dict[str, float]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = round(int(value.split()[0]) / 1024, 1)
    return fields


def _big_prompt(num_bytes: int) -> str:
    corpus = (ROOT / "models" / "tokenizer_corpus.txt").read_text()
    return (corpus * (num_bytes // len(corpus) + 1))[:num_bytes]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-big", type=int, default=16)
    parser.add_argument("--big-bytes", type=int, default=1 << 20)
    args = parser.parse_args()
    log_dir = tempfile.mkdtemp(prefix="prompt-flood-")
    # The simulated executor (no model, a cost model's step time): what is measured is the
    # gateway, and the machine's cores stay with it.
    stack = Stack(StackSpec(allocator_port=0, executor_port=0, gateway_port=0, log_dir=log_dir,
                            executor_module="executor_svc.simulated",
                            executor_args=("--max-model-len", "2048"),
                            startup_timeout_s=300.0)).start()
    try:
        pid = stack.by_name("gateway").process.pid
        channel = grpc.insecure_channel(stack.gateway_addr, options=[
            ("grpc.max_send_message_length", 64 << 20)])
        stub = gpb_grpc.GatewayServiceStub(channel)
        sampling = gpb.SamplingParams(max_tokens=1, temperature=0.0)
        stub.Complete(gpb.CompleteRequest(text="Hello", sampling=sampling), timeout=60)  # warm
        before = _memory_mib(pid)
        big = _big_prompt(args.big_bytes)
        codes: list[str] = []
        lock = threading.Lock()

        def send_big() -> None:
            try:
                stub.Complete(gpb.CompleteRequest(text=big, sampling=sampling), timeout=300)
                code = "OK"
            except grpc.RpcError as exc:
                code = exc.code().name
            with lock:
                codes.append(code)

        start = time.perf_counter()
        with ThreadPoolExecutor(args.num_big) as pool:
            futures = [pool.submit(send_big) for _ in range(args.num_big)]
            time.sleep(0.2)
            small_start = time.perf_counter()
            stub.Complete(gpb.CompleteRequest(text="The capital of France is",
                                              sampling=sampling), timeout=300)
            small_s = time.perf_counter() - small_start
            for future in futures:
                future.result()
        wall_s = time.perf_counter() - start
        after = _memory_mib(pid)
        print(json.dumps({
            "num_big": args.num_big, "big_bytes": args.big_bytes,
            "big_codes": {c: codes.count(c) for c in sorted(set(codes))},
            "wall_s": round(wall_s, 2), "small_request_latency_s": round(small_s, 3),
            "gateway_rss_mib_before": before["VmRSS"], "gateway_rss_mib_after": after["VmRSS"],
            "gateway_peak_rss_mib": after["VmHWM"],
        }, indent=1))
        channel.close()
    finally:
        stack.stop()


if __name__ == "__main__":
    main()
