"""The gateway's Prometheus metrics, served at /metrics on its HTTP port.

vLLM's names wherever vLLM has the metric (so that its dashboards work unchanged), each with
a `model_name` label; `pagedkv_*` for our own. Three kinds of source:
- per request, observed on the API's loop as its deltas reach the client (`RequestObserver`):
  latencies, token counts, outcomes, prefix-cache queries and hits (counted once, at the
  request's first admission, and only with prefix caching on);
- per step, observed on the engine's thread (`observe_step`): the step's phases;
- the engines' state (queues, preemptions, health), read on the engine's loop at scrape
  time (`EngineSnapshot`), never from another thread mid-step; with each pool's blocks in
  use as its allocator last reported them (pool-wide: every gateway's requests and pinned
  prefixes; cached free blocks count as free, as in vLLM's `kv_cache_usage_perc`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.core.request_state import CompletionDelta, FinishReason, Request, SeqStatus
from gateway.engine.step_stats import StepRecord

disable_created_metrics()  # no `_created` series beside every counter (vLLM has none)

# vLLM's buckets, so that quantiles read the same on both.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                           40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)
STEP_PHASE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                      0.25, 0.5, 1.0, 2.5)
FINISHED_REASONS = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length",
                    FinishReason.ABORT: "abort"}


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """One engine's state at scrape time (taken on the engine loop)."""

    pool_id: str
    healthy: bool
    num_running: int  # requests with a running or swapped sequence
    num_waiting: int  # requests with only waiting sequences
    num_blocks_used: int  # the pool's, as its allocator last reported (0: not yet)
    num_blocks: int
    num_preemptions: int
    num_drafts: int = 0  # speculative decoding: rows drafted for, draft tokens, accepted
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


def snapshot(engine: object) -> EngineSnapshot:
    """Read on the engine's own loop: the queues are consistent there."""
    from gateway.engine.loop import Engine

    assert isinstance(engine, Engine)
    scheduler = engine.scheduler
    running = {s.request for s in (*scheduler.running, *scheduler.swapped)
               if s.status is not SeqStatus.FINISHED}
    waiting = {s.request for s in scheduler.waiting if not s.is_finished} - running
    num_blocks, num_free = engine.description.num_blocks, engine.num_free_blocks
    return EngineSnapshot(
        pool_id=engine.pool_id, healthy=engine.healthy, num_running=len(running),
        num_waiting=len(waiting),
        num_blocks_used=0 if num_free is None else num_blocks - num_free,
        num_blocks=num_blocks, num_preemptions=scheduler.num_preemptions,
        num_drafts=scheduler.num_drafts, num_draft_tokens=scheduler.num_draft_tokens,
        num_accepted_tokens=scheduler.num_accepted_tokens,
    )


@dataclass(slots=True, eq=False)  # hashable: the registry keys its collectors
class EngineCollector(Collector):
    """The engines' state as of the last snapshot (the /metrics handler takes one first)."""

    model_name: str
    engines: list[EngineSnapshot] = field(default_factory=list)
    num_lease_acquisitions: int = 0

    def collect(self) -> Iterator[Metric]:
        label, names = [self.model_name], ["model_name"]
        engines = self.engines
        for name, doc, value in (
            ("vllm:num_requests_running", "Requests running (or swapped out) on the executors",
             sum(e.num_running for e in engines)),
            ("vllm:num_requests_waiting", "Requests waiting for admission",
             sum(e.num_waiting for e in engines)),
            ("vllm:kv_cache_usage_perc", "Fraction of the executors' KV blocks in use by any "
             "request or pin, as the allocator last reported (1 = full)", _usage(engines)),
            ("pagedkv_executors_healthy", "Executors this gateway can route to",
             sum(e.healthy for e in engines)),
        ):
            gauge = GaugeMetricFamily(name, doc, labels=names)
            gauge.add_metric(label, value)
            yield gauge
        preemptions = CounterMetricFamily("vllm:num_preemptions", "Preemptions (recompute or "
                                          "swap) of running requests", labels=names)
        preemptions.add_metric(label, sum(e.num_preemptions for e in engines))
        yield preemptions
        for name, doc, value in (
            ("vllm:spec_decode_num_drafts", "Decode rows drafted for (speculative decoding)",
             sum(e.num_drafts for e in engines)),
            ("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed (speculative decoding)",
             sum(e.num_draft_tokens for e in engines)),
            ("vllm:spec_decode_num_accepted_tokens", "Draft tokens the executors accepted",
             sum(e.num_accepted_tokens for e in engines)),
        ):
            counter = CounterMetricFamily(name, doc, labels=names)
            counter.add_metric(label, value)
            yield counter
        pool_blocks = GaugeMetricFamily("pagedkv_pool_blocks_used", "KV blocks in use by any "
                                        "request or pin, per pool, as the allocator last "
                                        "reported", labels=[*names, "pool_id"])
        for e in engines:
            pool_blocks.add_metric([self.model_name, e.pool_id], e.num_blocks_used)
        yield pool_blocks
        leases = CounterMetricFamily("pagedkv_lease_acquisitions", "Allocator leases taken (more "
                                     "than one: a lease was lost and taken again)", labels=names)
        leases.add_metric(label, self.num_lease_acquisitions)
        yield leases


def _usage(engines: Iterable[EngineSnapshot]) -> float:
    engines = list(engines)
    total = sum(e.num_blocks for e in engines)
    return sum(e.num_blocks_used for e in engines) / total if total else 0.0


class GatewayMetrics:
    """Every gateway metric, in a registry of its own (tests start several gateways)."""

    def __init__(self, model_name: str, enable_prefix_caching: bool = True) -> None:
        self.model_name = model_name
        self.enable_prefix_caching = enable_prefix_caching
        self.registry = CollectorRegistry()
        self.engines = EngineCollector(model_name)
        self.registry.register(self.engines)
        labels = ["model_name"]

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, [*labels, *extra], registry=self.registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry)

        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens")
        self.request_success = counter("vllm:request_success", "Finished requests",
                                       ("finished_reason",))
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache (at a "
            "request's first admission)")
        self.prefix_hits = counter("vllm:prefix_cache_hits",
                                   "Of those, tokens found cached")
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token",
                              TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between tokens",
                             ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Request latency",
                             REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds",
                                    "Time from arrival to first admission",
                                    REQUEST_LATENCY_BUCKETS)
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens",
                                               "Prompt tokens per request", TOKEN_BUCKETS)
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Generated tokens per request", TOKEN_BUCKETS)
        self.step_phase = Histogram(
            "pagedkv_step_phase_seconds", "One step's phases: the allocator's Step round trip "
            "(allocate), the executor's forward pass and sampling (execute), and the rest of "
            "the step period (control_plane)", [*labels, "phase"],
            buckets=STEP_PHASE_BUCKETS, registry=self.registry)
        self._phases = {phase: self.step_phase.labels(model_name, phase)
                        for phase in ("allocate", "execute", "control_plane")}
        self.hand_offs = counter(
            "pagedkv_hand_offs", "Requests handed to another executor with their KV, by "
            "outcome: moved, refused (no target, or it said no), failed, gone (ended meanwhile)",
            ("outcome",))
        self.hand_off_time = histogram("pagedkv_hand_off_seconds",
                                       "A hand-off that moved: reservation and KV transfer",
                                       STEP_PHASE_BUCKETS)

    def observe_hand_off(self, outcome: str, seconds: float) -> None:
        """Engine thread, once per hand-off attempt."""
        self.hand_offs.labels(self.model_name, outcome).inc()
        if outcome == "moved":
            self.hand_off_time.labels(self.model_name).observe(seconds)

    def observe_step(self, step: StepRecord) -> None:
        """Engine thread, once per landed batch."""
        compute_ms = step.forward_ms + step.sample_ms
        self._phases["allocate"].observe(step.allocator_ms / 1000)
        self._phases["execute"].observe(compute_ms / 1000)
        self._phases["control_plane"].observe(
            max(step.period_ms - min(compute_ms, step.execute_ms), 0.0) / 1000)

    def observer(self, request: Request) -> RequestObserver:
        return RequestObserver(self, request)

    def render(self, engines: list[EngineSnapshot], num_lease_acquisitions: int) -> bytes:
        self.engines.engines = engines
        self.engines.num_lease_acquisitions = num_lease_acquisitions
        return generate_latest(self.registry)


@dataclass(slots=True)
class RequestObserver:
    """One request's latencies and counts, fed its deltas as the client receives them."""

    metrics: GatewayMetrics
    request: Request
    last_token_time: float | None = None
    num_generated: int = 0

    def on_delta(self, delta: CompletionDelta) -> None:
        if not delta.token_ids:
            return
        now = time.monotonic()
        m, label = self.metrics, self.metrics.model_name
        if self.last_token_time is None:
            m.ttft.labels(label).observe(now - self.request.arrival_time)
        else:
            m.itl.labels(label).observe(now - self.last_token_time)
        self.last_token_time = now
        self.num_generated += len(delta.token_ids)

    def on_end(self, reason: FinishReason | None) -> None:
        """The request left the gateway: finished (reason of its last completion), failed or
        cancelled (None: counted as abort)."""
        m, label, request = self.metrics, self.metrics.model_name, self.request
        now = time.monotonic()
        num_prompt = len(request.prompt_token_ids)
        m.generation_tokens.labels(label).inc(self.num_generated)
        m.request_success.labels(label, FINISHED_REASONS[reason or FinishReason.ABORT]).inc()
        if request.first_scheduled_time is not None:
            m.queue_time.labels(label).observe(request.first_scheduled_time - request.arrival_time)
        if request.num_cached_tokens is not None:  # it was admitted
            m.prompt_tokens.labels(label).inc(num_prompt)
            if m.enable_prefix_caching:
                m.prefix_queries.labels(label).inc(num_prompt)
                m.prefix_hits.labels(label).inc(request.num_cached_tokens)
        if reason is not None:
            m.e2e.labels(label).observe(now - request.arrival_time)
            m.request_prompt_tokens.labels(label).observe(num_prompt)
            m.request_generation_tokens.labels(label).observe(self.num_generated)
