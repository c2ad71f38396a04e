"""LoRA at the gateway: a request of an adapter goes only to executors that hold the same
adapter contents (every routing policy, requeues, moves of waiting requests); its blocks hash
under the adapter's digest; callers cannot take an adapter's salt; loads and unloads are off
unless the gateway allows them, and an unload that outlasts its wait changes nothing."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from common.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Unavailable,
)
from common.executor_description import LoraAdapterInfo
from gateway.api.frontend import Frontend
from gateway.api.sampling import SamplingOptions, check_ids
from gateway.core.request_state import Request
from gateway.engine.adapters import LoraAdapters, adapter_salt
from gateway.engine.router import Router, initial_sequences
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
    with pytest.raises(Unavailable, match="no executor with LoRA adapter 'sql' loaded"):
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


def adapters_over(*engines: FakeEngine, active: list[Request] | None = None) -> LoraAdapters:
    host = SimpleNamespace(engines=list(engines))
    return LoraAdapters(host, frozenset({"base"}),  # type: ignore[arg-type]
                        lambda: active or [], unload_wait_s=0.2)


def test_model_names_resolve_to_adapters_or_the_base_model() -> None:
    adapters = adapters_over(engine("a", SQL), engine("b", SQL_OTHER_WEIGHTS))
    assert adapters.resolve("") is None and adapters.resolve("base") is None
    assert adapters.resolve("sql") == SQL  # the first executor's contents
    with pytest.raises(NotFound, match="`nope` does not exist; this server serves `base`, `sql`"):
        adapters.resolve("nope")


def test_an_unload_that_outlasts_its_wait_leaves_the_adapter_served() -> None:
    running = request("x", SQL)
    adapters = adapters_over(engine("a", SQL), active=[running])
    with pytest.raises(FailedPrecondition, match="still in use by 1 request"):
        asyncio.run(adapters.unload("sql"))
    assert adapters.resolve("sql") == SQL  # new requests are taken again
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
