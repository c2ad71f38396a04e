"""HeldOutputs on its own: delivery order, cancelled requests, and the calls it awaits."""

from __future__ import annotations

import asyncio

import pytest

from gateway.api.sampling import SamplingOptions
from gateway.core.request_state import CompletionDelta, Request
from gateway.engine.held_outputs import HeldOutputs


def _request(rid: str) -> Request:
    return Request(request_id=rid, prompt_token_ids=[1], cache_salt="",
                   sampling=SamplingOptions(max_tokens=4))


def _delta(token: int) -> CompletionDelta:
    return CompletionDelta(index=0, token_ids=(token,), text="")


def test_deliver_keeps_order_and_skips_cancelled_requests():
    live, gone = _request("live"), _request("gone")
    gone.cancelled = True
    held = HeldOutputs()
    for token in (1, 2):
        held.add(live, _delta(token))
        held.add(gone, _delta(token))
    held.deliver()
    assert [live.outputs.get_nowait().token_ids for _ in range(2)] == [(1,), (2,)]
    assert gone.outputs.empty() and not held


def test_a_cancelled_step_cancels_the_call_it_awaits():
    # The engine's task is cancelled while Execute is in flight: the call goes too, and
    # nothing is logged as never retrieved.
    held = HeldOutputs()
    held.add(_request("r"), _delta(1))
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def execute() -> int:
        started.set()
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return 0

    async def scenario() -> None:
        step = asyncio.ensure_future(held.during_execute(execute()))
        await started.wait()
        step.cancel()
        with pytest.raises(asyncio.CancelledError):
            await step
        assert cancelled.is_set()

    asyncio.run(scenario())


@pytest.mark.parametrize("during", ["during_execute", "during_step"])
def test_a_failed_call_raises_its_error_after_the_right_deliveries(during: str):
    # Execute: held deltas go out even when it fails at once (before its error is handled);
    # Step: a fast failure leaves them held (the engine delivers before recovery).
    request = _request("r")
    held = HeldOutputs()
    held.add(request, _delta(1))

    async def fail() -> int:
        raise RuntimeError("the call failed")

    with pytest.raises(RuntimeError, match="the call failed"):
        asyncio.run(getattr(held, during)(fail()))
    assert request.outputs.qsize() == (1 if during == "during_execute" else 0)
