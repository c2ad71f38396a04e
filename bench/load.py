"""Load generator for the gateway's public API (streaming Generate, or unary Complete with
`unary`), closed and open loop.

Closed loop: `concurrency` clients, each sends its next request when the last one finished.
Open loop: request i is sent at its `arrival_s` whatever the system's state (Poisson arrivals
come from `poisson_arrivals`). Every request is greedy, `ignore_eos`, `max_tokens` = its own
output length, so it stops at exactly that length. Times are recorded when the client sees
each streamed response (unary: first and last token both at the reply).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import tempfile
import time
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc

from bench.baselines import BenchRequest, RequestResult
from pagedkv.allocator.v1 import allocator_pb2 as apb
from pagedkv.allocator.v1 import allocator_pb2_grpc as apb_grpc
from pagedkv.gateway.v1 import gateway_pb2 as gpb
from pagedkv.gateway.v1 import gateway_pb2_grpc as gpb_grpc
from tools.launch import REPO_ROOT, Stack, StackSpec


def poisson_arrivals(count: int, rate_per_s: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(count):
        t += rng.expovariate(rate_per_s)
        out.append(t)
    return out


def _request(r: BenchRequest, salt: str = "") -> gpb.GenerateRequest:
    return gpb.GenerateRequest(
        token_ids=gpb.TokenIds(ids=r.prompt),
        sampling=gpb.SamplingParams(max_tokens=r.output_len, temperature=r.temperature,
                                    seed=r.seed if r.temperature else None, ignore_eos=True),
        cache_salt=salt, model=r.model,
    )


async def _one(stub: gpb_grpc.GatewayServiceStub, r: BenchRequest, res: RequestResult,
               origin: float, salt: str, timeout_s: float) -> None:
    res.sent_s = time.perf_counter() - origin
    try:
        async for response in stub.Generate(_request(r, salt), timeout=timeout_s):
            if response.token_ids:
                now = time.perf_counter() - origin
                if not res.tokens:
                    res.first_s = now
                res.tokens.extend(response.token_ids)
                res.last_s = now
    except grpc.aio.AioRpcError as exc:
        res.ok = False
        res.error = f"{exc.code().name}: {exc.details()}"
    if res.ok and len(res.tokens) != r.output_len:
        res.ok = False
        res.error = f"{len(res.tokens)} tokens, expected {r.output_len}"


async def _one_unary(stub: gpb_grpc.GatewayServiceStub, r: BenchRequest, res: RequestResult,
                     origin: float, salt: str, timeout_s: float) -> None:
    res.sent_s = time.perf_counter() - origin
    streamed = _request(r, salt)
    request = gpb.CompleteRequest(token_ids=streamed.token_ids, sampling=streamed.sampling,
                                  cache_salt=salt, model=streamed.model)
    try:
        reply = await stub.Complete(request, timeout=timeout_s)
    except grpc.aio.AioRpcError as exc:
        res.ok = False
        res.error = f"{exc.code().name}: {exc.details()}"
        return
    res.first_s = res.last_s = time.perf_counter() - origin
    res.tokens = list(reply.completions[0].token_ids)
    if len(res.tokens) != r.output_len:
        res.ok = False
        res.error = f"{len(res.tokens)} tokens, expected {r.output_len}"


async def _run(address: str, requests: Sequence[BenchRequest], concurrency: int | None,
               open_loop: bool, salt: str, timeout_s: float, progress: Any, unary: bool = False
               ) -> tuple[list[RequestResult], float]:
    results = [RequestResult() for _ in requests]
    options = [("grpc.max_receive_message_length", 64 << 20)]
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        stub = gpb_grpc.GatewayServiceStub(channel)
        origin = time.perf_counter()

        async def tracked(i: int) -> None:
            await (_one_unary if unary else _one)(stub, requests[i], results[i], origin, salt,
                                                  timeout_s)
            if progress is not None:
                progress.update(1)

        if open_loop:
            async def delayed(i: int) -> None:
                await asyncio.sleep(max(0.0, requests[i].arrival_s - (time.perf_counter()
                                                                       - origin)))
                await tracked(i)

            await asyncio.gather(*(delayed(i) for i in range(len(requests))))
        else:
            next_index = iter(range(len(requests)))

            async def client() -> None:
                for i in next_index:
                    await tracked(i)

            width = min(concurrency or len(requests), len(requests))
            await asyncio.gather(*(client() for _ in range(width)))
        return results, time.perf_counter() - origin


def run_load(address: str, requests: Sequence[BenchRequest], concurrency: int | None = None,
             open_loop: bool = False, salt: str = "", timeout_s: float = 900.0,
             progress: Any = None, unary: bool = False) -> tuple[list[RequestResult], float]:
    """Results in request order and the wall time of the whole run."""
    return asyncio.run(_run(address, requests, concurrency, open_loop, salt, timeout_s,
                            progress, unary))


def pool_stats(running: Stack) -> list[Any]:
    with running.internal_auth.channel(running.allocator_addr) as channel:
        stub = apb_grpc.AllocatorServiceStub(channel)
        return list(stub.GetStats(apb.GetStatsRequest(), timeout=10).pools)


@contextmanager
def stack(model: str, executor_args: Sequence[str] = (), gateway_args: Sequence[str] = (),
          seed: int = 0, log_dir: str | None = None, step_log: str | None = None,
          load_format: str = "dummy", gateway_tree: str | None = None,
          num_executors: int = 1, allocator_args: Sequence[str] = ()):
    """The real three services as subprocesses on free ports; stopped on exit.

    Dummy weights (seeded) by default, as the presets' baselines rebuild them; `auto` for a
    model directory with real weights.

    With `step_log`, the gateway appends one JSON line per executed step to that file (its
    engines' own timings, `--step-log`), and runs from `gateway_tree` when given (a checkout
    of another commit: its gateway and allocator, this tree's executor; a gateway
    from before `--step-log` runs as that tree's `python -m bench.cp_gateway`, which times
    it from outside). `read_steps` gives both in one form.
    """
    spec = StackSpec(
        model=model, allocator_port=0, executor_port=0, gateway_port=0,
        num_executors=num_executors, allocator_args=tuple(allocator_args),
        # float32 unless the caller names a dtype (a later flag wins): the figures in
        # bench/README.md are float32 ones, whatever `auto` picks on this CPU.
        executor_args=("--load-format", load_format, "--seed", str(seed), "--dtype", "float32",
                       *executor_args),
        gateway_args=tuple(gateway_args),
        log_dir=log_dir or tempfile.mkdtemp(prefix="pagedkv-bench-"),
    )
    running = Stack(spec)
    if gateway_tree and not _has_internal_auth(gateway_tree):
        # A tree from before the internal credentials: its services run open, and so must
        # this tree's executor.
        running.role_tokens = None
        spec = replace(spec, executor_args=(*spec.executor_args, "--insecure"))
        running.spec = spec
    if step_log is None:
        running.start()
    else:
        try:
            # Another checkout's gateway speaks its own allocator protocol: both come from it.
            running._start("allocator", "allocator_svc", 0, spec.allocator_args,
                           cwd=gateway_tree)
            running._start("executor-0", "executor_svc", 0, ("--model", model,
                                                             *spec.executor_args))
            for service in running.services:
                running._wait_healthy(service)
            module, extra = "gateway", ("--step-log", step_log)
            if gateway_tree and not _has_step_log(gateway_tree):
                os.environ["PAGEDKV_BENCH_STEP_LOG"] = step_log
                module, extra = "bench.cp_gateway", ()
            # A gateway with an HTTP API gets a free port for it (not 8000, which may be taken).
            http = _gateway_flag(gateway_tree or str(REPO_ROOT), "--http-port")
            gateway = running._start("gateway", module, 0, (
                "--allocator-addr", running.allocator_addr,
                "--executor-addrs", ",".join(running.executor_addrs()), "--model", model,
                *spec.gateway_args, *extra), cwd=gateway_tree,
                ports={"--http-port": 0} if http else None)
            running._wait_healthy(gateway)
        except BaseException:
            running.stop()
            raise
    try:
        yield running
    finally:
        running.stop()


def _has_internal_auth(tree: str) -> bool:
    return (Path(tree) / "common" / "credentials.py").exists()


def _has_step_log(tree: str) -> bool:
    return _gateway_flag(tree, "--step-log")


def _gateway_flag(tree: str, flag: str) -> bool:
    """Whether that checkout's gateway takes `flag`: named in its settings, as a string (before
    settings were declared once) or as the field it comes from (`--http-port`: `http_port:`)."""
    text = (Path(tree) / "gateway" / "settings.py").read_text()
    field = flag.removeprefix("--").replace("-", "_")
    return f'"{flag}"' in text or f"\n    {field}: " in text


# The gateway's own step records (gateway/engine/step_stats.py) under the short names the
# benchmarks use, which an older tree's outside timers (bench.cp_gateway) wrote directly.
_STEP_FIELDS = {"period_ms": "period", "schedule_ms": "sched", "allocator_ms": "alloc",
                "execute_ms": "exec", "forward_ms": "forward", "sample_ms": "sample",
                "executor_ms": "exec_total", "num_seqs": "seqs", "num_tokens": "num_tokens"}


def _short(record: dict[str, Any]) -> dict[str, float]:
    if "period_ms" not in record:
        return record  # an outside-timed record: already in these names
    short = {name: float(record[key]) for key, name in _STEP_FIELDS.items()}
    short["ahead"] = float(bool(record["ahead"]))
    short["total"] = short["period"]  # the engine's step is its period
    return short


def read_steps(step_log: str, offset: int = 0) -> tuple[list[dict[str, float]], int]:
    """Step records appended since `offset` (in the benchmarks' short names), and the new
    offset."""
    path = Path(step_log)
    if not path.exists():
        return [], offset
    with path.open() as handle:
        handle.seek(offset)
        text = handle.read()
    records = [_short(json.loads(line)) for line in text.splitlines() if line.strip()]
    return records, offset + len(text.encode())
