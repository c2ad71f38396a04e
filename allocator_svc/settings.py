"""Allocator settings: flags with PAGEDKV_* environment equivalents, validated at start."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from allocator_svc.core.limits import Limits
from allocator_svc.recording import DEFAULT_MAX_BYTES, RecordingSettings
from common.auth import split_names
from common.config import add_flag, parse_bool
from common.credentials import (
    CredentialsError,
    InternalAuth,
    add_internal_auth_flags,
    internal_auth_from_args,
)
from common.metrics import MetricsEndpoint, add_metrics_flags, metrics_endpoint
from common.sharding import MAX_SHARDS

DEFAULT_METRICS_PORT = 9092

_DEFAULTS = Limits()


@dataclass(frozen=True, slots=True)
class AllocatorSettings:
    host: str
    port: int
    port_file: str | None
    log_json: bool
    log_level: str
    lease_check_interval_s: float
    grace_s: float
    limits: Limits
    auth: InternalAuth
    metrics: MetricsEndpoint
    verify_pool_resets: bool = True
    tls_gateway_names: frozenset[str] = frozenset({"gateway"})
    # This allocator is shard shard_index of num_shards: it registers only its own pools
    # (common/sharding.py says which).
    shard_index: int = 0
    num_shards: int = 1
    # --record-allocations: the calls' workload appended to a file (recording.py); None: off.
    recording: RecordingSettings | None = None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m allocator_svc", description="The pagedkv block-allocator service."
    )
    add_flag(parser, "--host", default="127.0.0.1",
             help="address to bind (0.0.0.0: every interface, for a private network)")
    add_flag(parser, "--port", type=int, default=50052, help="port to bind (0: any free port)")
    add_flag(parser, "--port-file", default=None, help="write the bound port here once serving")
    add_metrics_flags(parser, DEFAULT_METRICS_PORT)
    add_flag(parser, "--log-json", action="store_true", help="JSON logs (containers)")
    add_flag(parser, "--log-level", default="info", help="debug, info, warning or error")
    add_flag(
        parser,
        "--max-blocks-per-pool",
        type=int,
        default=_DEFAULTS.max_blocks_per_pool,
        help="largest pool a client may register",
    )
    add_flag(parser, "--max-blocks-per-tenant", type=int, default=0,
             help="a tenant's new requests wait while its requests hold this many blocks of a "
             "pool (0: no quota)")
    add_flag(parser, "--max-pinned-fraction", type=float, default=_DEFAULTS.max_pinned_fraction,
             help="each pool's pin budget: its pinned prefixes (PinPrefix) may name at most "
             "this fraction of its blocks, rounded down (0: no pins; below 1)")
    add_flag(parser, "--max-pools", type=int, default=_DEFAULTS.max_pools,
             help="most pools registered at once")
    add_flag(parser, "--max-lease-ttl-ms", type=int,
             default=round(_DEFAULTS.max_lease_ttl_s * 1000),
             help="longest lease a client may ask for")
    add_flag(
        parser,
        "--max-batch-items",
        type=int,
        default=_DEFAULTS.max_batch_items,
        help="most requests in one Step call",
    )
    add_flag(
        parser,
        "--default-lease-ttl-ms",
        type=int,
        default=10_000,
        help="lease lifetime when a client asks for none",
    )
    add_flag(
        parser,
        "--event-capacity",
        type=int,
        default=_DEFAULTS.event_capacity,
        help="cache events kept per pool for observers",
    )
    add_flag(
        parser,
        "--lease-check-interval-ms",
        type=int,
        default=500,
        help="how often expired leases are swept",
    )
    add_flag(parser, "--grace-s", type=float, default=5.0, help="graceful-shutdown grace")
    add_flag(parser, "--tls-gateway-names", default="gateway",
             help="with mutual TLS: comma-separated certificate names (subject CN) that may "
             "call the allocator, as gateways (empty: any certificate of the CA)")
    add_flag(parser, "--verify-pool-resets", type=parse_bool, default=True,
             help="reset a live pool (a registration with a new executor instance id) only "
             "once the executor at the executor_address sent reports that id itself; false: "
             "trust every internal caller (tests without executors)")
    add_flag(parser, "--num-shards", type=int, default=1,
             help="allocator shards the pools are split across (each runs its own allocator)")
    add_flag(parser, "--shard-index", type=int, default=0,
             help="this allocator's shard, 0..num-shards-1: it registers only the pools "
             "whose id hashes to it, and refuses the others")
    add_flag(parser, "--record-allocations", default="", metavar="PATH",
             help="append every Step, Free, Fork ... call's workload (request lengths and "
             "prefix hashes, no token ids) to this file, for `python -m tools.replay` "
             "(empty: off)")
    add_flag(parser, "--record-token-ids", action="store_true",
             help="with --record-allocations: record the requests' token ids too")
    add_flag(parser, "--record-max-bytes", type=int, default=DEFAULT_MAX_BYTES,
             help="the recording stops growing at this size (bytes)")
    add_internal_auth_flags(parser)
    return parser


def parse_settings(argv: list[str] | None = None) -> AllocatorSettings:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in (
        "max_blocks_per_pool",
        "max_pools",
        "max_lease_ttl_ms",
        "max_batch_items",
        "default_lease_ttl_ms",
        "event_capacity",
        "lease_check_interval_ms",
    ):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 <= args.port <= 65535:
        parser.error("--port must be in 0..65535")
    metrics = metrics_endpoint(args)
    problem = metrics.problem(args.port)
    if problem:
        parser.error(problem)
    if args.max_blocks_per_tenant < 0:
        parser.error("--max-blocks-per-tenant must be >= 0 (0: no quota)")
    if not 0 <= args.max_pinned_fraction < 1:  # (NaN fails too)
        parser.error("--max-pinned-fraction must be in [0, 1): a fraction of each pool "
                     "(0.1: a tenth; 0: no pins)")
    if not 1 <= args.num_shards <= MAX_SHARDS:
        parser.error(f"--num-shards must be in 1..{MAX_SHARDS}")
    if not 0 <= args.shard_index < args.num_shards:
        parser.error(f"--shard-index must be in 0..{args.num_shards - 1} (--num-shards "
                     f"{args.num_shards})")
    if args.record_token_ids and not args.record_allocations:
        parser.error("--record-token-ids needs --record-allocations PATH")
    if args.record_max_bytes < 4096:
        parser.error("--record-max-bytes must be >= 4096")
    if args.default_lease_ttl_ms > args.max_lease_ttl_ms:
        parser.error("--default-lease-ttl-ms must be <= --max-lease-ttl-ms")
    try:
        auth = internal_auth_from_args(args)
    except CredentialsError as exc:
        parser.error(str(exc))
    limits = Limits(
        max_blocks_per_pool=args.max_blocks_per_pool,
        max_cpu_blocks_per_pool=args.max_blocks_per_pool,
        max_pools=args.max_pools,
        max_blocks_per_tenant=args.max_blocks_per_tenant,
        max_pinned_fraction=args.max_pinned_fraction,
        max_batch_items=args.max_batch_items,
        default_lease_ttl_s=args.default_lease_ttl_ms / 1000,
        max_lease_ttl_s=args.max_lease_ttl_ms / 1000,
        event_capacity=args.event_capacity,
    )
    return AllocatorSettings(
        args.host,
        args.port,
        args.port_file,
        args.log_json,
        args.log_level,
        args.lease_check_interval_ms / 1000,
        args.grace_s,
        limits,
        auth,
        metrics,
        args.verify_pool_resets,
        split_names(args.tls_gateway_names),
        args.shard_index,
        args.num_shards,
        _recording(args),
    )


def _recording(args: argparse.Namespace) -> RecordingSettings | None:
    if not args.record_allocations:
        return None
    path = args.record_allocations
    if args.num_shards > 1:  # the launcher gives every shard the same flags: one file each
        path = f"{path}.shard{args.shard_index}"
    return RecordingSettings(path, args.record_token_ids, args.record_max_bytes)
