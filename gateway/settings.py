"""The gateway's typed configuration: flags with PAGEDKV_* environment equivalents."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

from common.config import add_flag, parse_bool
from common.credentials import (
    CredentialsError,
    InternalAuth,
    add_internal_auth_flags,
    internal_auth_from_args,
)
from common.model_dirs import DEFAULT_MODEL
from common.sharding import MAX_SHARDS
from gateway.clients.discovery import (
    Discovery,
    DnsAddresses,
    FileAddresses,
    StaticAddresses,
    split_host_port,
)

PREEMPTION_MODES = ("recompute", "swap")
ROUTING_POLICIES = ("exact", "approx", "round-robin")  # gateway/engine/router.py
# A beam needs its 2 x beam_width most likely next tokens; executors return at most 20.
MAX_BEAM_WIDTH = 10


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    """Everything the gateway is configured with; validated once at start."""

    host: str
    port: int
    port_file: str | None
    allocator_addrs: tuple[str, ...]  # the allocator shards, in shard order
    executor_addrs: tuple[str, ...]
    model: str
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int | None
    preemption_mode: str
    max_waiting: int
    max_n: int
    lease_ttl_ms: int
    enable_prefix_caching: bool
    connect_timeout_s: float
    allocator_timeout_s: float
    execute_timeout_s: float
    allocator_retry_s: float
    stats_every_steps: int
    step_log: str
    async_depth: int
    log_json: bool
    log_level: str
    max_prompt_bytes: int
    internal_auth: InternalAuth
    api_keys_file: str
    salt_secret_file: str
    tenant_max_requests: int
    tenant_max_running: int
    public_tls_cert: str
    public_tls_key: str
    http_port: int
    http_port_file: str | None
    served_model_name: str
    max_sse_buffer: int
    executor_dns: str = ""
    executor_addrs_file: str = ""
    discovery_interval_s: float = 5.0
    routing: str = "exact"
    kv_events_lag_s: float = 1.0
    max_beam_width: int = 8
    rebalance_min_gap: int = 0
    shutdown_grace_s: float = 30.0

    def __post_init__(self) -> None:
        if not self.allocator_addrs:
            raise ValueError("--allocator-addr is empty: give the allocator's host:port")
        if len(self.allocator_addrs) > MAX_SHARDS:
            raise ValueError(f"--allocator-addr lists more than {MAX_SHARDS} shards")
        if len(set(self.allocator_addrs)) != len(self.allocator_addrs):
            raise ValueError("--allocator-addr lists a shard twice: each shard is its own "
                             "allocator, in shard order")
        for address in self.allocator_addrs:
            split_host_port(address, "--allocator-addr")
        if self.executor_dns and self.executor_addrs_file:
            raise ValueError("--executor-dns and --executor-addrs-file: give one of them")
        if self.executor_dns:
            split_host_port(self.executor_dns, "--executor-dns")
        elif not self.executor_addrs_file and not self.executor_addrs:
            raise ValueError("--executor-addrs is empty: give at least one host:port")
        if self.routing not in ROUTING_POLICIES:
            raise ValueError(f"--routing must be one of {', '.join(ROUTING_POLICIES)}")
        if not 0 < self.kv_events_lag_s < math.inf:
            raise ValueError("--kv-events-lag-s must be a finite number of seconds > 0 "
                             "(between two reads of the pools' cache events)")
        if not self.discovery_interval_s > 0:
            raise ValueError("--discovery-interval-s must be > 0 (seconds)")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_waiting", "max_n"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.lease_ttl_ms < 300:
            raise ValueError("--lease-ttl-ms must be >= 300 (keep-alives go every ttl/3)")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"--preemption-mode must be one of {PREEMPTION_MODES}")
        for name in ("allocator_timeout_s", "execute_timeout_s", "allocator_retry_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0 (seconds)")
        if bool(self.public_tls_cert) != bool(self.public_tls_key):
            raise ValueError("--public-tls-cert and --public-tls-key go together")
        for path in (self.public_tls_cert, self.public_tls_key):
            if path and not os.access(path, os.R_OK):
                raise ValueError(f"cannot read {path} (--public-tls-cert / --public-tls-key)")
        for name in ("tenant_max_requests", "tenant_max_running"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0 (0: no limit)")
        if not -1 <= self.http_port <= 65535:
            raise ValueError("--http-port must be a port (0: any free port, -1: no HTTP API)")
        if self.max_sse_buffer < 1:
            raise ValueError("--max-sse-buffer must be >= 1 (events)")
        if not 1 <= self.max_beam_width <= MAX_BEAM_WIDTH:
            raise ValueError(f"--max-beam-width must be in [1, {MAX_BEAM_WIDTH}] (each beam "
                             "needs its 2 x width best next tokens; executors return 20)")
        if not 0 <= self.shutdown_grace_s < math.inf:
            raise ValueError("--shutdown-grace-s must be a finite number of seconds >= 0")
        if self.rebalance_min_gap < 0:
            raise ValueError("--rebalance-min-gap must be >= 0 (sequences; 0: no rebalancing)")
        if self.max_prompt_bytes < 1:
            raise ValueError("--max-prompt-bytes must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("--max-model-len must be >= 2 (or unset: the executors' value)")
        if self.step_log:
            try:  # refused here, in one line, rather than by a traceback at the first step
                with open(self.step_log, "a"):
                    pass
            except OSError as exc:
                raise ValueError(
                    f"--step-log {self.step_log}: cannot append to it ({exc.strerror})"
                ) from exc


def split_addrs(text: str) -> tuple[str, ...]:
    return tuple(a.strip() for a in str(text).split(",") if a.strip())


def discovery(settings: GatewaySettings) -> Discovery:
    if settings.executor_dns:
        return DnsAddresses(*split_host_port(settings.executor_dns, "--executor-dns"))
    if settings.executor_addrs_file:
        return FileAddresses(settings.executor_addrs_file)
    return StaticAddresses(settings.executor_addrs)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m gateway", description=__doc__)
    add_flag(parser, "--host", default="127.0.0.1",
             help="address to bind (0.0.0.0: every interface)")
    add_flag(parser, "--port", type=int, default=50051, help="port to bind (0: any free port)")
    add_flag(parser, "--port-file", default=None, help="write the bound port here once serving")
    add_flag(parser, "--http-port", type=int, default=8000,
             help="the OpenAI-compatible HTTP API and /metrics on the same host (0: any free "
             "port, -1: none)")
    add_flag(parser, "--http-port-file", default=None,
             help="write the bound HTTP port here once serving")
    add_flag(parser, "--served-model-name", default="",
             help="the model's name in both APIs (unset: the model's own name)")
    add_flag(parser, "--max-sse-buffer", type=int, default=256,
             help="events an HTTP stream may have waiting for a slow client before it is cut")
    add_flag(parser, "--allocator-addr", default="localhost:50052",
             help="allocator host:port; sharded: every shard's, comma-separated, in shard "
             "order (each allocator started with --shard-index i --num-shards N)")
    add_flag(
        parser, "--executor-addrs", default="localhost:50053",
        help="comma-separated executor host:port list (one KV pool each)",
    )
    add_flag(parser, "--executor-dns", default="",
             help="find the executors by DNS instead: every address NAME resolves to, with "
             "PORT (NAME:PORT; a Kubernetes headless Service), asked again every "
             "--discovery-interval-s: executors join and leave without a restart")
    add_flag(parser, "--executor-addrs-file", default="",
             help="find the executors in this file instead (host:port entries, one per line "
             "or comma-separated), read again every --discovery-interval-s")
    add_flag(parser, "--discovery-interval-s", type=float, default=5.0,
             help="how often --executor-dns or --executor-addrs-file is asked again")
    add_flag(parser, "--routing", default="exact", choices=ROUTING_POLICIES,
             help="where a new request goes: exact (the longest cached prefix per the "
             "allocator's index, one MatchPrefix per request, then the least load), approx "
             "(the same from the gateway's own index of the pools' cache events, read every "
             "--kv-events-lag-s; no allocator call per request) or round-robin")
    add_flag(parser, "--kv-events-lag-s", type=float, default=1.0,
             help="--routing approx: seconds between two reads of each pool's cache events "
             "(how stale the gateway's prefix index may be)")
    add_flag(parser, "--model", default=str(DEFAULT_MODEL), help="model directory (tokenizer)")
    add_flag(parser, "--max-num-seqs", type=int, default=256, help="sequences per step")
    add_flag(
        parser, "--max-num-batched-tokens", type=int, default=2048,
        help="tokens per step (long prompts are prefilled in chunks)",
    )
    add_flag(
        parser, "--max-model-len", type=int, default=None,
        help="prompt + completion limit (capped by the executors')",
    )
    add_flag(
        parser, "--preemption-mode", default="recompute", choices=PREEMPTION_MODES,
        help="what happens to a request pushed out when the KV pool is short",
    )
    add_flag(parser, "--max-waiting", type=int, default=1024, help="bounded waiting queue")
    add_flag(parser, "--max-n", type=int, default=16, help="largest n (completions per request)")
    add_flag(
        parser, "--rebalance-min-gap", type=int, default=0,
        help="move running requests, with their KV, from an executor holding at least this "
        "many more than another of the same --role to that one (0: no rebalancing)",
    )
    add_flag(parser, "--max-beam-width", type=int, default=8,
             help="widest beam search (use_beam_search) a request may ask for")
    add_flag(parser, "--lease-ttl-ms", type=int, default=10000, help="allocator lease ttl")
    add_flag(
        parser, "--enable-prefix-caching", type=parse_bool, default=True,
        help="share cached prompt blocks between requests (true/false)",
    )
    add_flag(
        parser, "--connect-timeout-s", type=float, default=60.0,
        help="how long to wait for the allocator and executors at start",
    )
    add_flag(
        parser, "--allocator-timeout-s", type=float, default=10.0,
        help="deadline of each allocator call (Step, Free, Abort, Fork, MatchPrefix, leases); "
        "a Step past it is treated as lost: its requests are aborted and recomputed",
    )
    add_flag(
        parser, "--allocator-retry-s", type=float, default=10.0,
        help="how long requests wait for an allocator (shard) that does not answer, retried "
        "and recomputed meanwhile, before they fail with UNAVAILABLE",
    )
    add_flag(
        parser, "--execute-timeout-s", type=float, default=60.0,
        help="deadline of each Execute (one batched forward pass; twice this for one launched "
        "ahead, which waits for the one before) and Release; an executor past it is treated "
        "as lost: its requests move to another executor",
    )
    add_flag(
        parser, "--stats-every-steps", type=int, default=500,
        help="log an engine_step_stats summary (control-plane cost) every N steps; 0: never",
    )
    add_flag(
        parser, "--async-depth", type=int, choices=(1, 2), default=2,
        help="batches in flight per executor: 2 plans, allocates and sends each step while "
        "the previous batch executes, its decode tokens being the ones the executor sampled "
        "itself (only with an executor whose Describe reports uses_sampled_tokens; others "
        "run at 1); 1: each batch returns before the next is planned",
    )
    add_flag(
        parser, "--step-log", default="",
        help="append one JSON line per executed step to this file (the engines' own timings: "
        "period, scheduler, Step and Execute round trips, the executor's report); benchmarks "
        "read it",
    )
    add_flag(
        parser, "--max-prompt-bytes", type=int, default=1 << 20,
        help="largest prompt text (or chat content, all messages together) in UTF-8 bytes, "
        "refused before tokenizing",
    )
    add_flag(
        parser, "--api-keys-file", default="",
        help="public API keys, one '<key> <tenant>' per line: every call then needs "
        "'authorization: Bearer <key>', and prefix-cache hits never cross tenants; "
        "unset: one tenant, no keys",
    )
    add_flag(
        parser, "--tenant-max-requests", type=int, default=0,
        help="with API keys: a tenant's sequences in flight at once, running or waiting, "
        "each request counting its n (its beam_width with beam search); more are "
        "RESOURCE_EXHAUSTED, and one request wider than this INVALID_ARGUMENT (0: no limit)",
    )
    add_flag(
        parser, "--tenant-max-running", type=int, default=0,
        help="with API keys: a tenant's sequences running at once on each executor, each "
        "request counting its n (its beam_width with beam search); its others wait while "
        "other tenants' start; a request wider than this runs alone (0: no limit)",
    )
    add_flag(
        parser, "--salt-secret-file", default="",
        help="the secret that derives each tenant's cache salt (every gateway on one "
        "allocator must share it; unset: derived from the gateways' role token, else a random "
        "one per process)",
    )
    add_flag(parser, "--public-tls-cert", default="",
             help="serve the public port over TLS with this certificate (PEM; unset: "
             "plaintext, for a TLS proxy in front)")
    add_flag(parser, "--public-tls-key", default="", help="its private key (PEM)")
    add_flag(
        parser, "--shutdown-grace-s", type=float, default=30.0,
        help="on SIGTERM: health says NOT_SERVING and new requests are UNAVAILABLE at once, "
        "while those in flight get this long to finish; those left are then ended with "
        "UNAVAILABLE (keep it below the orchestrator's kill timeout: Kubernetes' "
        "terminationGracePeriodSeconds, compose's stop_grace_period)",
    )
    add_flag(parser, "--log-json", action="store_true", help="JSON logs (containers)")
    add_flag(parser, "--log-level", default="info", help="debug, info, warning, error")
    add_internal_auth_flags(parser)
    return parser


def load_settings(argv: Sequence[str] | None = None) -> GatewaySettings:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        internal_auth = internal_auth_from_args(args, serves=False)
    except CredentialsError as exc:
        parser.error(str(exc))
    addrs = split_addrs(args.executor_addrs)
    try:
        return GatewaySettings(
            host=args.host,
            port=args.port,
            port_file=args.port_file,
            allocator_addrs=split_addrs(args.allocator_addr),
            executor_addrs=addrs,
            model=args.model,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
            preemption_mode=args.preemption_mode,
            max_waiting=args.max_waiting,
            max_n=args.max_n,
            lease_ttl_ms=args.lease_ttl_ms,
            enable_prefix_caching=args.enable_prefix_caching,
            connect_timeout_s=args.connect_timeout_s,
            allocator_timeout_s=args.allocator_timeout_s,
            execute_timeout_s=args.execute_timeout_s,
            allocator_retry_s=args.allocator_retry_s,
            stats_every_steps=args.stats_every_steps,
            step_log=args.step_log,
            async_depth=args.async_depth,
            log_json=args.log_json,
            log_level=args.log_level,
            max_prompt_bytes=args.max_prompt_bytes,
            internal_auth=internal_auth,
            api_keys_file=args.api_keys_file,
            salt_secret_file=args.salt_secret_file,
            tenant_max_requests=args.tenant_max_requests,
            tenant_max_running=args.tenant_max_running,
            public_tls_cert=args.public_tls_cert,
            public_tls_key=args.public_tls_key,
            http_port=args.http_port,
            http_port_file=args.http_port_file,
            served_model_name=args.served_model_name,
            max_sse_buffer=args.max_sse_buffer,
            executor_dns=args.executor_dns,
            executor_addrs_file=args.executor_addrs_file,
            discovery_interval_s=args.discovery_interval_s,
            routing=args.routing,
            kv_events_lag_s=args.kv_events_lag_s,
            max_beam_width=args.max_beam_width,
            rebalance_min_gap=args.rebalance_min_gap,
            shutdown_grace_s=args.shutdown_grace_s,
        )
    except ValueError as exc:
        raise SystemExit(f"gateway: {exc}") from exc
