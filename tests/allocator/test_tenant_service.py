"""Each tenant's service across pools (allocator_svc/core/tenant_service.py): what a step
charges, what it never charges, the lift of a tenant back from away, and the Step's waiting
tenants."""

from __future__ import annotations

import pytest

from allocator_svc.core.allocator import Allocator, Limits
from allocator_svc.core.hand_off import HandOff
from allocator_svc.core.pool import PoolConfig
from allocator_svc.core.tenant_service import IDLE_S, TenantService
from common.errors import InvalidArgument
from common.step_records import StepCall, StepItem


def allocator(now: list[float], prefill: float = 1.0, decode: float = 2.0) -> Allocator:
    core = Allocator(Limits(max_batch_items=8), clock=lambda: now[0],
                     tenant_service=TenantService(prefill, decode, clock=lambda: now[0]))
    for pool_id in ("p", "q"):
        core.register_pool(PoolConfig(pool_id, 32, 4, 0, "fp", "i", True))
    return core


def step(core: Allocator, pool_id: str, *items: StepItem, decodes: tuple[str, ...] = (),
         waiting: tuple[str, ...] = ()) -> dict[str, float] | None:
    pool = core.pools[pool_id]
    result = core.step(pool_id, pool.epoch, None, StepCall(
        items=items, decode_request_ids=decodes, append_request_ids=decodes,
        append_token_ids=[1] * len(decodes), waiting_tenants=waiting))
    return result.tenant_service


def new(rid: str, tenant: str, prompt: list[int], num: int | None = None,
        resumed: bool = False) -> StepItem:
    return StepItem(rid, len(prompt) if num is None else num, prompt, tenant=tenant,
                    resumed=resumed)


def test_nothing_is_charged_until_a_step_names_waiting_tenants():
    core = allocator([0.0])
    assert step(core, "p", new("a", "t", [1] * 8)) is None
    assert core.tenant_service.counters == {}
    assert step(core, "p", new("b", "t", [2] * 4), waiting=("t",)) == {"t": 4.0}


def test_prompt_and_generated_tokens_are_charged_at_their_weights_across_pools():
    now = [0.0]
    core = allocator(now, prefill=1.0, decode=3.0)
    step(core, "p", new("a", "t1", [1] * 10, num=6), waiting=("t1",))  # a chunk of 6
    step(core, "p", StepItem("a", 4))  # the rest of the prompt
    step(core, "q", new("b", "t1", [2] * 5), new("c", "t2", [3] * 2))
    assert step(core, "p", decodes=("a",), waiting=("t1", "t2")) == {
        "t1": 10 + 5 + 3.0, "t2": 2.0}  # a's prompt, b's, a's one generated token


def test_cached_forked_moved_and_recomputed_tokens_are_not_charged_again():
    now = [0.0]
    core = allocator(now)
    pool = core.pools["p"]
    step(core, "p", new("a", "t", [1] * 9), waiting=("t",))
    pool.commit(pool.requests["a"], 9)  # its two full blocks enter the prefix cache
    step(core, "p", new("b", "t", [1] * 9))  # 8 of its tokens found cached: 1 computed
    core.fork("p", pool.epoch, "b", ["b1", "b2"])  # children share b's 9
    step(core, "p", decodes=("b1", "b2"))  # one generated token each
    assert core.tenant_service.counters == {"t": 9 + 1 + 2 * 2.0}
    # Moved here with 6 tokens computed elsewhere: only its next token is charged.
    core.reserve_hand_off(HandOff("p", pool.epoch, None, "m", [5] * 6, 4, "", "t", "fp", 4))
    step(core, "p", decodes=("m",))
    assert core.tenant_service.counters == {"t": 14 + 2.0}
    # Back after a recompute preemption (prompt and 3 outputs): nothing again, then its
    # next token.
    step(core, "q", new("r", "t", [6] * 7, resumed=True), decodes=())
    assert core.tenant_service.counters == {"t": 16 + 1.0}  # its last token, never computed
    step(core, "q", decodes=("r",))
    assert core.tenant_service.counters == {"t": 17 + 2.0}


def test_a_waiting_tenant_is_lifted_once_when_it_joins_then_falls_behind():
    # VTC's lift: a tenant joining the queue starts at the least counter of the backlogged
    # tenants, once; while it waits the others' counters grow past it, so it goes first.
    now = [0.0]
    core = allocator(now)
    step(core, "p", new("heavy", "h", [1] * 20), waiting=("h",))
    now[0] = 0.5
    assert step(core, "p", decodes=("heavy",), waiting=("h", "light")) == {
        "h": 22.0, "light": 22.0}  # lifted to h's, after this step's decode
    for t in (0.6, 0.7, 1.5, 2.4):  # still waiting (named within IDLE_S): not lifted again
        now[0] = t
        assert step(core, "p", decodes=("heavy",), waiting=("h", "light"))["light"] == 22.0
    assert core.tenant_service.counters["h"] == 30.0
    # Away for longer than IDLE_S, it is lifted again when it comes back.
    now[0] += IDLE_S + 0.5
    assert step(core, "p", decodes=("heavy",), waiting=("h",)) == {"h": 32.0}
    now[0] += 0.1
    assert step(core, "p", decodes=("heavy",), waiting=("light",)) == {"light": 34.0}
    # With no one backlogged, nobody is lifted.
    now[0] += 10
    assert core.tenant_service.service(["new"]) == {"new": 0.0}


@pytest.mark.parametrize(("waiting", "words"), [
    (tuple(f"t{i}" for i in range(257)), "waiting_tenants names 257 tenants; at most 256"),
    (("a", "x" * 300), r"waiting_tenants\[1\] has 300 characters"),
    (("a", "b", "a"), r"waiting_tenants\[2\] is 'a': name each waiting tenant once"),
    (("",), r"waiting_tenants\[0\] is '': name each waiting tenant once, none empty"),
])
def test_a_step_naming_bad_waiting_tenants_is_invalid_and_changes_nothing(waiting, words):
    core = allocator([0.0])
    with pytest.raises(InvalidArgument, match=words):
        step(core, "p", new("a", "t", [1] * 4), waiting=waiting)
    assert not core.pools["p"].requests and not core.tenant_service.in_use
