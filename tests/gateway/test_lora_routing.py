"""LoRA at the gateway: a request of an adapter goes only to executors that hold the same
adapter contents (every routing policy, requeues, moves of waiting requests); its blocks hash
under the adapter's digest; callers cannot take an adapter's salt; loads and unloads are off
unless the gateway allows them, and an unload that outlasts its wait changes nothing."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from common.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Unavailable,
)
from common.executor_description import ExecutorDescription, LoraAdapterInfo
from gateway.api.frontend import Frontend
from gateway.api.sampling import SamplingOptions, check_ids
from gateway.clients.call_failures import failure
from gateway.core.batch import Budget
from gateway.core.parking import Parking
from gateway.core.request_state import Request
from gateway.core.scheduler import Scheduler
from gateway.engine.adapters import LoraAdapters, adapter_salt
from gateway.engine.router import Router, initial_sequences
from gateway.engine.state import EngineState
from tests.gateway.test_router import FakeAllocator, FakeEngine

SQL = LoraAdapterInfo("sql", "d" * 64, 8, "/a/sql")
SQL_OTHER_WEIGHTS = LoraAdapterInfo("sql", "e" * 64, 8, "/b/sql")


def engine(pool_id: str, *adapters: LoraAdapterInfo, load: int = 0) -> FakeEngine:
    return FakeEngine(pool_id, load=load, description=SimpleNamespace(
        role="both", lora_adapters=adapters, max_loras=2))


def request(rid: str = "r", lora: LoraAdapterInfo | None = None) -> Request:
    return Request(request_id=rid, prompt_token_ids=[1, 2, 3],
                   sampling=SamplingOptions(max_tokens=4), cache_salt="", lora=lora)


@pytest.mark.parametrize("policy", ["exact", "approx", "round-robin"])
def test_an_adapters_requests_go_only_where_its_contents_are_loaded(policy: str) -> None:
    # b is idle but has other weights under the name; c is idle without it; a is busy.
    a, b, c = engine("a", SQL, load=9), engine("b", SQL_OTHER_WEIGHTS), engine("c")
    router = Router(engines=[a, b, c], allocator=FakeAllocator({}),  # type: ignore[arg-type]
                    max_waiting=8, policy=policy)
    assert asyncio.run(router.route(request(lora=SQL))) is a
    assert asyncio.run(router.route(request())) in (b, c)  # the base model: anywhere idle
    with pytest.raises(Unavailable, match="no healthy executor has LoRA adapter 'sql' loaded"):
        asyncio.run(Router(engines=[b, c], allocator=FakeAllocator({}),  # type: ignore[arg-type]
                           max_waiting=8, policy=policy).route(request(lora=SQL)))


def test_lost_and_moved_sequences_go_only_where_their_adapter_is() -> None:
    a, b, c = engine("a", SQL), engine("b"), engine("c", SQL, load=5)
    router = Router(engines=[a, b, c], allocator=FakeAllocator({}),  # type: ignore[arg-type]
                    max_waiting=8)
    lora_seq, = initial_sequences(request("x", SQL))
    base_seq, = initial_sequences(request("y"))
    a.healthy = False
    router.requeue([lora_seq, base_seq])
    assert list(c.scheduler.waiting) == [lora_seq]
    assert list(b.scheduler.waiting) == [base_seq]
    # c leaves: its waiting LoRA request has nowhere to go and stays; none is lost.
    c.draining = True
    assert router.move_waiting(c) == 0 and list(c.scheduler.waiting) == [lora_seq]
    c.healthy = False
    orphan, = initial_sequences(request("z", SQL))
    router.requeue([orphan])
    delta = orphan.request.outputs.get_nowait()
    assert isinstance(delta.error, Unavailable) and "'sql' loaded" in str(delta.error)


def test_block_salts_separate_adapters_and_the_base_model() -> None:
    salts = {adapter_salt(None, "s"), adapter_salt(SQL, "s"), adapter_salt(SQL_OTHER_WEIGHTS, "s")}
    assert len(salts) == 3 and adapter_salt(None, "s") == "s"
    assert adapter_salt(SQL, "s") == adapter_salt(LoraAdapterInfo("x", SQL.digest, 4), "s")
    with pytest.raises(InvalidArgument, match="may not start with 'lora:'"):
        check_ids("r", adapter_salt(SQL, ""))  # a caller cannot hash into an adapter's blocks


def adapters_over(*engines: FakeEngine) -> LoraAdapters:
    host = SimpleNamespace(engines=list(engines))
    return LoraAdapters(host, frozenset({"base"}), unload_wait_s=0.2)  # type: ignore[arg-type]


def test_model_names_resolve_to_adapters_or_the_base_model() -> None:
    adapters = adapters_over(engine("a", SQL), engine("b", SQL_OTHER_WEIGHTS))
    assert adapters.resolve("") is None and adapters.resolve("base") is None
    assert adapters.resolve("sql") == SQL  # the first executor's contents
    with pytest.raises(NotFound, match="`nope` does not exist; this server serves `base`, `sql`"):
        adapters.resolve("nope")


def test_an_unload_waits_for_requests_from_their_resolve_and_can_give_up() -> None:
    adapters = adapters_over(engine("a", SQL))
    lora = adapters.resolve("sql")
    adapters.hold(lora)  # a request still tokenizing (Frontend.submit holds it at once)

    async def unload_while_it_runs() -> None:
        unloading = asyncio.create_task(adapters.unload("sql"))
        await asyncio.sleep(0.05)
        assert not unloading.done()  # it waits for the request
        with pytest.raises(NotFound, match="`sql` does not exist"):
            adapters.resolve("sql")  # and takes no new one meanwhile
        with pytest.raises(FailedPrecondition, match="being unloaded"):
            await adapters.load("sql", "/a/sql")
        with pytest.raises(FailedPrecondition, match="still in use by 1 request"):
            await unloading

    asyncio.run(unload_while_it_runs())
    assert adapters.resolve("sql") == SQL  # it stays loaded, new requests are taken again
    adapters.release(lora)
    with pytest.raises(NotFound, match="no LoRA adapter named 'zz'"):
        asyncio.run(adapters.unload("zz"))
    with pytest.raises(InvalidArgument, match="the base model's name"):
        asyncio.run(adapters.load("base", "/x"))


def test_loads_and_unloads_are_off_unless_allowed() -> None:
    frontend = Frontend.__new__(Frontend)  # only the two fields lora_admin reads
    frontend.adapters = adapters_over(engine("a"))
    frontend.runtime_lora_updating = False
    with pytest.raises(PermissionDenied, match="--allow-runtime-lora-updating"):
        frontend.lora_admin()
    frontend.runtime_lora_updating = True
    assert frontend.lora_admin() is frontend.adapters


def description(*adapters: LoraAdapterInfo, generation: int = 0,
                instance_id: str = "instance") -> ExecutorDescription:
    return ExecutorDescription(instance_id, "m", "f", 64, 16, 0, "torch", "cpu", 128, (2,), 512,
                               512, 8, max_loras=2, max_lora_rank=16, lora_adapters=adapters,
                               lora_generation=generation)


@dataclass(eq=False)
class FakeExecutorClient:
    """An executor's LoRA calls: it holds `adapters` by name and answers as the real one."""

    loads: dict[str, LoraAdapterInfo]  # what a load of each name reads there
    adapters: dict[str, LoraAdapterInfo] = field(default_factory=dict)
    held_by: set[str] = field(default_factory=set)  # names a held request uses
    generation: int = 0
    instance_id: str = "instance"

    async def load_lora_adapter(self, name: str, path: str, timeout: float) -> LoraAdapterInfo:
        found = self.loads[name]
        if name in self.adapters and self.adapters[name].digest != found.digest:
            raise failure(grpc.StatusCode.ALREADY_EXISTS, "loaded with other weights")
        self.adapters[name] = found
        self.generation += 1
        return found

    async def unload_lora_adapter(self, name: str, timeout: float) -> None:
        if name in self.held_by:
            raise failure(grpc.StatusCode.FAILED_PRECONDITION, f"{name!r} is in use")
        if self.adapters.pop(name, None) is None:
            raise failure(grpc.StatusCode.NOT_FOUND, "no adapter")
        self.generation += 1

    async def describe(self, timeout: float) -> ExecutorDescription:
        return description(*self.adapters.values(), generation=self.generation,
                           instance_id=self.instance_id)


class LoraEngine(FakeEngine):
    """A FakeEngine with a real description and EngineState's own adapter bookkeeping."""

    take_lora_adapters = EngineState.take_lora_adapters
    fail_unserved = EngineState.fail_unserved
    fail = EngineState.fail

    def __init__(self, pool_id: str, client: FakeExecutorClient) -> None:
        super().__init__(pool_id)
        self.link = SimpleNamespace(executor=client, description=description(
            *client.adapters.values(), generation=client.generation))
        self.scheduler = Scheduler(Budget(8, 256), block_size=16)  # type: ignore[assignment]
        self.outbox: list[object] = []
        self.adapters_changed = False
        self.wakeup = asyncio.Event()

    @property
    def description(self) -> ExecutorDescription:  # type: ignore[override]
        return self.link.description  # type: ignore[no-any-return]

    @description.setter
    def description(self, value: object) -> None:
        pass

    def deliver(self) -> None:
        pass


def lora_admin(*engines: LoraEngine) -> LoraAdapters:
    async def run(coro: Any) -> Any:
        return await coro

    host = SimpleNamespace(engines=list(engines), run=run)
    return LoraAdapters(host, frozenset({"base"}), unload_wait_s=0.3)  # type: ignore[arg-type]


def test_a_load_that_meets_other_weights_is_undone_and_refused() -> None:
    # a takes sql; b already holds another sql: refused (409), and a is back as it was.
    a = LoraEngine("a", FakeExecutorClient({"sql": SQL}))
    b = LoraEngine("b", FakeExecutorClient({"sql": SQL}, {"sql": SQL_OTHER_WEIGHTS}))
    admin = lora_admin(a, b)
    with pytest.raises(AlreadyExists):
        asyncio.run(admin.load("sql", "/a/sql"))
    assert a.link.executor.adapters == {} and a.description.lora_adapters == ()
    assert b.description.lora_adapters == (SQL_OTHER_WEIGHTS,)
    # Different files at one path on two executors: refused too, undone on both.
    c, d = (LoraEngine(p, FakeExecutorClient({"sql": x})) for p, x in
            (("c", SQL), ("d", SQL_OTHER_WEIGHTS)))
    with pytest.raises(FailedPrecondition, match="different contents"):
        asyncio.run(lora_admin(c, d).load("sql", "/a/sql"))
    assert c.link.executor.adapters == d.link.executor.adapters == {}
    # One that takes it: loaded there, and the engine's view is the executor's.
    e = LoraEngine("e", FakeExecutorClient({"sql": SQL}))
    assert asyncio.run(lora_admin(e).load("sql", "/a/sql")) == SQL
    assert e.description.lora_adapters == (SQL,) and e.description.lora_generation == 1


def test_an_unload_names_the_executors_that_keep_the_adapter() -> None:
    # b holds a request of sql (another gateway's): a unloads it, b refuses until the
    # deadline; the error says b keeps it.
    a = LoraEngine("a", FakeExecutorClient({}, {"sql": SQL}))
    b = LoraEngine("b", FakeExecutorClient({}, {"sql": SQL}, held_by={"sql"}))
    with pytest.raises(FailedPrecondition, match="stays loaded on b"):
        asyncio.run(lora_admin(a, b).unload("sql"))
    assert a.description.lora_adapters == () and b.description.lora_adapters == (SQL,)


def test_a_newer_describe_answer_fails_waiting_requests_of_an_adapter_gone() -> None:
    a = LoraEngine("a", FakeExecutorClient({}, {"sql": SQL}, generation=3))
    waiting, sent = (initial_sequences(request(r, SQL))[0] for r in ("w", "s"))
    base = initial_sequences(request("b"))[0]
    sent.known_to_executor = True  # the executor holds it: it refuses the unload itself
    a.scheduler.waiting.extend([waiting, sent, base])
    a.take_lora_adapters(description(generation=2))  # older: ignored
    assert a.description.lora_adapters == (SQL,)
    a.take_lora_adapters(description(generation=4))  # another gateway unloaded it
    assert a.description.lora_adapters == ()
    # Not at once (a Step may be out with them in it): before the engine's next step.
    assert a.adapters_changed and len(a.scheduler.waiting) == 3
    a.fail_unserved()
    assert list(a.scheduler.waiting) == [sent, base]
    error = waiting.request.outputs.get_nowait().error
    assert isinstance(error, NotFound) and "was unloaded from executor a" in str(error)


def test_only_sequences_whose_adapter_a_target_holds_are_parked_to_move() -> None:
    parking = Parking(move_quota=3, adapters=frozenset({(SQL.name, SQL.digest)}))
    seqs = [initial_sequences(request(r, lora))[0]
            for r, lora in (("x", SQL), ("y", SQL_OTHER_WEIGHTS), ("z", None))]
    for seq in seqs:
        seq.output_token_ids.append(5)  # sampled: the prompt computed where it is, idle
        seq.num_computed_tokens = 3
    parking.park_leavers(seqs)
    assert parking.parked == [seqs[2], seqs[0]]  # the newest first; y's adapter has no target


def test_an_executor_that_restarts_gets_the_run_time_adapters_again() -> None:
    a = LoraEngine("a", FakeExecutorClient({"sql": SQL}))
    full = FakeExecutorClient({})  # its slots are full: it refuses the load
    full.load_lora_adapter = _refuse  # type: ignore[method-assign]
    b = LoraEngine("b", full)
    admin = lora_admin(a, b)
    asyncio.run(admin.load("sql", "/a/sql"))
    asyncio.run(admin.reload([a, b]))  # a seen holding it; b never did: nothing forgotten
    # Both restart: new instances with nothing loaded (reconnecting took their description).
    for engine, pool in ((a, "a"), (b, "b")):
        engine.link.executor = FakeExecutorClient({"sql": SQL}, instance_id=f"{pool}2")
        engine.link.description = description(instance_id=f"{pool}2")
    asyncio.run(admin.reload([a, b]))
    assert a.link.executor.adapters == b.link.executor.adapters == {"sql": SQL}
    assert a.description.lora_adapters == (SQL,)
    asyncio.run(admin.reload([a, b]))  # seen holding it, as these instances
    # Unloaded on a by someone else (the same instance): forgotten, not loaded again.
    a.link.executor.adapters.clear()
    a.link.description = replace(a.description, lora_adapters=())
    asyncio.run(admin.reload([a, b]))
    a.link.executor.instance_id = "a3"
    a.link.description = description(instance_id="a3")
    asyncio.run(admin.reload([a, b]))
    assert a.link.executor.adapters == {}


async def _refuse(name: str, path: str, timeout: float) -> LoraAdapterInfo:
    raise failure(grpc.StatusCode.RESOURCE_EXHAUSTED, "all 1 adapter slots are in use")


def test_an_unload_whose_caller_goes_away_still_finishes() -> None:
    a = LoraEngine("a", FakeExecutorClient({"sql": SQL}))
    admin = lora_admin(a)

    async def scenario() -> None:
        await admin.load("sql", "/a/sql")
        lora = admin.resolve("sql")
        admin.hold(lora)  # a request of it runs
        caller = asyncio.create_task(admin.unload("sql"))
        await asyncio.sleep(0.05)
        caller.cancel()  # its client went away (a deadline)
        await asyncio.sleep(0.05)
        with pytest.raises(NotFound):
            admin.resolve("sql")  # still hidden: the unload goes on
        admin.release(lora)  # the request ends
        for _ in range(40):
            if not admin.unloading:
                break
            await asyncio.sleep(0.05)

    asyncio.run(scenario())
    assert a.link.executor.adapters == {} and "sql" not in admin.loaded
