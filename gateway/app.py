"""Assembling the gateway: connect to the allocator and executors, register the pools,
take a lease, start one engine loop per executor and the public server."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import structlog

from common.executor_description import ExecutorDescription
from common.model_dirs import model_name
from common.server import Server, start_server
from gateway.api import service
from gateway.api.frontend import Frontend, ModelInfo
from gateway.api.openai.app import HttpApi, create_app
from gateway.api.openai.server import HttpServer
from gateway.api.sampling import ModelLimits
from gateway.api.tenants import Tenancy, load_tenancy
from gateway.clients.call_failures import CallFailed, Lost
from gateway.clients.discovery import Discovery, DiscoveryFailed
from gateway.clients.executor_client import ExecutorClient
from gateway.clients.pool_link import PoolLink
from gateway.clients.shards import AllocatorShards
from gateway.core.batch import Budget
from gateway.core.finish_rules import FinishRules
from gateway.core.scheduler import Scheduler
from gateway.core.tenants import TenantGate
from gateway.engine.adapters import LoraAdapters, follow_adapters
from gateway.engine.hand_off import HandOffs
from gateway.engine.host import EngineHost
from gateway.engine.loop import Engine
from gateway.engine.membership import Membership
from gateway.engine.router import Router
from gateway.engine.step_stats import StepStats
from gateway.metrics import EngineSnapshot, GatewayMetrics, snapshot
from gateway.settings import GatewaySettings, discovery
from gateway.text.tokenizer import Tokenizer

log = structlog.get_logger(__name__)
T = TypeVar("T")
DRAIN_S = 2.0
CUT_OFF_FLUSH_S = 2.0  # for the streams cut at the end of the grace to send their error
HEALTH_INTERVAL_S = 1.0
PROTO_OVERHEAD_BYTES = 1 << 20  # sampling fields, stop strings, ids: far below this


class StartupFailed(Exception):
    """A dependency refused, or did not answer in time, at start (one line for the log)."""


@dataclass(slots=True)
class Engines:
    """What runs on the engine loop: the router and its engines, the allocator shards (a
    client and a lease each), and the membership loop that follows discovery."""

    router: Router
    shards: AllocatorShards
    membership: Membership
    limits: ModelLimits
    eos_token_ids: tuple[int, ...]
    model_name: str
    dynamic: bool = False  # executors come and go (--executor-dns, --executor-addrs-file)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    adapters: LoraAdapters | None = None  # set before `start`: followed on the engine loop

    def start(self) -> None:
        """The leases' keep-alives, every engine's loop, and discovery (on the engine loop)."""
        loop = asyncio.get_running_loop()
        for shard in self.shards.shards:
            self.tasks.append(loop.create_task(shard.lease.keep_alive_forever()))
        for engine in self.router.engines:
            self.membership.start(engine)
        if self.dynamic:
            self.tasks.append(loop.create_task(self.membership.run_forever()))
        if self.router.kv_index is not None:  # --routing approx
            self.tasks.append(loop.create_task(self.router.follow_cache_events()))
        if self.adapters is not None:
            self.tasks.append(loop.create_task(
                follow_adapters(lambda: self.router.engines, self.adapters)))

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.membership.close()
        await self.shards.close()
        for engine in self.router.engines:
            await engine.link.executor.close()


@dataclass(slots=True)
class Gateway:
    server: Server
    frontend: Frontend
    host: EngineHost
    engines: Engines
    http: HttpServer | None = None
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    async def stop(self, grace: float = 30.0) -> None:
        """Drain, then stop (SIGTERM): health says NOT_SERVING and new requests are refused
        with UNAVAILABLE at once, while the requests in flight get up to `grace` seconds
        (--shutdown-grace-s) to finish; those left then end with UNAVAILABLE. Then both
        servers stop, the engines abort what was cut off and give its blocks back, and the
        loops stop. Whatever is left over is freed by the allocator when the lease expires."""
        self.frontend.draining = True
        for task in self.tasks:  # the health watch, which must not say SERVING again
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.server.set_serving(False)
        log.info("gateway_draining", grace_s=grace, num_requests=len(self.frontend.active))
        if not await self._drained(grace):
            num_cut = self.frontend.cut_off(
                f"the gateway shut down before this request finished (it had "
                f"--shutdown-grace-s {grace:g} seconds to): send it again")
            log.warning("requests_cut_off", num_requests=num_cut, grace_s=grace)
            await self._drained(CUT_OFF_FLUSH_S)
        if self.http is not None:
            await self.http.stop()
        await self.server.stop(CUT_OFF_FLUSH_S)
        deadline = time.monotonic() + DRAIN_S
        engines = self.engines.router.engines
        while time.monotonic() < deadline and any(e.healthy and e.busy for e in engines):
            await asyncio.sleep(0.05)
        self.frontend.close()
        await self.host.run(self.engines.close())
        self.host.stop()
        log.info("gateway_stopped")

    async def _drained(self, timeout_s: float) -> bool:
        """Whether every active request ended within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while self.frontend.active:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True


def _public_credentials(settings: GatewaySettings) -> Any:
    """TLS for the public port (no client certificate: API keys say who calls), or None."""
    if not settings.public_tls_cert:
        return None
    import grpc

    cert = Path(settings.public_tls_cert).read_bytes()
    key = Path(settings.public_tls_key).read_bytes()
    return grpc.ssl_server_credentials([(key, cert)])


async def _retry(what: str, fn: Callable[[], Awaitable[T]], timeout_s: float) -> T:
    """Dependencies may still be starting: retry while they do not answer (Lost), until
    the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await fn()
        except CallFailed as exc:
            if not isinstance(exc, Lost) or time.monotonic() > deadline:
                raise StartupFailed(f"gateway: {what} failed: {exc.status} {exc.details}") from exc
            log.info("waiting_for_dependency", what=what)
            await asyncio.sleep(0.5)


async def _watch_health(server: Server, router: Router) -> None:
    """Health says NOT_SERVING while no executor is reachable (new requests would fail).
    (It reads the engines' health from the API's loop: a flag, read only.)"""
    serving = True
    while True:
        await asyncio.sleep(HEALTH_INTERVAL_S)
        now = bool(router.healthy())
        if now != serving:
            serving = now
            await server.set_serving(serving)
            log.warning("gateway_health_changed", serving=serving)


def model_limits(
    settings: GatewaySettings, tokenizer: Tokenizer, descriptions: list[ExecutorDescription]
) -> ModelLimits:
    lens = [d.max_model_len for d in descriptions if d.max_model_len]
    if settings.max_model_len:
        lens.append(settings.max_model_len)
    vocab = min((d.vocab_size for d in descriptions if d.vocab_size), default=0)
    return ModelLimits(
        max_model_len=min(lens) if lens else 2048,
        vocab_size=vocab or tokenizer.vocab_size,
        max_n=settings.max_n,
        pool_capacity_tokens=min(d.num_blocks * d.block_size for d in descriptions),
        max_beam_width=settings.max_beam_width,
        eos_token_ids=tuple(descriptions[0].eos_token_ids or tokenizer.eos_token_ids),
        block_size=max(d.block_size for d in descriptions),
        # A constrained request may be routed to any of them: all must apply it.
        structured_output=all(d.structured_output for d in descriptions),
    )


async def build_engines(
    settings: GatewaySettings, tokenizer: Tokenizer, metrics: GatewayMetrics,
    adapters: LoraAdapters | None = None,
) -> Engines:
    """Connect, describe, lease, register and build every engine (on the engine loop: the
    clients' channels belong to the loop that makes them)."""
    shards = AllocatorShards.connect(settings.allocator_addrs, settings.allocator_timeout_s,
                                     settings.internal_auth, settings.lease_ttl_ms)
    found = discovery(settings)
    clients, descriptions = await _first_executors(settings, found)
    limits = model_limits(settings, tokenizer, descriptions)
    eos = descriptions[0].eos_token_ids or tokenizer.eos_token_ids
    for shard in shards.shards:
        await _retry(f"CreateLease {shard.address}", shard.lease.acquire,
                     settings.connect_timeout_s)
    finish_rules = FinishRules(eos_token_ids=frozenset(eos), max_model_len=limits.max_model_len,
                               decoder=tokenizer)
    router = Router(engines=[], allocator=shards, max_waiting=settings.max_waiting,
                    policy=settings.routing, kv_events_lag_s=settings.kv_events_lag_s)
    hand_offs = HandOffs(lambda: list(router.engines),
                         rebalance_min_gap=settings.rebalance_min_gap,
                         import_timeout_s=settings.execute_timeout_s,
                         observe=metrics.observe_hand_off)
    fleet = Fleet(settings=settings, shards=shards, finish_rules=finish_rules,
                  router=router, metrics=metrics, hand_offs=hand_offs,
                  model_fingerprint=descriptions[0].model_fingerprint, limits=limits)
    for client, description in zip(clients, descriptions, strict=True):
        router.add(await fleet.engine(client, description))
    membership = Membership(found, router, fleet.join, settings.discovery_interval_s)
    engines = Engines(router=router, shards=shards, membership=membership,
                      limits=limits, eos_token_ids=tuple(eos), model_name=metrics.model_name,
                      dynamic=found.dynamic, adapters=adapters)
    engines.start()
    return engines


async def _first_executors(
    settings: GatewaySettings, found: Discovery
) -> tuple[list[ExecutorClient], list[ExecutorDescription]]:
    """The executors to start with: every listed one (a static list), or those discovery
    finds that answer (at least one), waiting for them up to --connect-timeout-s."""
    deadline = time.monotonic() + settings.connect_timeout_s
    auth = settings.internal_auth
    if not found.dynamic:
        clients = [ExecutorClient(a, auth=auth) for a in await found.addresses()]
        return clients, [await _retry(f"Describe {c.address}", c.describe,
                                      settings.connect_timeout_s) for c in clients]
    while True:
        problem = ""
        try:
            addresses = await found.addresses()
        except DiscoveryFailed as exc:
            addresses, problem = [], str(exc)
        clients, descriptions = [], []
        for address in addresses:
            client = ExecutorClient(address, auth=auth)
            try:
                descriptions.append(await client.describe(timeout=5.0))
                clients.append(client)
            except CallFailed as exc:
                problem = f"{address}: {exc.status}"
                await client.close()
        if clients:
            return clients, descriptions
        if time.monotonic() > deadline:
            raise StartupFailed(f"gateway: no executor found by {found.source} answered "
                                f"within --connect-timeout-s ({problem or 'none listed'})")
        log.info("waiting_for_executors", source=found.source, problem=problem or None)
        await asyncio.sleep(1.0)


@dataclass(slots=True)
class Fleet:
    """Builds the engine of an executor: its pool registered, its scheduler, its loop."""

    settings: GatewaySettings
    shards: AllocatorShards
    finish_rules: FinishRules
    router: Router
    metrics: GatewayMetrics
    model_fingerprint: str
    limits: ModelLimits  # what the gateway admits requests under: a joiner must meet them
    hand_offs: HandOffs | None = None

    async def engine(self, client: ExecutorClient, description: ExecutorDescription) -> Engine:
        settings = self.settings
        budget = Budget(
            max_num_seqs=min(settings.max_num_seqs, description.max_num_seqs or 1 << 30),
            max_num_batched_tokens=min(settings.max_num_batched_tokens,
                                       description.max_num_batched_tokens or 1 << 30),
        )
        pool_id = description.pool_name or client.address
        shard = self.shards.for_pool(pool_id)  # the pool's blocks are this shard's alone
        link = PoolLink(
            pool_id=pool_id,
            executor=client,
            allocator=shard.client,
            lease=shard.lease,
            description=description,
            enable_prefix_caching=settings.enable_prefix_caching,
            execute_timeout_s=settings.execute_timeout_s,
            num_shards=len(self.shards.shards),
        )
        await _retry(f"RegisterPool {client.address}", link.register, settings.connect_timeout_s)
        drafts = settings.speculative
        if drafts and not description.max_draft_tokens:
            log.warning("speculative_decoding_off", executor=client.address,
                        reason="the executor does not verify drafts (Describe)")
        engine = Engine(
            link=link,
            scheduler=Scheduler(budget=budget, block_size=description.block_size,
                                swap=settings.preemption_mode == "swap",
                                tenants=TenantGate(settings.tenant_max_running),
                                step_ids=shard.lease.step_ids,
                                fair_share=settings.admission_order == "fair-share",
                                drafts=drafts,
                                max_model_len=self.finish_rules.max_model_len),
            finish_rules=self.finish_rules,
            on_lost=self.router.requeue,
            stats=StepStats(window=settings.stats_every_steps,
                            log_path=settings.step_log or None,
                            observe=self.metrics.observe_step),
            # (A step that may draft lands the one before it first: Engine._can_build_on.)
            async_depth=settings.async_depth,
            allocator_retry_s=settings.allocator_retry_s,
            mover=self.hand_offs,
        )
        shard.lease.on_acquired.append(engine.wakeup.set)
        return engine

    async def join(self, address: str) -> Engine | None:
        """An executor discovery found since: its engine, in the router (None: refused)."""
        client = ExecutorClient(address, auth=self.settings.internal_auth)
        try:
            description = await client.describe(timeout=5.0)
            reason = self.refusal(description)
            if reason:
                log.error("executor_refused", address=address, reason=reason,
                          model=description.model_name,
                          fingerprint=description.model_fingerprint,
                          expected_fingerprint=self.model_fingerprint)
                await client.close()
                return None
            engine = await self.engine(client, description)
        except BaseException:
            await client.close()
            raise
        self.router.add(engine)
        return engine

    def refusal(self, description: ExecutorDescription) -> str:
        """Why a joining executor cannot take the requests this gateway admits ("": it can).
        The limits were set by the executors found at start; a request admitted under them
        may be routed to any executor."""
        limits = self.limits
        if description.model_fingerprint != self.model_fingerprint:
            return "it serves another model than this gateway's executors"
        if limits.structured_output and not description.structured_output:
            return ("it cannot apply structured output, which this gateway's executors do "
                    "and its requests may use")
        if description.max_model_len and description.max_model_len < limits.max_model_len:
            return (f"its max_model_len {description.max_model_len} is below the "
                    f"{limits.max_model_len} this gateway admits requests up to")
        if description.num_blocks * description.block_size < limits.pool_capacity_tokens:
            return (f"its pool holds {description.num_blocks * description.block_size} tokens, "
                    f"below the {limits.pool_capacity_tokens} a request here may need")
        return ""


async def start_gateway(settings: GatewaySettings) -> Gateway:
    """The engines on their own loop and thread (engine/host.py), the public server here."""
    tokenizer = Tokenizer.load(settings.model, settings.chat_template)
    if tokenizer.bound is None:
        log.warning("prompt_bound_off", detail="this tokenizer's rules give no sound bound on "
                    "the bytes a token covers: prompts up to --max-prompt-bytes are tokenized "
                    "whole before their length is checked")
    tenancy = load_tenancy(settings.api_keys_file, settings.salt_secret_file,
                           settings.internal_auth.token)
    if tenancy.multi_tenant:
        log.info("tenants_on", num_keys=len(tenancy.tenants_by_key),
                 num_tenants=len(set(tenancy.tenants_by_key.values())))
    else:
        log.warning("single_tenant", detail="no --api-keys-file: every caller is one tenant, "
                    "shares one prefix cache and can see its hits in cached_prompt_tokens")
    metrics = GatewayMetrics(settings.served_model_name or model_name(settings.model),
                             enable_prefix_caching=settings.enable_prefix_caching)
    host = EngineHost()
    host.start()
    adapters = LoraAdapters(host, frozenset({metrics.model_name}))
    try:
        engines = await host.run(build_engines(settings, tokenizer, metrics, adapters))
    except StartupFailed as exc:
        host.stop()
        raise SystemExit(str(exc)) from exc
    except BaseException:
        host.stop()
        raise
    host.router = engines.router
    limits = engines.limits
    info = ModelInfo(
        model_name=engines.model_name,
        max_model_len=limits.max_model_len,
        vocab_size=limits.vocab_size,
        eos_token_ids=engines.eos_token_ids,
    )
    frontend = Frontend(tokenizer=tokenizer, limits=limits, engines=host, info=info,
                        tenancy=tenancy, max_prompt_bytes=settings.max_prompt_bytes,
                        max_seqs_per_tenant=settings.tenant_max_requests, metrics=metrics,
                        runtime_lora_updating=settings.allow_runtime_lora_updating)
    frontend.adapters = adapters
    http: HttpServer | None = None
    try:
        server = await start_server(
            [(service.GatewayServicer(frontend), service.SERVICE_NAME)],
            settings.host, settings.port, authenticator=tenancy.authenticator(),
            credentials=_public_credentials(settings),
            # A message past this is refused by gRPC itself, before it is parsed.
            max_receive_bytes=2 * settings.max_prompt_bytes + PROTO_OVERHEAD_BYTES,
        )
        if settings.http_port >= 0:
            http = _http_server(settings, frontend, tenancy, metrics, host, engines)
            await http.start()
    except BaseException:
        if http is not None:
            await http.stop()
        frontend.close()
        await host.run(engines.close())
        host.stop()
        raise
    gateway = Gateway(server=server, frontend=frontend, host=host, engines=engines, http=http)
    gateway.tasks.append(
        asyncio.get_running_loop().create_task(_watch_health(server, engines.router))
    )
    if http is not None and settings.http_port_file:
        _write_port(settings.http_port_file, http.port)
    if settings.port_file:  # last: the launcher reads it as "serving"
        _write_port(settings.port_file, server.port)
    log.info("gateway_serving", port=server.port, http_port=http.port if http else None,
             model=metrics.model_name, executors=list(settings.executor_addrs),
             allocators=list(settings.allocator_addrs),
             max_model_len=limits.max_model_len)
    return gateway


def _write_port(path: str, port: int) -> None:
    tmp = Path(f"{path}.tmp")
    tmp.write_text(f"{port}\n")
    tmp.replace(path)  # whole or absent: readers never see half a port


def _http_server(settings: GatewaySettings, frontend: Frontend, tenancy: Tenancy,
                 metrics: GatewayMetrics, host: EngineHost, engines: Engines) -> HttpServer:
    router = engines.router

    async def engine_state() -> tuple[list[EngineSnapshot], int]:
        async def take() -> tuple[list[EngineSnapshot], int]:
            return [snapshot(e) for e in router.engines], engines.shards.num_lease_acquisitions
        return await host.run(take())

    api = HttpApi(
        frontend=frontend, tenancy=tenancy, metrics=metrics,
        served_model_name=metrics.model_name,
        max_body_bytes=2 * settings.max_prompt_bytes + PROTO_OVERHEAD_BYTES,
        max_sse_buffer=settings.max_sse_buffer,
        is_healthy=lambda: not frontend.draining and bool(router.healthy()),
        engine_state=engine_state,
    )
    return HttpServer(create_app(api), settings.host, settings.http_port,
                      tls_cert=settings.public_tls_cert, tls_key=settings.public_tls_key)
