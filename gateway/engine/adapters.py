"""LoRA adapters across a gateway's executors: the model names requests may use, and loading
and unloading them (the HTTP API's /v1/load_lora_adapter and /v1/unload_lora_adapter, the
gRPC API's LoadLoraAdapter and UnloadLoraAdapter).

The adapters are what the executors report (Describe, kept current by this gateway's loads
and unloads and by the idle probe, which sees another gateway's): the gateway keeps no list
of its own. A load goes to every healthy executor with LoRA on; one that cannot take it (its
slots full) is left out, and routing sends the adapter's requests only to executors that
have it. An unload first stops new requests for the adapter, then waits for this gateway's
requests of it to end and for the executors to release them, up to UNLOAD_WAIT_S, then frees
its slots: running requests are never cut off, and it fails if they outlast the wait.

An adapter's requests hash their blocks under a salt that carries its digest
(`adapter_salt`): KV is shared by requests of the same adapter contents, across gateways, and
never between adapters or with the base model.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

import structlog

from common.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    ServiceError,
    Unavailable,
    Unimplemented,
)
from common.executor_description import LoraAdapterInfo
from gateway.api.sampling import ADAPTER_SALT_PREFIX
from gateway.clients.call_failures import CallFailed, Stale, Unknown
from gateway.core.request_state import Request
from gateway.engine.host import EngineHost
from gateway.engine.loop import Engine

log = structlog.get_logger(__name__)

UNLOAD_WAIT_S = 30.0  # an unload waits this long for the adapter's requests to end
LOAD_TIMEOUT_S = 120.0  # an executor reads and checks the adapter's files in this time
_ERRORS = {cls.code.name: cls for cls in (InvalidArgument, NotFound, AlreadyExists,
                                          FailedPrecondition, ResourceExhausted, Unimplemented)}


def adapter_salt(lora: LoraAdapterInfo | None, cache_salt: str) -> str:
    """The salt a request's blocks hash with: its adapter's digest, then the tenant's salt."""
    return cache_salt if lora is None else f"{ADAPTER_SALT_PREFIX}{lora.digest}:{cache_salt}"


def _domain_error(exc: CallFailed) -> ServiceError:
    """An executor's refusal as the same status to our caller; lost calls: UNAVAILABLE."""
    return _ERRORS.get(exc.status, Unavailable)(f"executor: {exc.details}")


@dataclass(slots=True)
class LoraAdapters:
    host: EngineHost
    base_names: frozenset[str]  # the base model's names: no adapter may take one
    active: Callable[[], Iterable[Request]]  # this gateway's requests in flight
    unloading: set[str] = field(default_factory=set)
    unload_wait_s: float = UNLOAD_WAIT_S

    def available(self) -> dict[str, LoraAdapterInfo]:
        """By name, from the healthy executors (the first's when they differ); any thread."""
        found: dict[str, LoraAdapterInfo] = {}
        for engine in self.host.engines:
            if engine.healthy and not engine.draining:
                for adapter in engine.description.lora_adapters:
                    found.setdefault(adapter.name, adapter)
        return {n: a for n, a in found.items() if n not in self.unloading}

    def resolve(self, model: str) -> LoraAdapterInfo | None:
        """The adapter a request's model names; None: the base model (its name, or none)."""
        if not model or model in self.base_names:
            return None
        adapter = self.available().get(model)
        if adapter is None:
            names = sorted(self.base_names | set(self.available()))
            raise NotFound(f"The model `{model[:128]}` does not exist; this server serves "
                           f"{', '.join(f'`{n}`' for n in names)}")
        return adapter

    async def load(self, name: str, path: str) -> LoraAdapterInfo:
        if name in self.base_names:
            raise InvalidArgument(f"lora_name {name!r} is the base model's name: choose another")
        if not path:
            raise InvalidArgument("lora_path is empty: give the adapter's directory on the "
                                  "executors")
        return await self.host.run(self._load(name, path))

    async def _load(self, name: str, path: str) -> LoraAdapterInfo:
        """On the engine loop: every healthy executor with LoRA on, at once."""
        engines = [e for e in self.host.engines
                   if e.healthy and not e.draining and e.description.max_loras]
        if not engines:
            raise Unimplemented("no executor of this gateway serves LoRA adapters: start them "
                                "with --enable-lora")
        outcomes = await asyncio.gather(*(self._load_on(e, name, path) for e in engines))
        loaded = [o for o in outcomes if isinstance(o, LoraAdapterInfo)]
        refused = [o for o in outcomes if isinstance(o, ServiceError)]
        if not loaded:
            raise refused[0]
        if len({a.digest for a in loaded}) > 1:
            log.warning("lora_adapter_differs", lora_name=name,
                        reason="executors read other files at this path: each serves its own")
        log.info("lora_adapter_loaded", lora_name=name, path=path, num_executors=len(loaded),
                 num_refused=len(refused), digest=loaded[0].digest[:16])
        return loaded[0]

    @staticmethod
    async def _load_on(engine: Engine, name: str, path: str) -> LoraAdapterInfo | ServiceError:
        try:
            adapter = await engine.link.executor.load_lora_adapter(name, path, LOAD_TIMEOUT_S)
        except CallFailed as exc:
            log.info("lora_adapter_refused", lora_name=name, pool_id=engine.pool_id,
                     code=exc.status, detail=exc.details[:200])
            return _domain_error(exc)
        _set_adapters(engine, [*_others(engine, name), adapter])
        return adapter

    async def unload(self, name: str) -> None:
        """Stop new requests for it, wait for its requests here to end, then free its slots on
        every executor (waiting, within the same time, while one still holds a request)."""
        if name in self.unloading or name not in self.available():
            raise NotFound(f"no LoRA adapter named {name[:128]!r} is loaded")
        self.unloading.add(name)
        deadline = time.monotonic() + self.unload_wait_s
        try:
            while users := sum(r.lora is not None and r.lora.name == name
                               for r in self.active()):
                if time.monotonic() > deadline:
                    raise FailedPrecondition(
                        f"LoRA adapter {name!r} is still in use by {users} request(s) after "
                        f"{self.unload_wait_s:g} s; it stays loaded: try again later")
                await asyncio.sleep(0.05)
            await self.host.run(self._unload(name, deadline))
        finally:
            self.unloading.discard(name)
        log.info("lora_adapter_unloaded", lora_name=name)

    async def _unload(self, name: str, deadline: float) -> None:
        """On the engine loop. An executor may hold a finished request until its release
        rides on a call: FAILED_PRECONDITION is retried until the deadline."""
        for engine in [e for e in self.host.engines if e.description.lora_adapter(name)]:
            while True:
                try:
                    await engine.link.executor.unload_lora_adapter(name, timeout=10.0)
                except Unknown:
                    pass  # gone already (another gateway unloaded it)
                except Stale as exc:
                    if time.monotonic() < deadline:
                        await asyncio.sleep(0.05)
                        continue
                    raise FailedPrecondition(f"executor {engine.pool_id}: {exc.details}; "
                                             "try again later") from None
                except CallFailed as exc:
                    raise _domain_error(exc) from None
                break
            _set_adapters(engine, list(_others(engine, name)))


def _others(engine: Engine, name: str) -> Iterable[LoraAdapterInfo]:
    return (a for a in engine.description.lora_adapters if a.name != name)


def _set_adapters(engine: Engine, adapters: list[LoraAdapterInfo]) -> None:
    link = engine.link
    link.description = replace(link.description, lora_adapters=tuple(adapters))
