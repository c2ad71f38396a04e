"""The fleet benchmark's clients: closed-loop streaming Generate calls over several gateways,
all on one asyncio event loop (grpc.aio), each request sent to the next gateway in turn as a
load balancer would (bench.fleet)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc

from bench.fleet_workload import FleetRequest
from pagedkv.gateway.v1 import gateway_pb2 as gpb
from pagedkv.gateway.v1 import gateway_pb2_grpc as gpb_grpc

REQUEST_TIMEOUT_S = 600.0


def api_key(tenant: int) -> str:
    return f"fleet-bench-tenant-{tenant:03d}-key"


@dataclass(slots=True)
class Outcome:
    """One request as its client saw it (times in seconds since the run's start)."""

    tenant: int
    num_prompt: int
    num_system_tokens: int  # its system prompt's full blocks: the most a cache can serve
    output_len: int
    sent_s: float
    first_s: float | None = None
    last_s: float | None = None
    num_tokens: int = 0
    num_cached: int | None = None  # usage.cached_prompt_tokens, on the final response
    error: str | None = None
    cut_s: float | None = None  # when the benchmark cancelled it, the window's TTFTs all in


@dataclass(slots=True)
class Driver:
    """`api_keys`: each tenant calls with its own API key (the gateways derive its cache
    salt); otherwise each request carries its tenant's name as its cache_salt."""

    stubs: list[gpb_grpc.GatewayServiceStub]
    requests: Iterator[FleetRequest]
    api_keys: bool
    block_size: int
    origin: float = field(default_factory=time.perf_counter)
    outcomes: list[Outcome] = field(default_factory=list)
    tokens_per_s: list[int] = field(default_factory=list)  # received in each second of the run
    num_sent: int = 0

    def now(self) -> float:
        return time.perf_counter() - self.origin

    async def client(self, start_after_s: float, stop_at_s: float) -> None:
        """Send one request after another until `stop_at_s` (the run's clock)."""
        await asyncio.sleep(start_after_s)
        while self.now() < stop_at_s:
            gateway = self.num_sent % len(self.stubs)
            self.num_sent += 1
            await self.one(self.stubs[gateway], next(self.requests))

    async def one(self, stub: gpb_grpc.GatewayServiceStub, r: FleetRequest) -> None:
        out = Outcome(r.tenant, len(r.system) + len(r.suffix),
                      len(r.system) // self.block_size * self.block_size, r.output_len,
                      self.now())
        self.outcomes.append(out)
        request = gpb.GenerateRequest(
            token_ids=gpb.TokenIds(ids=r.prompt),
            sampling=gpb.SamplingParams(max_tokens=r.output_len, temperature=0.0,
                                        ignore_eos=True),
            cache_salt="" if self.api_keys else f"tenant-{r.tenant}")
        metadata = (("authorization", f"Bearer {api_key(r.tenant)}"),) if self.api_keys else ()
        try:
            async for response in stub.Generate(request, metadata=metadata,
                                                timeout=REQUEST_TIMEOUT_S):
                if response.token_ids:
                    self._received(out, len(response.token_ids))
                if response.HasField("usage"):
                    out.num_cached = response.usage.cached_prompt_tokens
        except grpc.aio.AioRpcError as exc:
            out.error = f"{exc.code().name}: {exc.details()}"
        except asyncio.CancelledError:
            out.cut_s = self.now()
            raise
        if out.error is None and out.num_tokens != r.output_len:
            out.error = f"{out.num_tokens} tokens, expected {r.output_len}"

    def _received(self, out: Outcome, num: int) -> None:
        now = self.now()
        if out.first_s is None:
            out.first_s = now
        out.last_s = now
        out.num_tokens += num
        second = int(now)
        while len(self.tokens_per_s) <= second:
            self.tokens_per_s.append(0)
        self.tokens_per_s[second] += num

    def waiting_for_first_token(self, sent_before_s: float) -> int:
        return sum(o.first_s is None and o.error is None and o.sent_s < sent_before_s
                   for o in self.outcomes)

    async def report_progress(self, every_s: float = 5.0) -> None:
        while True:
            await asyncio.sleep(every_s)
            done = sum(o.num_cached is not None for o in self.outcomes)
            print(f"  at {self.now():.0f} s: {self.num_sent} sent, {done} done, "
                  f"{sum(self.tokens_per_s):,} tokens", flush=True)
