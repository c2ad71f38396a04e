"""A request's priority level reaches the allocator through the gateway's own client (Step
items and hand-off reservations), where the cost policy preempts only the least urgent: a
real allocator server in process, on loopback."""

from __future__ import annotations

import asyncio

import pytest
from loopback_allocator import LoopbackAllocator

from allocator_svc.core.victims import PreemptionPolicy
from common.step_records import StepCall, StepItem

pytestmark = pytest.mark.service


def test_priority_crosses_the_wire_and_the_cost_policy_honours_it():
    async def scenario() -> None:
        allocator = await LoopbackAllocator.start(preemption_policy=PreemptionPolicy.COST)
        try:
            link = await allocator.link("pool-p", block_size=4, num_blocks=6)
            # a and c one block each, b (less urgent) 15 tokens in four: the pool is full.
            await link.step(StepCall(items=(
                StepItem("a", 4, (1,) * 4), StepItem("c", 4, (2,) * 4),
                StepItem("b", 15, (3,) * 15, priority=1))))
            # a and c need a block each to decode. By cost alone c (4 tokens) would go; b is
            # the less urgent, so b goes, 15 tokens and all.
            outcome = await link.step(StepCall(
                decode_request_ids=("a", "c", "b"), append_request_ids=("a", "c", "b"),
                append_token_ids=(1, 2, 3)))
            assert [(p.request_id, p.swapped) for p in outcome.preempted] == [("b", False)]
            # A moved request keeps its level in the pool it moves to.
            await link.reserve_hand_off("moved", [4] * 5, 5, "", "", "fp-test", 4, "",
                                        "moved", priority=2)
            pool = allocator.allocator.pools["pool-p"]
            assert pool.requests["moved"].priority == 2
            assert pool.requests["a"].priority == pool.requests["c"].priority == 0
        finally:
            await allocator.close()

    asyncio.run(scenario())
