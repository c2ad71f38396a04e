"""The order of calls sent ahead (executor_svc/step_order.py), on a real event loop."""

from __future__ import annotations

import asyncio
import time

from executor_svc.step_order import StepOrder


def test_a_call_waits_for_exactly_the_call_it_names() -> None:
    # b names a: another id taken meanwhile does not release it; a being taken does.
    async def scenario() -> list[str]:
        order, events = StepOrder(), []

        async def call(name: str, previous: int) -> None:
            assert await order.after(previous, timeout_s=5)
            events.append(name)

        waiting = asyncio.ensure_future(call("b", 11))
        await asyncio.sleep(0.05)
        order.take(99)  # another caller's call
        await asyncio.sleep(0.05)
        events.append("a taken")
        order.take(11)
        await waiting
        return events

    assert asyncio.run(scenario()) == ["a taken", "b"]


def test_a_call_naming_a_taken_call_or_none_does_not_wait() -> None:
    async def scenario() -> float:
        order = StepOrder()
        order.take(7)
        start = time.perf_counter()
        assert await order.after(7, timeout_s=5)
        assert await order.after(0, timeout_s=5)
        return time.perf_counter() - start

    assert asyncio.run(scenario()) < 0.5


def test_a_call_that_never_comes_is_waited_for_a_bounded_time() -> None:
    async def scenario() -> tuple[bool, float, int]:
        order = StepOrder()
        start = time.perf_counter()
        came = await order.after(5, timeout_s=0.1)
        return came, time.perf_counter() - start, len(order._waiters)

    came, waited, num_waiting = asyncio.run(scenario())
    assert not came and waited >= 0.1 and num_waiting == 0


def test_only_the_latest_ids_are_remembered() -> None:
    order = StepOrder(remember=2)
    for step_id in (1, 2, 3):
        order.take(step_id)
    assert order._taken == {2, 3}
