"""What a Python gRPC call costs on this machine, with nothing behind it (the floor under the
allocator's gRPC figures and the gateway's control plane).

    python -m bench.rpc_floor [--quick]

An echo servicer (bytes in, the same bytes out) runs in a subprocess; a sync client calls it.
- unary, back to back: the floor of one hot-path RPC;
- unary after a 20 ms pause: the same call when the server has slept, as the allocator and
  the executor do through every forward pass;
- both against the grpc.aio server (what the services run) and a sync server (one worker);
- a server-streaming call per client stream: the server's CPU per streamed message with 64
  streams each sent one message per 20 ms "step" (the gateway's cost per token streamed).
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import subprocess
import sys
import time
from concurrent import futures
from typing import Any

import grpc

from bench.common import markdown_table, percentile, write_results

PAYLOAD = b"x" * 100
STREAMS, STREAM_STEPS, STEP_S = 64, 50, 0.02
_identity = bytes


def _handlers(unary: Any, stream: Any) -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler("bench.Echo", {
        "Unary": grpc.unary_unary_rpc_method_handler(
            unary, request_deserializer=_identity, response_serializer=_identity),
        "Stream": grpc.unary_stream_rpc_method_handler(
            stream, request_deserializer=_identity, response_serializer=_identity),
    })


async def _serve_aio(port_file: str) -> None:
    queues: list[asyncio.Queue[bytes | None]] = []

    async def unary(request: bytes, context: Any) -> bytes:
        return request

    async def stream(request: bytes, context: Any) -> Any:
        queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        queues.append(queue)
        while (message := await queue.get()) is not None:
            yield message

    async def steps(count: int, stop: asyncio.Event) -> None:
        # Once every stream is open: one message each per step, server CPU measured.
        while len(queues) < count:
            await asyncio.sleep(0.01)
        before = resource.getrusage(resource.RUSAGE_SELF)
        for _ in range(STREAM_STEPS):
            for queue in queues:
                queue.put_nowait(PAYLOAD)
            await asyncio.sleep(STEP_S)
        after = resource.getrusage(resource.RUSAGE_SELF)
        cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
        print(f"stream_cpu_us {cpu / (count * STREAM_STEPS) * 1e6:.1f}", flush=True)
        for queue in queues:
            queue.put_nowait(None)
        stop.set()

    server = grpc.aio.server()
    server.add_generic_rpc_handlers((_handlers(unary, stream),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    stop = asyncio.Event()
    task = asyncio.create_task(steps(STREAMS, stop))
    with open(port_file, "w") as f:
        f.write(str(port))
    await stop.wait()
    await task
    await asyncio.sleep(0.5)
    await server.stop(1)


def _serve_sync(port_file: str) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    server.add_generic_rpc_handlers((_handlers(lambda request, context: request, None),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    with open(port_file, "w") as f:
        f.write(str(port))
    server.wait_for_termination()


def _start(kind: str, port_file: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, "-m", "bench.rpc_floor", "--serve", kind,
                             "--port-file", port_file], stdout=subprocess.PIPE, text=True)
    for _ in range(600):
        try:
            with open(port_file) as f:
                if port := f.read():
                    return proc, f"127.0.0.1:{port}"
        except FileNotFoundError:
            pass
        time.sleep(0.02)
    proc.kill()
    raise RuntimeError(f"the {kind} echo server did not start")


def _unary_ms(address: str, calls: int, pause_s: float) -> list[float]:
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary("/bench.Echo/Unary", request_serializer=_identity,
                                   response_deserializer=_identity)
        for _ in range(100):
            call(PAYLOAD)
        samples = []
        for _ in range(calls):
            if pause_s:
                time.sleep(pause_s)
            start = time.perf_counter()
            call(PAYLOAD)
            samples.append((time.perf_counter() - start) * 1e3)
    return samples


async def _read_streams(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.unary_stream("/bench.Echo/Stream", request_serializer=_identity,
                                    response_deserializer=_identity)

        async def read() -> int:
            return sum([1 async for _ in call(b"")])

        return sum(await asyncio.gather(*(read() for _ in range(STREAMS))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer calls")
    parser.add_argument("--serve", choices=["aio", "sync"], help=argparse.SUPPRESS)
    parser.add_argument("--port-file", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve == "aio":
        asyncio.run(_serve_aio(args.port_file))
        return
    if args.serve == "sync":
        _serve_sync(args.port_file)
        return
    import tempfile

    calls = {0.0: 500 if args.quick else 2000, 0.02: 100 if args.quick else 300}
    rows, results = [], {}
    stream_cpu_us = None
    for kind in ("aio", "sync"):
        with tempfile.TemporaryDirectory() as tmp:
            proc, address = _start(kind, f"{tmp}/port")
            try:
                for pause_s, count in calls.items():
                    samples = _unary_ms(address, count, pause_s)
                    p50, p99 = percentile(samples, 50), percentile(samples, 99)
                    label = f"after a {pause_s * 1e3:.0f} ms pause" if pause_s else "back to back"
                    results[f"{kind}_{'hot' if not pause_s else 'after_pause'}"] = {
                        "p50_ms": p50, "p99_ms": p99, "calls": count}
                    rows.append([f"unary echo, {kind} server, {label}", f"{p50:.3f} ms",
                                 f"{p99:.3f} ms"])
                if kind == "aio":
                    received = asyncio.run(_read_streams(address))
                    assert proc.stdout is not None
                    line = proc.stdout.readline().split()
                    stream_cpu_us = float(line[1]) if line[:1] == ["stream_cpu_us"] else None
                    results["stream_message_server_cpu_us"] = stream_cpu_us
                    results["stream_messages"] = received
            finally:
                proc.terminate()
                proc.wait(timeout=10)
    if stream_cpu_us is not None:
        rows.append([f"streamed message, aio server, {STREAMS} streams: server CPU",
                     f"{stream_cpu_us:.1f} us", ""])
    table = markdown_table(["measure", "p50", "p99"], rows)
    print(table)
    path = write_results("rpc_floor", {"quick": args.quick, "payload_bytes": len(PAYLOAD),
                                       "results": results, "table": table})
    print(f"\nwritten to {path}")


if __name__ == "__main__":
    main()
