"""The engines on their own loop and thread (engine/host.py), the caller on another: requests go
in through the host, deltas come back to the caller's loop in order, a refusal comes back as
the error, and a cancellation crosses over. The engine runs on the real allocator core and a
fake model (in_process.py)."""

from __future__ import annotations

import asyncio
import threading

import pytest
from test_engine import engine
from test_engine import tokenizer as tokenizer  # the module-scoped fixture

from common.errors import ResourceExhausted
from gateway.api.frontend import Frontend, ModelInfo, PromptInput
from gateway.api.sampling import ModelLimits, RawSampling, SamplingOptions
from gateway.core.request_state import CompletionDelta, Request
from gateway.engine.host import EngineHost
from gateway.engine.loop import Engine
from gateway.engine.router import Router
from gateway.text.tokenizer import Tokenizer


def _request(rid: str, prompt: list[int], max_tokens: int) -> Request:
    """Made on the caller's running loop, as the frontend makes them."""
    return Request(request_id=rid, prompt_token_ids=prompt, cache_salt="",
                   sampling=SamplingOptions(max_tokens=max_tokens, ignore_eos=True))


async def _collect(request: Request) -> list[CompletionDelta]:
    deltas: list[CompletionDelta] = []
    while not deltas or (deltas[-1].finish_reason is None and deltas[-1].error is None):
        deltas.append(await asyncio.wait_for(request.outputs.get(), 10))
    return deltas


def _hosted(tokenizer: Tokenizer, max_waiting: int = 8, depth: int = 2):  # type: ignore[no-untyped-def]
    """A host whose loop runs one engine (built there: its locks and tasks belong to it)."""
    host = EngineHost()
    host.start()

    async def build():  # type: ignore[no-untyped-def]
        eng, link = engine(tokenizer, num_blocks=32, depth=depth)
        router = Router(engines=[eng], allocator=None, max_waiting=max_waiting)  # type: ignore[arg-type]
        eng.on_lost = router.requeue
        task = asyncio.get_running_loop().create_task(eng.run())
        return eng, link, router, task

    eng, link, router, task = asyncio.run_coroutine_threadsafe(build(), host.loop).result(10)
    host.router = router
    return host, eng, link, task


def _until_idle(host: EngineHost, eng: Engine) -> None:
    """Once the streams have their deltas, the engine may still be sending the frees and
    releases that follow them: wait for those (on its loop) before looking at the pool."""
    async def idle() -> None:
        while eng.busy:
            await asyncio.sleep(0.005)

    asyncio.run_coroutine_threadsafe(idle(), host.loop).result(10)


def _stop(host: EngineHost, task: asyncio.Task[None]) -> None:
    host.loop.call_soon_threadsafe(task.cancel)
    host.stop()
    assert not host.thread.is_alive()


def test_requests_submitted_through_the_host_stream_back_to_the_callers_loop(
    tokenizer: Tokenizer,
):
    host, eng, link, task = _hosted(tokenizer)
    engine_threads: set[int] = set()
    original = link.compute

    async def compute(call):  # type: ignore[no-untyped-def]
        engine_threads.add(threading.get_ident())
        return await original(call)

    link.compute = compute  # type: ignore[method-assign]

    async def scenario() -> list[list[CompletionDelta]]:
        requests = [_request(f"r{i}", [5 + i] * (4 + i), 6) for i in range(3)]
        for request in requests:
            assert await host.submit(request) is eng
        return list(await asyncio.gather(*(_collect(r) for r in requests)))

    try:
        results = asyncio.run(scenario())
        _until_idle(host, eng)
    finally:
        _stop(host, task)
    assert engine_threads == {host.thread.ident}  # the steps ran on the engine thread
    for i, deltas in enumerate(results):
        assert [t for d in deltas for t in d.token_ids] == link.model.reference(
            [5 + i] * (4 + i), 6)
    assert link.pool.all_free() and not link.model.held


def test_a_refusal_on_the_engine_loop_reaches_the_caller(tokenizer: Tokenizer):
    host, eng, link, task = _hosted(tokenizer, max_waiting=0)

    async def scenario() -> None:
        with pytest.raises(ResourceExhausted, match="waiting queue is full"):
            await host.submit(_request("r", [5, 6, 7], 4))

    try:
        asyncio.run(scenario())
    finally:
        _stop(host, task)
    assert link.pool.all_free()


def test_a_cancellation_crosses_to_the_engine_loop(tokenizer: Tokenizer):
    # The caller cancels after the first delta of a request that would take 200 steps of
    # 5 ms: the engine (on its own loop) aborts it, gives its blocks back and stops; the
    # request never finishes.
    host, eng, link, task = _hosted(tokenizer)
    original = link.compute

    async def slow(call):  # type: ignore[no-untyped-def]
        await asyncio.sleep(0.005)
        return await original(call)

    link.compute = slow  # type: ignore[method-assign]

    async def scenario() -> list[CompletionDelta]:
        request = _request("c", [9] * 5, 200)
        await host.submit(request)
        deltas = [await asyncio.wait_for(request.outputs.get(), 10)]
        host.cancel(request)
        for _ in range(300):
            if link.pool.all_free() and not eng.busy:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # anything still posted arrives
        while not request.outputs.empty():
            deltas.append(request.outputs.get_nowait())
        return deltas

    try:
        deltas = asyncio.run(scenario())
    finally:
        _stop(host, task)
    num_tokens = sum(len(d.token_ids) for d in deltas)
    assert 1 <= num_tokens < 50 and not any(d.finish_reason for d in deltas)
    assert link.pool.all_free() and not link.model.held


def test_a_submit_cancelled_while_the_engine_loop_runs_it_leaves_nothing_running(
    tokenizer: Tokenizer,
):
    # The client goes away while its submission runs on the engine loop, after the router
    # queued the request: the frontend cancels it there too, so it does not run to its 100
    # tokens for nobody, and its blocks come back.
    host, eng, link, task = _hosted(tokenizer)
    router = host.router
    assert router is not None

    class SlowToAnswer:
        engines = router.engines
        cancel = router.cancel

        async def submit(self, request: Request):  # type: ignore[no-untyped-def]
            engine = await router.submit(request)  # queued on the engine
            await asyncio.sleep(0.3)  # ... and the caller gives up meanwhile
            return engine

    host.router = SlowToAnswer()  # type: ignore[assignment]
    original = link.compute

    async def slow(call):  # type: ignore[no-untyped-def]
        await asyncio.sleep(0.02)  # 100 tokens: 2 s
        return await original(call)

    link.compute = slow  # type: ignore[method-assign]
    frontend = Frontend(
        tokenizer=tokenizer,
        limits=ModelLimits(max_model_len=256, vocab_size=tokenizer.vocab_size, max_n=4,
                           pool_capacity_tokens=128),
        engines=host,
        info=ModelInfo("tiny", 256, tokenizer.vocab_size, (2,)),
    )

    async def scenario() -> None:
        call = asyncio.ensure_future(frontend.submit(
            PromptInput(token_ids=[9] * 5), RawSampling(max_tokens=100, ignore_eos=True), "",
            "gone"))
        await asyncio.sleep(0.1)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        for _ in range(100):  # 1 s: well before it could have finished
            if link.pool.all_free() and not eng.busy:
                return
            await asyncio.sleep(0.01)
        raise AssertionError("the request kept running")

    try:
        asyncio.run(scenario())
    finally:
        _stop(host, task)
    assert link.pool.all_free() and not link.model.held and not frontend.active
