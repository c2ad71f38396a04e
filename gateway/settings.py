"""The gateway's typed configuration: each setting declared once (common/config.py) as a flag
with a PAGEDKV_* environment equivalent, a default and a check."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from common.config import (
    SettingsError,
    add_settings,
    at_least,
    check_settings,
    finite_at_least,
    is_port,
    load,
    positive,
    setting,
    within,
)
from common.cpu_priority import MAX_NICE, NICE_DEFAULT, NICE_HELP, NICE_MUST
from common.credentials import InternalAuth, add_internal_auth_flags, internal_auth_from_args
from common.model_dirs import DEFAULT_MODEL
from common.sharding import MAX_SHARDS
from gateway.clients.discovery import (
    Discovery,
    DnsAddresses,
    FileAddresses,
    StaticAddresses,
    split_host_port,
)
from gateway.core.drafts import NgramDrafts, parse_speculative_config

PREEMPTION_MODES = ("recompute", "swap")
ROUTING_POLICIES = ("exact", "approx", "round-robin")  # gateway/engine/router.py
# A beam needs its 2 x beam_width most likely next tokens; executors return at most 20.
MAX_BEAM_WIDTH = 10


def split_addrs(text: str) -> tuple[str, ...]:
    return tuple(a.strip() for a in str(text).split(",") if a.strip())


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    """Everything the gateway is configured with; checked once, when made."""

    host: str = setting("127.0.0.1", "address to bind (0.0.0.0: every interface)")
    port: int = setting(50051, "port to bind (0: any free port)", check=is_port,
                        must="in 0..65535 (0: any free port)")
    port_file: str | None = setting(None, "write the bound port here once serving")
    http_port: int = setting(
        8000, "the OpenAI-compatible HTTP API and /metrics on the same host (0: any free "
        "port, -1: none)", check=within(-1, 65535),
        must="a port in -1..65535 (0: any free port, -1: no HTTP API)")
    http_port_file: str | None = setting(None, "write the bound HTTP port here once serving")
    served_model_name: str = setting(
        "", "the model's name in both APIs (unset: the model's own name)")
    allow_runtime_lora_updating: bool = setting(
        False, "let callers load and unload LoRA adapters on the executors (HTTP "
        "/v1/load_lora_adapter and /v1/unload_lora_adapter, gRPC LoadLoraAdapter and "
        "UnloadLoraAdapter): any caller may then read an adapter directory on the executors' "
        "disks, so turn it on where callers are trusted")
    max_sse_buffer: int = setting(
        256, "events an HTTP stream may have waiting for a slow client before it is cut",
        check=at_least(1), must=">= 1 (events)")
    # The allocator shards, in shard order.
    allocator_addrs: tuple[str, ...] = setting(
        ("localhost:50052",), "allocator host:port; sharded: every shard's, comma-separated, "
        "in shard order (each allocator started with --shard-index i --num-shards N)",
        flag="--allocator-addr", type=split_addrs, metavar="HOST:PORT[,...]")
    executor_addrs: tuple[str, ...] = setting(
        ("localhost:50053",), "comma-separated executor host:port list (one KV pool each)",
        type=split_addrs, metavar="HOST:PORT[,...]")
    executor_dns: str = setting(
        "", "find the executors by DNS instead: every address NAME resolves to, with PORT "
        "(NAME:PORT; a Kubernetes headless Service), asked again every "
        "--discovery-interval-s: executors join and leave without a restart")
    executor_addrs_file: str = setting(
        "", "find the executors in this file instead (host:port entries, one per line or "
        "comma-separated), read again every --discovery-interval-s")
    discovery_interval_s: float = setting(
        5.0, "how often --executor-dns or --executor-addrs-file is asked again",
        check=positive, must="> 0 (seconds)")
    routing: str = setting(
        "exact", "where a new request goes: exact (the longest cached prefix per the "
        "allocator's index, one MatchPrefix per request, then the least load), approx (the "
        "same from the gateway's own index of the pools' cache events, read every "
        "--kv-events-lag-s; no allocator call per request) or round-robin",
        choices=ROUTING_POLICIES)
    kv_events_lag_s: float = setting(
        1.0, "--routing approx: seconds between two reads of each pool's cache events (how "
        "stale the gateway's prefix index may be)", check=lambda v: 0 < v < float("inf"),
        must="a finite number of seconds > 0 (between two reads of the pools' cache events)")
    model: str = setting(str(DEFAULT_MODEL), "model directory (tokenizer)")
    chat_template: str | None = setting(
        None, "a Jinja chat template file in place of the model's own (e.g. "
        "models/chat_templates/hermes_tools.jinja: tool calling for a model whose own "
        "template has no tools)", type=str, metavar="FILE")
    max_num_seqs: int = setting(256, "sequences per step", check=at_least(1), must=">= 1")
    max_num_batched_tokens: int = setting(
        2048, "tokens per step (long prompts are prefilled in chunks)", check=at_least(1),
        must=">= 1")
    max_model_len: int | None = setting(
        None, "prompt + completion limit (capped by the executors')", type=int,
        check=at_least(2), must=">= 2 (or unset: the executors' value)")
    preemption_mode: str = setting(
        "recompute", "what happens to a request pushed out when the KV pool is short",
        choices=PREEMPTION_MODES)
    admission_order: str = setting(
        "fcfs", "which waiting request starts next, within a priority level: fcfs (arrival), "
        "or fair-share (the tenant with the least service across every gateway, as the "
        "allocator counts it, first)", choices=("fcfs", "fair-share"))
    speculative_config: str = setting(
        "", "speculative decoding, as vLLM's JSON: {\"method\": \"ngram\", "
        "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2} "
        "(prompt lookup: drafts copied from the sequence's own earlier tokens, verified by the "
        "executor in the step that decodes; for greedy requests without logprobs or logits "
        "processors). While such a request runs, the engine's steps land before the next is "
        "planned (depth 1); otherwise they keep --async-depth. Empty: off")
    max_waiting: int = setting(1024, "bounded waiting queue", check=at_least(1), must=">= 1")
    max_n: int = setting(16, "largest n (completions per request)", check=at_least(1),
                         must=">= 1")
    rebalance_min_gap: int = setting(
        0, "move running requests, with their KV, from an executor holding at least this "
        "many more than another of the same --role to that one (0: no rebalancing)",
        check=at_least(0), must=">= 0 (sequences; 0: no rebalancing)")
    max_beam_width: int = setting(
        8, "widest beam search (use_beam_search) a request may ask for",
        check=within(1, MAX_BEAM_WIDTH), must=f"in [1, {MAX_BEAM_WIDTH}] (each beam needs "
        "its 2 x width best next tokens; executors return 20)")
    lease_ttl_ms: int = setting(10000, "allocator lease ttl", check=at_least(300),
                                must=">= 300 (keep-alives go every ttl/3)")
    enable_prefix_caching: bool = setting(
        True, "share cached prompt blocks between requests (true/false)")
    connect_timeout_s: float = setting(
        60.0, "how long to wait for the allocator and executors at start", check=positive,
        must="> 0 (seconds)")
    allocator_timeout_s: float = setting(
        10.0, "deadline of each allocator call (Step, Free, Abort, Fork, MatchPrefix, "
        "leases); a Step past it is treated as lost: its requests are aborted and recomputed",
        check=positive, must="> 0 (seconds)")
    allocator_retry_s: float = setting(
        10.0, "how long requests wait for an allocator (shard) that does not answer, "
        "retried and recomputed meanwhile, before they fail with UNAVAILABLE",
        check=positive, must="> 0 (seconds)")
    execute_timeout_s: float = setting(
        60.0, "deadline of each Execute (one batched forward pass; twice this for one "
        "launched ahead, which waits for the one before) and Release; an executor past it is "
        "treated as lost: its requests move to another executor", check=positive,
        must="> 0 (seconds)")
    stats_every_steps: int = setting(
        500, "log an engine_step_stats summary (control-plane cost) every N steps; 0: never",
        check=at_least(0), must=">= 0 (0: never)")
    async_depth: int = setting(
        2, "batches in flight per executor: 2 plans, allocates and sends each step while the "
        "previous batch executes, its decode tokens being the ones the executor sampled "
        "itself (only with an executor whose Describe reports uses_sampled_tokens; others run "
        "at 1); 1: each batch returns before the next is planned", choices=(1, 2))
    step_log: str = setting(
        "", "append one JSON line per executed step to this file (the engines' own timings: "
        "period, scheduler, Step and Execute round trips, the executor's report); benchmarks "
        "read it")
    max_prompt_bytes: int = setting(
        1 << 20, "largest prompt text (or chat content, all messages together) in UTF-8 "
        "bytes, refused before tokenizing", check=at_least(1), must=">= 1")
    api_keys_file: str = setting(
        "", "public API keys, one '<key> <tenant>' per line: every call then needs "
        "'authorization: Bearer <key>', and prefix-cache hits never cross tenants; unset: "
        "one tenant, no keys")
    tenant_max_requests: int = setting(
        0, "with API keys: a tenant's sequences in flight at once, running or waiting, each "
        "request counting its n (its beam_width with beam search); more are "
        "RESOURCE_EXHAUSTED, and one request wider than this INVALID_ARGUMENT (0: no limit)",
        check=at_least(0), must=">= 0 (0: no limit)")
    tenant_max_running: int = setting(
        0, "with API keys: a tenant's sequences running at once on each executor, each "
        "request counting its n (its beam_width with beam search); its others wait while "
        "other tenants' start; a request wider than this runs alone (0: no limit)",
        check=at_least(0), must=">= 0 (0: no limit)")
    salt_secret_file: str = setting(
        "", "the secret that derives each tenant's cache salt (every gateway on one "
        "allocator must share it; unset: derived from the gateways' role token, else a "
        "random one per process)")
    public_tls_cert: str = setting(
        "", "serve the public port over TLS with this certificate (PEM; unset: plaintext, "
        "for a TLS proxy in front)")
    public_tls_key: str = setting("", "its private key (PEM)")
    shutdown_grace_s: float = setting(
        30.0, "on SIGTERM: health says NOT_SERVING and new requests are UNAVAILABLE at once, "
        "while those in flight get this long to finish; those left are then ended with "
        "UNAVAILABLE (keep it below the orchestrator's kill timeout: Kubernetes' "
        "terminationGracePeriodSeconds, compose's stop_grace_period)",
        check=finite_at_least(0), must="a finite number of seconds >= 0")
    log_json: bool = setting(False, "JSON logs (containers)")
    log_level: str = setting("info", "debug, info, warning, error")
    nice: int = setting(NICE_DEFAULT, NICE_HELP, check=within(0, MAX_NICE), must=NICE_MUST)
    # From the credential flags (common/credentials.py); in-process use needs none.
    internal_auth: InternalAuth = InternalAuth()

    @property
    def speculative(self) -> NgramDrafts | None:
        """--speculative-config parsed (checked when the settings are made)."""
        try:
            return parse_speculative_config(self.speculative_config)
        except ValueError as exc:
            raise SettingsError(f"--speculative-config {exc}") from None

    def __post_init__(self) -> None:
        check_settings(self)
        self.speculative  # noqa: B018 - parsed here: a bad config is a usage error
        if not self.allocator_addrs:
            raise SettingsError("--allocator-addr is empty: give the allocator's host:port")
        if len(self.allocator_addrs) > MAX_SHARDS:
            raise SettingsError(f"--allocator-addr lists more than {MAX_SHARDS} shards")
        if len(set(self.allocator_addrs)) != len(self.allocator_addrs):
            raise SettingsError("--allocator-addr lists a shard twice: each shard is its own "
                                "allocator, in shard order")
        for address in self.allocator_addrs:
            split_host_port(address, "--allocator-addr")
        if self.executor_dns and self.executor_addrs_file:
            raise SettingsError("--executor-dns and --executor-addrs-file: give one of them")
        if self.executor_dns:
            split_host_port(self.executor_dns, "--executor-dns")
        elif not self.executor_addrs_file and not self.executor_addrs:
            raise SettingsError("--executor-addrs is empty: give at least one host:port")
        if bool(self.public_tls_cert) != bool(self.public_tls_key):
            raise SettingsError("--public-tls-cert and --public-tls-key go together")
        for path in (self.public_tls_cert, self.public_tls_key):
            if path and not os.access(path, os.R_OK):
                raise SettingsError(f"cannot read {path} (--public-tls-cert / --public-tls-key)")
        if self.step_log:
            try:  # refused here, in one line, rather than by a traceback at the first step
                with open(self.step_log, "a"):
                    pass
            except OSError as exc:
                raise SettingsError(
                    f"--step-log {self.step_log}: cannot append to it ({exc.strerror})"
                ) from exc


def discovery(settings: GatewaySettings) -> Discovery:
    if settings.executor_dns:
        return DnsAddresses(*split_host_port(settings.executor_dns, "--executor-dns"))
    if settings.executor_addrs_file:
        return FileAddresses(settings.executor_addrs_file)
    return StaticAddresses(settings.executor_addrs)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m gateway", description=__doc__)
    add_settings(parser, GatewaySettings)
    add_internal_auth_flags(parser)
    return parser


def load_settings(argv: Sequence[str] | None = None) -> GatewaySettings:
    """The settings from `argv` (else sys.argv) and the environment; a value that cannot work
    is a usage error (exit 2) naming its flag."""
    return load(GatewaySettings, build_parser(), argv, _credentials)  # type: ignore[no-any-return]


def _credentials(args: argparse.Namespace) -> dict[str, Any]:
    return {"internal_auth": internal_auth_from_args(args, serves=False)}
