"""Deadlines on the hot path, against real gRPC servers on loopback that stall.

The allocator is the real servicer over the real core, made to stall after it applied a Step
(the gateway cannot tell whether it did); the executor is a tiny servicer whose Execute never
answers. Nothing may hang, nothing may leak, clients get a precise status.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import grpc
import pytest
import structlog
from in_process import FakeModel

from allocator_svc.core.allocator import Allocator, Limits
from allocator_svc.service import AllocatorServicer
from common.executor_description import ExecutorDescription
from common.interceptor import guarded_handler
from common.step_records import StepCall, StepItem
from gateway.api.sampling import SamplingOptions
from gateway.clients.allocator_client import AllocatorClient
from gateway.clients.call_failures import failure
from gateway.clients.executor_client import ExecutorClient
from gateway.clients.lease import Lease
from gateway.clients.pool_link import PoolLink
from gateway.core.batch import Budget
from gateway.core.finish_rules import FinishRules
from gateway.core.request_state import CompletionDelta, Request
from gateway.core.scheduler import Scheduler
from gateway.core.step import ExecuteCall, ExecuteResult
from gateway.engine import recovery
from gateway.engine.loop import Engine
from gateway.engine.router import Router
from gateway.text.tokenizer import Tokenizer
from pagedkv.executor.v1 import executor_pb2 as epb
from pagedkv.executor.v1 import executor_pb2_grpc

pytestmark = pytest.mark.service

BLOCK = 4
NUM_BLOCKS = 64
TIMEOUT_S = 0.3
STALL_S = 1.0
DESCRIPTION = ExecutorDescription(
    instance_id="executor-1", model_name="fake", model_fingerprint="fake-model",
    num_blocks=NUM_BLOCKS, block_size=BLOCK, num_cpu_blocks=0, backend="fake", device="cpu",
    max_model_len=256, eos_token_ids=(2,), vocab_size=97, max_num_batched_tokens=64,
    max_num_seqs=8,
)


class StallingAllocator(AllocatorServicer):
    """The real allocator; a chosen Step (or, while `hung`, every Step) is applied and then
    answered only after STALL_S; while `hung`, an Abort is not applied at all."""

    def __init__(self) -> None:
        super().__init__(Allocator(Limits()))
        self.stall_step: Callable[[Any], bool] = lambda request: False
        self.hung = False
        self.refuse_aborts = False

    async def _stall(self) -> None:
        await asyncio.sleep(STALL_S)

    async def Step(self, request: Any, context: Any) -> Any:  # noqa: N802
        response = await super().Step(request, context)
        if self.hung or self.stall_step(request):
            self.stall_step = lambda request: False
            await self._stall()
        return response

    async def Abort(self, request: Any, context: Any) -> Any:  # noqa: N802
        if self.refuse_aborts:  # a refusal that retrying cannot change
            await context.abort(grpc.StatusCode.INTERNAL, "refused")
        if self.hung:  # answers nothing and applies nothing
            await self._stall()
            await context.abort(grpc.StatusCode.UNAVAILABLE, "hung")
        return await super().Abort(request, context)

    def held(self) -> list[str]:
        """Request ids the allocator holds in any pool (the invariants checked on the way)."""
        self.allocator.check_invariants()
        return [r for pool in self.allocator.pools.values() for r in pool.requests]


class StallingExecutor(executor_pb2_grpc.ExecutorServiceServicer):
    """Describes itself; Execute never answers; Release records what it was asked to drop."""

    def __init__(self) -> None:
        self.released: list[str] = []

    async def Describe(self, request: Any, context: Any) -> Any:  # noqa: N802
        d = DESCRIPTION
        return epb.DescribeResponse(
            instance_id=d.instance_id, model_name=d.model_name,
            model_fingerprint=d.model_fingerprint, num_blocks=d.num_blocks,
            block_size=d.block_size, max_model_len=d.max_model_len,
            eos_token_ids=d.eos_token_ids, vocab_size=d.vocab_size,
            max_num_batched_tokens=d.max_num_batched_tokens, max_num_seqs=d.max_num_seqs,
        )

    async def Execute(self, request: Any, context: Any) -> Any:  # noqa: N802
        await asyncio.sleep(3600)

    async def Release(self, request: Any, context: Any) -> Any:  # noqa: N802
        self.released.extend(request.request_ids)
        return epb.ReleaseResponse(num_released=len(request.request_ids))


@dataclass
class InProcessExecutor:
    """The fake model behind the ExecutorClient calls PoolLink makes."""

    model: FakeModel = field(default_factory=lambda: FakeModel(BLOCK))
    address: str = "in-process"

    async def execute(
        self, call: ExecuteCall, timeout: float | None = None, step_id: int = 0,
        previous_step_id: int = 0,
    ) -> ExecuteResult:
        return self.model.execute(call)

    async def release(self, request_ids: list[str], timeout: float | None = None) -> None:
        self.model.execute(ExecuteCall(tuple(request_ids), (), (), (), ()))

    async def describe(self, timeout: float | None = None) -> ExecutorDescription:
        return DESCRIPTION


@dataclass
class QueueingExecutor(InProcessExecutor):
    """Runs Executes one at a time, each taking `compute_s`, against the caller's deadline
    (which runs while a call waits for the one before, as at a real executor); records the
    calls launched ahead (`previous_step_id`)."""

    compute_s: float = 0.0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    ahead: int = 0

    async def execute(
        self, call: ExecuteCall, timeout: float | None = None, step_id: int = 0,
        previous_step_id: int = 0,
    ) -> ExecuteResult:
        self.ahead += bool(previous_step_id)

        async def run() -> ExecuteResult:
            async with self.lock:
                await asyncio.sleep(self.compute_s)
                return self.model.execute(call)

        try:
            return await asyncio.wait_for(run(), timeout)
        except TimeoutError:
            raise failure(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline") from None


async def serve(servicer: Any, service_name: str) -> grpc.aio.Server:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((guarded_handler(servicer, service_name),))
    server.port = server.add_insecure_port("127.0.0.1:0")  # type: ignore[attr-defined]
    await server.start()
    return server


@dataclass
class Rig:
    allocator: StallingAllocator
    engine: Engine
    router: Router


@asynccontextmanager
async def rig(
    tokenizer: Tokenizer, executor: Any = None, description: ExecutorDescription = DESCRIPTION
) -> AsyncIterator[Rig]:
    """The real allocator on a port, one engine over it (its loop running), a router."""
    servicer = StallingAllocator()
    server = await serve(servicer,
                         "pagedkv.allocator.v1.AllocatorService")
    client = AllocatorClient(f"127.0.0.1:{server.port}", timeout_s=TIMEOUT_S)  # type: ignore[attr-defined]
    lease = Lease(allocator=client, ttl_ms=10_000)
    await lease.acquire()
    link = PoolLink(pool_id="pool-0", executor=executor or InProcessExecutor(),
                    allocator=client, lease=lease, description=description,
                    enable_prefix_caching=True, execute_timeout_s=TIMEOUT_S)
    await link.register()
    router = Router(engines=[], allocator=client, max_waiting=64)
    engine = Engine(
        link=link,
        scheduler=Scheduler(Budget(max_num_seqs=8, max_num_batched_tokens=16), BLOCK),
        finish_rules=FinishRules(frozenset({2}), max_model_len=256, decoder=tokenizer),
        on_lost=router.requeue,
        allocator_retry_s=0.5,
    )
    router.engines.append(engine)
    loop = asyncio.get_running_loop()
    tasks = [loop.create_task(engine.run())]
    try:
        yield Rig(servicer, engine, router)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await client.close()
        await server.stop(None)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.load("models/tiny-llama")


@pytest.fixture(autouse=True)
def quick_recovery(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(recovery, "RECONNECT_INTERVAL_S", 0.2)


async def submit(rig: Rig, rid: str, prompt: list[int], max_tokens: int) -> Request:
    req = Request(request_id=rid, prompt_token_ids=prompt, cache_salt="",
                  sampling=SamplingOptions(max_tokens=max_tokens, ignore_eos=True))
    await rig.router.submit(req)
    return req


async def collect(req: Request, timeout_s: float = 10.0) -> list[CompletionDelta]:
    """Deltas until the completion finishes or fails (a hang fails the test)."""
    deltas: list[CompletionDelta] = []
    while not deltas or (deltas[-1].finish_reason is None and deltas[-1].error is None):
        deltas.append(await asyncio.wait_for(req.outputs.get(), timeout_s))
    return deltas


async def until_idle(engine: Engine, timeout_s: float = 10.0) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if not engine.busy:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the engine never went idle")


async def one_request_against(
    servicer: Any, tokenizer: Tokenizer
) -> tuple[list[CompletionDelta], list[str], bool]:
    """Serve `servicer` as the only executor, run one 5-token request through it until the
    engine is idle: its deltas, what the allocator still holds, whether the engine is healthy."""
    server = await serve(servicer,
                         "pagedkv.executor.v1.ExecutorService")
    executor = ExecutorClient(f"127.0.0.1:{server.port}")  # type: ignore[attr-defined]
    try:
        async with rig(tokenizer, executor) as r:
            deltas = await collect(await submit(r, "a", [3] * 6, max_tokens=5))
            await until_idle(r.engine)
            return deltas, r.allocator.held(), r.engine.healthy
    finally:
        await executor.close()
        await server.stop(None)


def test_step_past_its_deadline_is_not_resent_and_leaks_nothing(tokenizer: Tokenizer):
    # The allocator applies the Step that admits "b" (next to a decoding "a") but answers
    # after the deadline: the gateway aborts what it may hold, readmits both (recompute);
    # outputs equal the reference, and no block is left held.
    model = FakeModel(BLOCK)

    async def scenario() -> tuple[list[list[int]], list[str], list[dict[str, Any]]]:
        async with rig(tokenizer, InProcessExecutor(model)) as r:
            r.allocator.stall_step = lambda request: any(i.prompt_token_ids
                                                         for i in request.items)
            a = await submit(r, "a", [3] * 6, max_tokens=12)
            await asyncio.sleep(0.1)  # "a" is decoding
            r.allocator.stall_step = lambda request: bool(request.decode_request_ids) and any(
                i.prompt_token_ids for i in request.items)
            b = await submit(r, "b", [4] * 9, max_tokens=12)
            with structlog.testing.capture_logs() as logs:
                outputs = [await collect(a), await collect(b)]
                await until_idle(r.engine)
            tokens = [[t for d in deltas for t in d.token_ids] for deltas in outputs]
            return tokens, r.allocator.held(), logs

    (a_tokens, b_tokens), held, logs = asyncio.run(scenario())
    events = [e["event"] for e in logs]
    assert "allocator_step_failed" in events and "orphans_aborted" in events
    assert a_tokens == model.reference([3] * 6, 12)
    assert b_tokens == model.reference([4] * 9, 12)
    assert held == [] and not model.held


def test_hung_allocator_fails_requests_with_unavailable_then_gets_its_blocks_back(
    tokenizer: Tokenizer,
):
    # The allocator applies every Step but answers none in time, and drops every Abort: the
    # client gets UNAVAILABLE after the retry window instead of hanging; once the allocator
    # answers again, what it held for the request is aborted.
    async def scenario() -> tuple[list[CompletionDelta], list[str], list[str]]:
        async with rig(tokenizer) as r:
            r.allocator.hung = True
            req = await submit(r, "a", [3] * 6, max_tokens=50)
            deltas = await collect(req)
            held_while_hung = r.allocator.held()
            r.allocator.hung = False
            await until_idle(r.engine)
            return deltas, held_while_hung, r.allocator.held()

    deltas, held_while_hung, held = asyncio.run(scenario())
    error = deltas[-1].error
    assert error is not None and error.code is grpc.StatusCode.UNAVAILABLE
    assert "allocator has not answered" in str(error)
    assert held_while_hung == ["a"]
    assert held == []


def test_executor_past_its_deadline_is_lost_and_its_requests_released(tokenizer: Tokenizer):
    # Execute never answers: the only executor is lost, the client gets UNAVAILABLE; the
    # allocator gets the blocks back, and once Describe answers again (the same instance)
    # the executor is told to release the request.
    servicer = StallingExecutor()
    deltas, held, healthy = asyncio.run(one_request_against(servicer, tokenizer))
    error = deltas[-1].error
    assert error is not None and error.code is grpc.StatusCode.UNAVAILABLE
    assert held == [] and servicer.released == ["a"] and healthy


class ExecutorWithoutCompactDecodes(StallingExecutor):
    """Answers Execute like an executor that predates the compact decode columns: a token
    for each sampling sequence of `seqs`, nothing for the columns it does not know."""

    async def Execute(self, request: Any, context: Any) -> Any:  # noqa: N802
        return epb.ExecuteResponse(
            tokens=[epb.SampledToken(request_id=s.request_id, token_id=5) for s in request.seqs
                    if s.sample],
            num_tokens=sum(len(s.token_ids) for s in request.seqs),
        )


class ExecutorDroppingSampledTokens(StallingExecutor):
    """Answers Execute with a token for each compact decode but none for the sequences of
    `seqs` that sample (the prefill): it breaks the contract."""

    async def Execute(self, request: Any, context: Any) -> Any:  # noqa: N802
        return epb.ExecuteResponse(
            decode_sampled_token_ids=[5] * len(request.decode_request_ids),
            num_tokens=sum(len(s.token_ids) for s in request.seqs),
        )


@pytest.mark.parametrize(
    ("servicer", "code", "num_tokens"),
    [(ExecutorWithoutCompactDecodes, "UNIMPLEMENTED", 1),
     (ExecutorDroppingSampledTokens, "INTERNAL", 0)],
    ids=["ignores-compact-decodes", "no-token-for-a-sampling-sequence"],
)
def test_an_executor_breaking_the_contract_fails_the_step_cleanly(
    tokenizer: Tokenizer, servicer: type[StallingExecutor], code: str, num_tokens: int
):
    # An executor that ignores the compact decode columns (the first decode comes back
    # without tokens), or returns no token for the prefill, which samples: the request fails
    # with a status naming the cause (the step counts as rejected, not an internal error of
    # the gateway) after the tokens it had, nothing leaks, and the engine keeps serving.
    deltas, held, healthy = asyncio.run(one_request_against(servicer(), tokenizer))
    error = deltas[-1].error
    assert error is not None and error.code is grpc.StatusCode.UNAVAILABLE
    assert code in str(error) and len([t for d in deltas for t in d.token_ids]) == num_tokens
    assert held == [] and healthy


def test_orphans_the_allocator_refuses_to_abort_are_given_up_and_the_engine_goes_on(
    tokenizer: Tokenizer,
):
    # A Step past its deadline leaves orphans; the allocator refuses their Abort with a code
    # retrying cannot change: they are logged and given up (the request they belong to ends
    # with an error), and the engine goes on serving: the next request gets the reference
    # tokens. Before, it retried forever and then failed every request.
    model = FakeModel(BLOCK)

    async def scenario() -> tuple[list[CompletionDelta], list[int], list[str]]:
        async with rig(tokenizer, InProcessExecutor(model)) as r:
            r.allocator.refuse_aborts = True
            r.allocator.stall_step = lambda request: any(i.prompt_token_ids
                                                         for i in request.items)
            with structlog.testing.capture_logs() as logs:
                first = await collect(await submit(r, "a", [3] * 6, max_tokens=8))
                await until_idle(r.engine)
                second = await collect(await submit(r, "b", [4] * 6, max_tokens=8))
            return first, [t for d in second for t in d.token_ids], [e["event"] for e in logs]

    first, second_tokens, events = asyncio.run(scenario())
    assert "orphans_given_up" in events
    assert first[-1].error is not None
    assert second_tokens == model.reference([4] * 6, 8)


def test_orphan_aborts_cannot_touch_another_leases_request_with_the_same_id(
    tokenizer: Tokenizer,
):
    # Another client (another gateway's lease) holds "shared"; this gateway has it among its
    # orphans (say, an admission of the same id whose outcome it never learned) and "ghost",
    # which nobody holds. Its aborts go out under its own lease: "shared" is refused
    # (PERMISSION_DENIED) and left alone, both orphans are settled, nothing is given up.
    async def scenario() -> tuple[list[str], set[str], list[str]]:
        async with rig(tokenizer) as r:
            core = r.allocator.allocator
            other = core.create_lease(60.0).lease_id
            pool = core.pools["pool-0"]
            core.step("pool-0", pool.epoch, other, StepCall([StepItem("shared", 3, [5, 6, 7])]))
            r.engine.orphans.note({"shared", "ghost"})
            with structlog.testing.capture_logs() as logs:
                error = await r.engine.orphans.abort(r.engine.link)
            assert error is None
            return r.allocator.held(), set(r.engine.orphans.ids), [e["event"] for e in logs]

    held, left, events = asyncio.run(scenario())
    assert held == ["shared"] and left == set()
    assert "orphans_given_up" not in events and "orphans_aborted" in events


def test_a_call_launched_ahead_may_wait_for_the_one_before_within_its_deadline(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
):
    # Each Execute takes 70% of --execute-timeout-s; one launched ahead waits for the one
    # before at the executor, 140% in all: it gets the deadline of both, so the executor
    # is not taken for lost, and the request completes. (A 1 s deadline here: the margins
    # are then wide on a slow machine.)
    monkeypatch.setattr(sys.modules[__name__], "TIMEOUT_S", 1.0)
    executor = QueueingExecutor(compute_s=0.7)

    async def scenario() -> tuple[list[CompletionDelta], bool]:
        async with rig(tokenizer, executor, replace(DESCRIPTION, uses_sampled_tokens=True)) as r:
            deltas = await collect(await submit(r, "a", [3] * 6, max_tokens=3), timeout_s=30)
            await until_idle(r.engine)
            return deltas, r.engine.healthy

    deltas, healthy = asyncio.run(scenario())
    assert healthy and executor.ahead >= 2
    assert [t for d in deltas for t in d.token_ids] == executor.model.reference([3] * 6, 3)
