"""`python -m bench.cp_gateway`: the real gateway, with per-step timers (control-plane bench).

Same flags as `python -m gateway`. Before the gateway starts, this wraps (without changing
what they do) the engine's step, the scheduler's three phases, the two clients' calls and the
protobuf encoders/decoders of the two hot-path RPCs, and appends one JSON line per executed
step to $PAGEDKV_BENCH_STEP_LOG:

    total      Engine.step: scheduling, the Step, the previous batch's return and tokens
               (pipelined: it was launched by the step before), the next Execute sent
    sched      Scheduler.schedule + apply_outcome + apply_result
    alloc      AllocatorClient.step (message building, the Step RPC, response conversion)
    exec       ExecutorClient.execute (the same for Execute)
    ser_alloc, ser_exec   protobuf encode of the request + decode of the response (gateway side)
    forward, sample, exec_total   the executor's own report (Timings)
    seqs       sequences in the Execute call whose response this step decoded
    ahead      1 when that Execute was launched ahead (before the one before it returned):
               then its round trip includes the wait for that one
    period     ms between this Execute response's arrival and the previous one's: busy, the
               executor's period, whatever the gateway overlaps with what
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections import deque
from typing import Any

from gateway.clients import allocator_client, executor_client
from gateway.core.scheduler import Scheduler
from gateway.engine import landing
from gateway.engine.loop import Engine
from pagedkv.allocator.v1 import allocator_pb2 as apb
from pagedkv.executor.v1 import executor_pb2 as epb

_current: dict[str, Any] = {}
# (size, launched ahead) of the batches whose Execute is out, oldest first
_launched: deque[tuple[int, bool]] = deque()
_log = None
_last_arrival: list[float] = []  # when the previous Execute response arrived


def _add(key: str, seconds: float) -> None:
    _current[key] = _current.get(key, 0.0) + seconds * 1e3


def _timed_sync(fn: Any, key: str) -> Any:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _add(key, time.perf_counter() - t0)

    return wrapper


def _timed_async(fn: Any, key: str) -> Any:
    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return await fn(*args, **kwargs)
        finally:
            _add(key, time.perf_counter() - t0)

    return wrapper


def _encoder(key: str) -> Any:
    def encode(message: Any) -> bytes:
        t0 = time.perf_counter()
        data = message.SerializeToString()
        _add(key, time.perf_counter() - t0)
        return data

    return encode


def _decoder(cls: Any, key: str, report: bool) -> Any:
    def decode(data: bytes) -> Any:
        t0 = time.perf_counter()
        message = cls.FromString(data)
        _add(key, time.perf_counter() - t0)
        if report:
            if _last_arrival:
                _current["period"] = (t0 - _last_arrival[0]) * 1e3
            _last_arrival[:] = [t0]
            _current["seqs"], ahead = _launched.popleft() if _launched else (0, False)
            _current["ahead"] = int(ahead)
            _current["forward"] = message.timings.forward_ms
            _current["sample"] = message.timings.sample_ms
            _current["exec_total"] = message.timings.total_ms
            _current["num_tokens"] = message.num_tokens
        return message

    return decode


def _patch_stub_init(client_cls: Any, attr: str, path: str, response_cls: Any, key: str,
                     report: bool) -> None:
    original = client_cls.__init__

    @functools.wraps(original)
    def init(self: Any, address: str, *args: Any, **kwargs: Any) -> None:
        original(self, address, *args, **kwargs)
        setattr(self.stub, attr, self.channel.unary_unary(
            path, request_serializer=_encoder(key),
            response_deserializer=_decoder(response_cls, key, report)))

    client_cls.__init__ = init


def install() -> None:
    global _log
    _log = open(os.environ["PAGEDKV_BENCH_STEP_LOG"], "a", buffering=1)  # noqa: SIM115
    for name in ("schedule", "apply_outcome", "apply_result"):
        setattr(Scheduler, name, _timed_sync(getattr(Scheduler, name), "sched"))
    allocator_client.AllocatorClient.step = _timed_async(allocator_client.AllocatorClient.step,
                                                         "alloc")
    executor_client.ExecutorClient.execute = _timed_async(
        executor_client.ExecutorClient.execute, "exec")
    _patch_stub_init(allocator_client.AllocatorClient, "Step",
                     "/pagedkv.allocator.v1.AllocatorService/Step", apb.StepResponse,
                     "ser_alloc", report=False)
    _patch_stub_init(executor_client.ExecutorClient, "Execute",
                     "/pagedkv.executor.v1.ExecutorService/Execute", epb.ExecuteResponse,
                     "ser_exec", report=True)
    original_step = Engine.step
    original_launch = landing.launch

    def launch(engine: Any, batch: Any) -> Any:
        # Pipelined, a batch launched in one step returns in the next: its size travels
        # with it to the step that decodes its response.
        _launched.append((batch.call.num_seqs, bool(engine.in_flight)))
        return original_launch(engine, batch)

    landing.launch = launch

    async def step(self: Any) -> bool:
        _current.clear()
        t0 = time.perf_counter()
        result = await original_step(self)
        total = (time.perf_counter() - t0) * 1e3
        if "forward" in _current:  # an executed step
            _current["total"] = total
            _log.write(json.dumps({k: round(v, 4) for k, v in _current.items()}) + "\n")
        return result

    Engine.step = step


def main() -> None:
    import asyncio

    from gateway.__main__ import main as gateway_main

    install()
    asyncio.run(gateway_main())


if __name__ == "__main__":
    main()
