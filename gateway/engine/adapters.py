"""LoRA adapters across a gateway's executors: the model names requests may use, and loading
and unloading them (the HTTP API's /v1/load_lora_adapter and /v1/unload_lora_adapter, the
gRPC API's LoadLoraAdapter and UnloadLoraAdapter).

The adapters are what the executors report (Describe's lora_adapters, with a generation that
orders the answers): the gateway keeps no list of its own. Its own loads and unloads describe
the executor again once done, and `follow_adapters` asks every LORA_REFRESH_S, so another
gateway's loads and unloads are seen within that time, busy or idle. An executor's adapter
that disappears fails this gateway's waiting requests of it that the executor does not hold
yet (NOT_FOUND), before the engine's next step (Engine.fail_unserved): the executor would
refuse their whole step.

A load goes to every healthy executor with LoRA on; one whose slots are full is left out, and
routing sends the adapter's requests only to executors that hold it. A load that finds the
name with other weights on any executor, or different contents at the path on two of them,
is undone where it was done and refused. An unload first stops new requests for the adapter,
then waits, up to UNLOAD_WAIT_S, for every request of it this gateway has taken (counted from
the moment its model name was resolved, so a request still tokenizing counts) and for every
sequence of it to leave the engines, then frees its slots on every healthy executor (each
refuses while it holds a request of it, from any gateway: retried until the deadline). If the
wait runs out it fails (FAILED_PRECONDITION) and names the executors that still hold it.

An adapter's requests hash their blocks under a salt that carries its digest
(`adapter_salt`): KV is shared by requests of the same adapter contents, across gateways, and
never between adapters or with the base model.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import structlog

from common.errors import (
    AlreadyExists,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    ServiceError,
    Unavailable,
    Unimplemented,
)
from common.executor_description import LoraAdapterInfo
from gateway.api.sampling import ADAPTER_SALT_PREFIX
from gateway.clients.call_failures import CallFailed, Lost, Stale, Unknown
from gateway.engine.host import EngineHost
from gateway.engine.loop import Engine

log = structlog.get_logger(__name__)

UNLOAD_WAIT_S = 30.0  # an unload waits this long for the adapter's requests to end
LOAD_TIMEOUT_S = 120.0  # an executor reads and checks the adapter's files in this time
LORA_REFRESH_S = 5.0  # how stale this gateway's view of another gateway's loads may be
_ERRORS = {cls.code.name: cls for cls in (InvalidArgument, NotFound, AlreadyExists,
                                          FailedPrecondition, ResourceExhausted, Unimplemented)}


def adapter_salt(lora: LoraAdapterInfo | None, cache_salt: str) -> str:
    """The salt a request's blocks hash with: its adapter's digest, then the tenant's salt."""
    return cache_salt if lora is None else f"{ADAPTER_SALT_PREFIX}{lora.digest}:{cache_salt}"


def _domain_error(engine: Engine, exc: CallFailed) -> ServiceError:
    """An executor's refusal as the same status to our caller; a lost call: UNAVAILABLE;
    anything else the executor should not have answered: INTERNAL."""
    if isinstance(exc, Lost):
        return Unavailable(f"executor {engine.pool_id}: {exc.details}")
    return _ERRORS.get(exc.status, Internal)(f"executor {engine.pool_id}: {exc.details}")


async def describe_again(engine: Engine) -> None:
    try:
        engine.take_lora_adapters(await engine.link.executor.describe(timeout=5.0))
    except CallFailed as exc:
        log.info("lora_describe_failed", pool_id=engine.pool_id, code=exc.status)


async def follow_adapters(engines: Callable[[], Sequence[Engine]],
                          adapters: LoraAdapters) -> None:
    """On the engine loop, until cancelled: every executor with LoRA on, described again;
    one new to this gateway (restarted, or joined) gets the adapters loaded here at run time."""
    while True:
        await asyncio.sleep(LORA_REFRESH_S)
        try:
            current = [e for e in engines() if e.healthy and e.description.max_loras]
            await asyncio.gather(*(describe_again(e) for e in current))
            await adapters.reload(current)
        except Exception:  # noqa: BLE001 - a bug must not end the refreshes for good
            log.exception("lora_refresh_failed")


@dataclass(slots=True)
class LoraAdapters:
    host: EngineHost
    base_names: frozenset[str]  # the base model's names: no adapter may take one
    unloading: set[str] = field(default_factory=set)
    unload_wait_s: float = UNLOAD_WAIT_S
    # This gateway's requests of each adapter, from resolve to their end (`hold`, `release`).
    users: collections.Counter[str] = field(default_factory=collections.Counter)
    # Loaded at run time through this gateway, by name: (path, digest), and the executor
    # instances (pool, instance id) seen holding it. An instance new here (restarted, or
    # joined) gets them again; one seen holding an adapter that then lacks it (unloaded
    # elsewhere) makes this gateway forget it. The instances already offered them, by pool.
    loaded: dict[str, tuple[str, str]] = field(default_factory=dict)
    holders: dict[str, set[tuple[str, str]]] = field(default_factory=dict)
    instances: dict[str, str] = field(default_factory=dict)

    async def reload(self, engines: Sequence[Engine]) -> None:
        """On the engine loop: first what the executors say (forget what was unloaded
        elsewhere), then the run-time adapters onto instances new here."""
        for engine in engines:
            instance = (engine.pool_id, engine.description.instance_id)
            for name, (_, digest) in list(self.loaded.items()):
                held = engine.description.lora_adapter(name)
                if held is not None and held.digest == digest:
                    self.holders.setdefault(name, set()).add(instance)
                elif instance in self.holders.get(name, ()):
                    self.loaded.pop(name)  # unloaded or replaced by someone else
                    self.holders.pop(name, None)
        for engine in engines:
            description = engine.description
            if self.instances.get(engine.pool_id) == description.instance_id:
                continue
            missing = [(name, path) for name, (path, _) in self.loaded.items()
                       if description.lora_adapter(name) is None and name not in self.unloading]
            outcomes = [await self._load_on(engine, name, path) for name, path in missing]
            if not any(isinstance(o, Unavailable | Internal) for o in outcomes):
                self.instances[engine.pool_id] = description.instance_id  # else: next time
            await describe_again(engine)

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

    def hold(self, lora: LoraAdapterInfo | None) -> None:
        """A request of `lora` taken (the API's loop, right after resolve): unloads wait."""
        if lora is not None:
            self.users[lora.name] += 1

    def release(self, lora: LoraAdapterInfo | None) -> None:
        if lora is not None:
            self.users[lora.name] -= 1

    async def load(self, name: str, path: str) -> LoraAdapterInfo:
        if name in self.base_names:
            raise InvalidArgument(f"lora_name {name!r} is the base model's name: choose another")
        if not path:
            raise InvalidArgument("lora_path is empty: give the adapter's directory on the "
                                  "executors")
        if name in self.unloading:
            raise FailedPrecondition(f"LoRA adapter {name!r} is being unloaded: load it once "
                                     "that has finished")
        # Shielded: a caller that goes away does not stop it half done (or half undone).
        return await asyncio.shield(self.host.run(self._load(name, path)))

    async def _load(self, name: str, path: str) -> LoraAdapterInfo:
        """On the engine loop: every healthy executor with LoRA on, at once."""
        engines = [e for e in self.host.engines
                   if e.healthy and not e.draining and e.description.max_loras]
        if not engines:
            raise Unimplemented("no executor of this gateway serves LoRA adapters: start them "
                                "with --enable-lora")
        had = {e: e.description.lora_adapter(name) for e in engines}
        outcomes = await asyncio.gather(*(self._load_on(e, name, path) for e in engines))
        loaded = {e: o for e, o in zip(engines, outcomes, strict=True)
                  if isinstance(o, LoraAdapterInfo)}
        refused = [o for o in outcomes if isinstance(o, ServiceError)]
        conflict: ServiceError | None = next(
            (o for o in refused if isinstance(o, AlreadyExists)), None)
        if conflict is None and len({a.digest for a in loaded.values()}) > 1:
            conflict = FailedPrecondition(
                f"the executors read different contents at {path}: give them the same files")
        if conflict is None and not loaded:
            raise refused[0]
        if conflict is not None:
            # Undone where this call loaded it; the engines have not been told of it yet, so
            # nothing routes there meanwhile.
            undone = [e for e in loaded if had[e] is None]
            kept = await asyncio.gather(*(self._unload_from(e, name, time.monotonic() + 2.0)
                                          for e in undone))
            left = [e.pool_id for e, k in zip(undone, kept, strict=True) if k is not None]
            raise type(conflict)(str(conflict) + (
                f" (it could not be undone on {', '.join(left)})" if left else ""))
        await asyncio.gather(*(describe_again(e) for e in loaded))
        first = next(iter(loaded.values()))
        self.loaded[name] = (path, first.digest)
        log.info("lora_adapter_loaded", lora_name=name, path=path, num_executors=len(loaded),
                 num_refused=len(refused), digest=first.digest[:16])
        return first

    @staticmethod
    async def _load_on(engine: Engine, name: str, path: str) -> LoraAdapterInfo | ServiceError:
        try:
            adapter = await engine.link.executor.load_lora_adapter(name, path, LOAD_TIMEOUT_S)
        except CallFailed as exc:
            log.info("lora_adapter_refused", lora_name=name, pool_id=engine.pool_id,
                     code=exc.status, detail=exc.details[:200])
            return _domain_error(engine, exc)
        return adapter

    async def unload(self, name: str) -> None:
        """Stop new requests for it, wait for its requests here to end, then free its slots on
        every executor (waiting, within the same time, while one still holds a request)."""
        if name in self.unloading:
            raise FailedPrecondition(f"LoRA adapter {name!r} is being unloaded already")
        if name not in self.available():
            raise NotFound(f"no LoRA adapter named {name[:128]!r} is loaded")
        self.unloading.add(name)
        # One task from here to the end, whose end clears the mark: a caller that goes
        # away leaves it running (and the adapter hidden) until it is done.
        task = asyncio.ensure_future(self._unload_all(name))
        task.add_done_callback(lambda done: self._unloaded(name, done))
        await asyncio.shield(task)

    def _unloaded(self, name: str, done: asyncio.Future[None]) -> None:
        self.unloading.discard(name)
        if done.cancelled() or done.exception() is not None:
            return
        self.loaded.pop(name, None)
        self.holders.pop(name, None)
        log.info("lora_adapter_unloaded", lora_name=name)

    async def _unload_all(self, name: str) -> None:
        deadline = time.monotonic() + self.unload_wait_s
        while (users := self.users[name]) > 0:
            if time.monotonic() > deadline:
                raise FailedPrecondition(
                    f"LoRA adapter {name!r} is still in use by {users} request(s) after "
                    f"{self.unload_wait_s:g} s; it stays loaded: try again later")
            await asyncio.sleep(0.05)
        await self.host.run(self._unload(name, deadline))

    async def _unload(self, name: str, deadline: float) -> None:
        """On the engine loop: once no engine has a sequence of it, from every healthy
        executor that has it; the ones still holding it when the time is up are named."""
        await asyncio.gather(*(describe_again(e) for e in self.host.engines
                               if e.healthy and e.description.max_loras))  # the newest
        holding = [e for e in self.host.engines if e.description.lora_adapter(name)]
        while any(s.request.lora is not None and s.request.lora.name == name
                  and not s.is_finished for e in holding for s in e.scheduler.sequences()):
            if time.monotonic() > deadline:
                raise FailedPrecondition(
                    f"LoRA adapter {name!r}: its requests have not left the engines in "
                    f"{self.unload_wait_s:g} s; it stays loaded: try again later")
            await asyncio.sleep(0.05)
        targets = [e for e in holding if e.healthy]
        failed = await asyncio.gather(*(self._unload_from(e, name, deadline) for e in targets))
        still = [e.pool_id for e, f in zip(targets, failed, strict=True) if f is not None]
        if still:
            first = next(f for f in failed if f is not None)
            raise type(first)(f"LoRA adapter {name!r} stays loaded on {', '.join(still)} "
                              f"(the others unloaded it): {first}")

    @staticmethod
    async def _unload_from(engine: Engine, name: str, deadline: float) -> ServiceError | None:
        """One executor; FAILED_PRECONDITION (a request held there, maybe another gateway's,
        or one whose release has yet to reach it) is retried until the deadline."""
        while True:
            try:
                await engine.link.executor.unload_lora_adapter(name, timeout=10.0)
            except Unknown:
                pass  # gone already (another gateway unloaded it)
            except Stale as exc:
                if time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                    continue
                return FailedPrecondition(f"executor {engine.pool_id}: {exc.details}")
            except CallFailed as exc:
                return _domain_error(engine, exc)
            await describe_again(engine)
            return None

