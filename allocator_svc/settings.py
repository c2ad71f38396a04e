"""Allocator settings: each declared once (common/config.py) as a flag with a PAGEDKV_*
environment equivalent, a default and a check; checked at start."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from allocator_svc.core.limits import Limits
from allocator_svc.core.tenant_service import MAX_WEIGHT
from allocator_svc.core.victims import PreemptionPolicy
from allocator_svc.recording import DEFAULT_MAX_BYTES, RecordingSettings
from common.config import (
    SettingsError,
    add_settings,
    at_least,
    check_settings,
    is_port,
    load,
    setting,
    split_names,
    within,
)
from common.cpu_priority import MAX_NICE, NICE_DEFAULT, NICE_HELP, NICE_MUST
from common.credentials import InternalAuth, add_internal_auth_flags, internal_auth_from_args
from common.metrics import MetricsEndpoint, add_metrics_flags, metrics_endpoint
from common.sharding import MAX_SHARDS

DEFAULT_METRICS_PORT = 9092

_DEFAULTS = Limits()


def _count(default: int, help: str) -> int:
    """A setting that counts something and must be at least 1."""
    return setting(default, help, check=at_least(1), must=">= 1")  # type: ignore[no-any-return]


@dataclass(frozen=True, slots=True)
class AllocatorSettings:
    host: str = setting("127.0.0.1", "address to bind (0.0.0.0: every interface, for a "
                        "private network)")
    port: int = setting(50052, "port to bind (0: any free port)", check=is_port,
                        must="in 0..65535")
    port_file: str | None = setting(None, "write the bound port here once serving")
    log_json: bool = setting(False, "JSON logs (containers)")
    log_level: str = setting("info", "debug, info, warning or error")
    nice: int = setting(NICE_DEFAULT, NICE_HELP, check=within(0, MAX_NICE), must=NICE_MUST)
    max_blocks_per_pool: int = _count(_DEFAULTS.max_blocks_per_pool,
                                       "largest pool a client may register")
    max_blocks_per_tenant: int = setting(
        0, "a tenant's new requests wait while its requests hold this many blocks of a pool "
        "(0: no quota)", check=at_least(0), must=">= 0 (0: no quota)")
    max_pinned_fraction: float = setting(
        _DEFAULTS.max_pinned_fraction, "each pool's pin budget: its pinned prefixes "
        "(PinPrefix) may name at most this fraction of its blocks, rounded down (0: no pins; "
        "below 1)", check=lambda v: 0 <= v < 1,
        must="in [0, 1): a fraction of each pool (0.1: a tenth; 0: no pins)")
    preemption_policy: str = setting(
        "tail", "whom a step short of blocks preempts: tail (the last behind the request "
        "short, as vLLM) or cost (among the least urgent behind it, the one that wastes least "
        "per block it frees; swapped or recomputed, whichever costs less, where the gateway "
        "allows swaps)", choices=tuple(p.value for p in PreemptionPolicy))
    prefill_service_weight: float = setting(
        1.0, "fair share: a tenant's service per prompt token computed",
        check=lambda v: 0 < v <= MAX_WEIGHT, must=f"in (0, {MAX_WEIGHT:g}]")
    decode_service_weight: float = setting(
        2.0, "fair share: a tenant's service per generated token computed",
        check=lambda v: 0 < v <= MAX_WEIGHT, must=f"in (0, {MAX_WEIGHT:g}]")
    max_pools: int = _count(_DEFAULTS.max_pools, "most pools registered at once")
    max_lease_ttl_ms: int = _count(round(_DEFAULTS.max_lease_ttl_s * 1000),
                                    "longest lease a client may ask for")
    max_batch_items: int = _count(_DEFAULTS.max_batch_items, "most requests in one Step call")
    default_lease_ttl_ms: int = _count(10_000, "lease lifetime when a client asks for none")
    event_capacity: int = _count(_DEFAULTS.event_capacity,
                                  "cache events kept per pool for observers")
    lease_check_interval_ms: int = _count(500, "how often expired leases are swept")
    grace_s: float = setting(5.0, "graceful-shutdown grace", check=at_least(0),
                             must=">= 0 (seconds)")
    tls_gateway_names: frozenset[str] = setting(
        frozenset({"gateway"}), "with mutual TLS: comma-separated certificate names (subject "
        "CN) that may call the allocator, as gateways (empty: any certificate of the CA)",
        type=split_names, metavar="NAME[,...]")
    verify_pool_resets: bool = setting(
        True, "reset a live pool (a registration with a new executor instance id) only once "
        "the executor at the executor_address sent reports that id itself; false: trust "
        "every internal caller (tests without executors)")
    # This allocator is shard shard_index of num_shards: it registers only its own pools
    # (common/sharding.py says which).
    num_shards: int = setting(
        1, "allocator shards the pools are split across (each runs its own allocator)",
        check=within(1, MAX_SHARDS), must=f"in 1..{MAX_SHARDS}")
    shard_index: int = setting(
        0, "this allocator's shard, 0..num-shards-1: it registers only the pools whose id "
        "hashes to it, and refuses the others")
    record_allocations: str = setting(
        "", "append every Step, Free, Fork ... call's workload (request lengths and prefix "
        "hashes, no token ids) to this file, for `python -m tools.replay` (empty: off)",
        metavar="PATH")
    record_token_ids: bool = setting(
        False, "with --record-allocations: record the requests' token ids too")
    record_max_bytes: int = setting(DEFAULT_MAX_BYTES,
                                    "the recording stops growing at this size (bytes)",
                                    check=at_least(4096), must=">= 4096")
    # From the credential and metrics flags.
    auth: InternalAuth = InternalAuth()
    metrics: MetricsEndpoint = MetricsEndpoint(DEFAULT_METRICS_PORT, required=False)

    def __post_init__(self) -> None:
        check_settings(self)
        self.metrics.check(self.port)
        if not 0 <= self.shard_index < self.num_shards:
            raise SettingsError(f"--shard-index must be in 0..{self.num_shards - 1} "
                                f"(--num-shards {self.num_shards})")
        if self.record_token_ids and not self.record_allocations:
            raise SettingsError("--record-token-ids needs --record-allocations PATH")
        if self.default_lease_ttl_ms > self.max_lease_ttl_ms:
            raise SettingsError("--default-lease-ttl-ms must be <= --max-lease-ttl-ms")

    @property
    def limits(self) -> Limits:
        return Limits(
            max_blocks_per_pool=self.max_blocks_per_pool,
            max_cpu_blocks_per_pool=self.max_blocks_per_pool,
            max_pools=self.max_pools,
            max_blocks_per_tenant=self.max_blocks_per_tenant,
            max_pinned_fraction=self.max_pinned_fraction,
            max_batch_items=self.max_batch_items,
            default_lease_ttl_s=self.default_lease_ttl_ms / 1000,
            max_lease_ttl_s=self.max_lease_ttl_ms / 1000,
            event_capacity=self.event_capacity,
        )

    @property
    def lease_check_interval_s(self) -> float:
        return self.lease_check_interval_ms / 1000

    @property
    def recording(self) -> RecordingSettings | None:
        """--record-allocations, or None: off. Shards given the same flags write a file each."""
        if not self.record_allocations:
            return None
        path = self.record_allocations
        if self.num_shards > 1:
            path = f"{path}.shard{self.shard_index}"
        return RecordingSettings(path, self.record_token_ids, self.record_max_bytes)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m allocator_svc", description="The pagedkv block-allocator service."
    )
    add_settings(parser, AllocatorSettings)
    add_metrics_flags(parser, DEFAULT_METRICS_PORT)
    add_internal_auth_flags(parser)
    return parser


def parse_settings(argv: Sequence[str] | None = None) -> AllocatorSettings:
    """The settings from `argv` (else sys.argv) and the environment; a value that cannot work
    is a usage error (exit 2) naming its flag."""
    return load(AllocatorSettings, build_parser(), argv, _derived)  # type: ignore[no-any-return]


def _derived(args: argparse.Namespace) -> dict[str, Any]:
    return {"auth": internal_auth_from_args(args), "metrics": metrics_endpoint(args)}
