"""The engine at depth 2: each Step goes out while the previous batch executes, and
whatever happens to that batch meanwhile (it fails, the executor goes away, a request is
cancelled) leaves nothing held and no stream waiting. The engine runs on the real allocator
core and a fake model (in_process.py) whose Execute takes a while, in one event loop."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
import structlog
from in_process import CorePool
from test_engine import BLOCK, FakeLink, drain, engine, run_until_idle, submit
from test_engine import tokenizer as tokenizer  # the module-scoped fixture

from common.step_records import Commit, StepCall
from gateway.clients.call_failures import failure
from gateway.core.batch import ScheduledStep
from gateway.core.request_state import Request, Sequence
from gateway.core.step import ExecuteCall, ExecuteResult, StepOutcome
from gateway.engine.loop import Engine
from gateway.text.tokenizer import Tokenizer


def slow_executor(link: FakeLink, fail_call: int = 0, code: grpc.StatusCode | None = None,
                  on_call: dict[int, object] | None = None,
                  until_next: bool = False) -> dict[str, object]:
    """Each Execute takes 10 ms (`until_next`: until the next call has arrived at the
    executor, or 0.5 s: whether the engine launches ahead then depends on nothing but the
    engine); call number `fail_call` fails with `code`. Returns a live view: whether an
    Execute is running, and how many were made."""
    state: dict[str, object] = {"executing": False, "calls": 0, "failed": asyncio.Event()}
    arrived = [0]
    outer, original = link.execute, link.compute

    async def arrive(call: ExecuteCall, *ids: int) -> ExecuteResult:
        arrived[0] += 1
        return await outer(call, *ids)

    async def execute(call: ExecuteCall) -> ExecuteResult:
        state["calls"] = number = int(state["calls"]) + 1  # type: ignore[call-overload]
        state["executing"] = True
        try:
            if until_next:
                for _ in range(250):
                    if arrived[0] > number:
                        break
                    await asyncio.sleep(0.002)
            else:
                await asyncio.sleep(0.01)
            if on_call and number in on_call:
                on_call[number]()  # type: ignore[operator]
            if number == fail_call:
                assert code is not None
                state["failed"].set()  # type: ignore[attr-defined]
                raise failure(code, "no")
            return await original(call)
        finally:
            state["executing"] = False

    link.execute = arrive  # type: ignore[method-assign]
    link.compute = execute  # type: ignore[method-assign]
    return state


def test_each_step_goes_out_while_the_previous_batch_executes(tokenizer: Tokenizer):
    eng, link = engine(tokenizer, num_blocks=64, tokens=64)
    reqs = [submit(eng, f"r{i}", [5 + i] * (4 + i), max_tokens=6) for i in range(3)]
    state = slow_executor(link)
    steps: list[tuple[bool, bool, int, int]] = []
    original = link.step

    async def step(call: StepCall) -> StepOutcome:
        # Whether a batch executes, whether it confirms the step before the previous one
        # only (the previous one's batch is the one in flight), the decodes, the values sent.
        steps.append((bool(state["executing"]), call.step_id - call.commit_through_step_id == 2,
                      len(call.decode_request_ids), len(call.append_request_ids)))
        return await original(call)

    link.step = step  # type: ignore[method-assign]
    asyncio.run(run_until_idle(eng))
    for i, req in enumerate(reqs):
        tokens = [t for d in drain(req) for t in d.token_ids]
        assert tokens == link.model.reference([5 + i] * (4 + i), 6)
    assert steps[0][:2] == (False, False)  # the first Step: nothing to overlap with
    decoding = steps[1:]
    assert len(decoding) == 5 and all(s[0] and s[1] and s[2] == 3 for s in decoding)
    assert [s[3] for s in decoding] == [0, 3, 3, 3, 3]  # the values follow one step late
    assert link.pool.all_free() and not link.model.held


def test_a_rejected_batch_fails_its_requests_although_the_next_step_was_out(
    tokenizer: Tokenizer,
):
    # The fourth Execute, which fills a's second block, is rejected after the fifth Step
    # granted a another token; c arrives meanwhile. a fails with UNAVAILABLE after its three
    # tokens and what it was granted is aborted; the block the rejected batch filled never
    # enters the prefix cache, although the Step that aborts a also commits for c. c is
    # served.
    eng, link = engine(tokenizer, num_blocks=64)
    a = submit(eng, "a", [9] * 5, max_tokens=8)
    late: list[Request] = []
    slow_executor(link, fail_call=4, code=grpc.StatusCode.INVALID_ARGUMENT,
                  on_call={4: lambda: late.append(submit(eng, "c", [8] * 5, max_tokens=4))})
    asyncio.run(run_until_idle(eng))
    deltas = drain(a)
    a_tokens = link.model.reference([9] * 5, 3)
    assert [t for d in deltas for t in d.token_ids] == a_tokens
    assert deltas[-1].error is not None and deltas[-1].error.code is grpc.StatusCode.UNAVAILABLE
    assert [t for d in drain(late[0]) for t in d.token_ids] == link.model.reference([8] * 5, 4)
    stored = [e.token_ids for e in link.pool.pool.events.after(0, 1 << 16).events if e.token_ids]
    assert [9, 9, 9, 9] in stored and [9, *a_tokens] not in stored
    assert link.pool.all_free() and not link.model.held


def test_an_executor_lost_while_the_next_step_was_out_hands_its_requests_on(
    tokenizer: Tokenizer,
):
    # The third Execute finds the executor gone; the fourth Step, already out, granted the
    # request another token. The request is handed on after its two tokens; everything the
    # allocator holds for it (that grant included) is aborted as an orphan.
    eng, link = engine(tokenizer, num_blocks=64)
    handed_on: list[Sequence] = []
    eng.on_lost = handed_on.extend
    a = submit(eng, "a", [6] * 5, max_tokens=8)
    slow_executor(link, fail_call=3, code=grpc.StatusCode.UNAVAILABLE)

    async def until_lost() -> None:
        while eng.healthy:
            await eng.step()
        assert not eng.in_flight
        await eng.recovery.abort_orphans()

    asyncio.run(until_lost())
    assert [s.seq_id for s in handed_on] == ["a"]
    assert [t for d in drain(a) for t in d.token_ids] == link.model.reference([6] * 5, 2)
    assert link.pool.all_free() and not eng.orphans


def test_a_request_cancelled_while_its_batch_executes_gets_nothing_more(tokenizer: Tokenizer):
    # a is cancelled while its third batch executes, with the next Step about to go out:
    # its tokens stop at two (the third is dropped), its blocks come back and the executor
    # drops it; b goes on to the reference.
    eng, link = engine(tokenizer, num_blocks=64, tokens=64)
    a = submit(eng, "a", [5] * 6, max_tokens=30)
    b = submit(eng, "b", [7] * 6, max_tokens=8)

    def cancel_a() -> None:
        a.cancelled = True
        eng.cancel()

    slow_executor(link, on_call={3: cancel_a})
    asyncio.run(run_until_idle(eng))
    assert [t for d in drain(a) for t in d.token_ids] == link.model.reference([5] * 6, 2)
    assert [t for d in drain(b) for t in d.token_ids] == link.model.reference([7] * 6, 8)
    assert link.pool.all_free() and not link.model.held


def test_a_batch_rejected_while_landing_before_planning_is_never_confirmed(
    tokenizer: Tokenizer,
):
    # b ends with the third batch. An orphan to abort (noted while that batch runs) makes
    # the next step land the batch in flight first, before planning; that batch (a's fourth,
    # filling its second block) is rejected. The Step that follows (admitting c) aborts a and
    # confirms the steps through the third batch's only: the rejected batch's block is never
    # cached.
    eng, link = engine(tokenizer, num_blocks=64, tokens=64)
    a = submit(eng, "a", [9] * 5, max_tokens=8)
    b = submit(eng, "b", [7] * 5, max_tokens=3)  # its last token: in the third batch
    late: list[Request] = []

    def orphan_and_c() -> None:
        eng.orphans.note(["nobody"])
        late.append(submit(eng, "c", [8] * 5, max_tokens=4))

    state = slow_executor(link, fail_call=4, code=grpc.StatusCode.INVALID_ARGUMENT,
                          on_call={3: orphan_and_c})
    after_rejection: list[tuple[int, bool]] = []
    original = link.step

    async def step(call: StepCall) -> StepOutcome:
        if state["calls"] == 4 and not state["executing"]:
            # How far behind its own number it confirms, and whether it aborts a.
            after_rejection.append((call.step_id - call.commit_through_step_id,
                                    "a" in call.abort_request_ids))
        return await original(call)

    link.step = step  # type: ignore[method-assign]
    asyncio.run(run_until_idle(eng))
    a_tokens = link.model.reference([9] * 5, 3)
    assert [t for d in drain(a) for t in d.token_ids] == a_tokens
    assert [t for d in drain(late[0]) for t in d.token_ids] == link.model.reference([8] * 5, 4)
    assert [t for d in drain(b) for t in d.token_ids] == link.model.reference([7] * 5, 3)
    # Not the step just before it (the rejected batch's): the one before that.
    assert after_rejection[0] == (2, True)
    stored = [e.token_ids for e in link.pool.pool.events.after(0, 1 << 16).events if e.token_ids]
    assert [9, *a_tokens] not in stored
    assert link.pool.all_free() and not link.model.held


def test_a_batch_abandoned_by_a_gateway_bug_has_its_releases_sent_again(tokenizer: Tokenizer):
    eng, link = engine(tokenizer, num_blocks=64)
    slow_executor(link)

    async def scenario() -> None:
        eng.scheduler.pending.release_ids.append("gone")
        submit(eng, "a", [9] * 5, max_tokens=8)
        await eng.step()  # the Execute carrying the release of "gone" is out
        assert eng.in_flight and not eng.scheduler.pending.release_ids
        eng.abandon_in_flight()

    asyncio.run(scenario())
    assert eng.scheduler.pending.release_ids == ["gone"]


@pytest.mark.parametrize("depth", [2, 1])
def test_a_rejected_batch_fails_the_requests_it_was_swapping_out(
    tokenizer: Tokenizer, depth: int
):
    # Swap mode on a small pool: the first Execute that carries swap-out copies is
    # rejected, so those copies never run. The requests it swapped out fail with
    # UNAVAILABLE (their KV never reached the CPU) like the ones it computed for; no request
    # gets a token that is not the reference, nothing is held afterwards.
    eng, link = engine(tokenizer, num_blocks=8, tokens=64, depth=depth)
    eng.scheduler.swap = True
    link.pool = CorePool(8, BLOCK, num_cpu_blocks=16)
    prompts = {f"s{i}": [6 + i] * 7 for i in range(3)}
    reqs = {rid: submit(eng, rid, prompt, max_tokens=12) for rid, prompt in prompts.items()}
    in_rejected_call: set[str] = set()
    original = link.compute

    async def reject_first_swap(call: ExecuteCall) -> ExecuteResult:
        if call.swap_out and not in_rejected_call:
            in_rejected_call.update(call.decode_request_ids, (s.request_id for s in call.seqs))
            raise failure(grpc.StatusCode.INVALID_ARGUMENT, "no")
        return await original(call)

    link.compute = reject_first_swap  # type: ignore[method-assign]
    asyncio.run(run_until_idle(eng))
    assert in_rejected_call, "no swap happened"
    failed = set()
    for rid, req in reqs.items():
        deltas = drain(req)
        tokens = [t for d in deltas for t in d.token_ids]
        assert tokens == link.model.reference(prompts[rid], 12)[: len(tokens)]
        errors = [d.error for d in deltas if d.error is not None]
        if errors:
            assert errors[0].code is grpc.StatusCode.UNAVAILABLE
            failed.add(rid)
        else:
            assert len(tokens) == 12
    assert failed - in_rejected_call, "a swapped-out request was not failed"
    assert link.pool.all_free() and not link.model.held


def test_a_lost_step_readmits_a_prefill_parent_rather_than_forking_it(tokenizer: Tokenizer):
    # The Step sent while an n=2 request's shared prompt computes is lost (the allocator is
    # away, so is every Fork): the landed parent is not forked into the outage, which would
    # fail the request; it is readmitted with the rest, and both completions finish.
    eng, link = engine(tokenizer, num_blocks=64, tokens=64)
    p = submit(eng, "p", [5] * 6, max_tokens=4, n=2)
    a = submit(eng, "a", [7] * 6, max_tokens=4)
    down = False
    step, fork = link.step, link.fork

    async def lost_second(call: StepCall) -> StepOutcome:
        nonlocal down
        if link.num_steps == 1:
            link.num_steps += 1
            down = True
            raise failure(grpc.StatusCode.UNAVAILABLE, "gone")
        down = False
        return await step(call)

    async def fork_unless_down(parent_id: str, child_ids: list[str], request_id: str) -> Any:
        if down:
            raise failure(grpc.StatusCode.UNAVAILABLE, "gone")
        return await fork(parent_id, child_ids, request_id)

    link.step, link.fork = lost_second, fork_unless_down  # type: ignore[method-assign]
    asyncio.run(run_until_idle(eng))
    deltas = drain(p)
    assert not [d for d in deltas if d.error is not None]
    for index in (0, 1):
        tokens = [t for d in deltas if d.index == index for t in d.token_ids]
        assert tokens == link.model.reference([5] * 6, 4)
    assert [t for d in drain(a) for t in d.token_ids] == link.model.reference([7] * 6, 4)
    assert link.pool.all_free() and not link.model.held


def test_a_refused_call_has_its_housekeeping_sent_again(tokenizer: Tokenizer):
    # A Step (or Free) the allocator refused applied nothing: its commits, aborts and the
    # executed step it confirmed ride on the next call (confirming again is idempotent).
    eng, _ = engine(tokenizer, num_blocks=64)
    eng.scheduler.pending.executed_through = eng.scheduler.pending.sent_through = 5
    call = StepCall(commits=(Commit("b", 4),), abort_request_ids=("a",), commit_through_step_id=5)
    eng.recovery.restore_housekeeping(ScheduledStep(call=call, seqs={}))
    pending = eng.scheduler.pending
    assert pending.commits == {"b": 4} and pending.abort_request_ids == ["a"]
    plan = eng.scheduler.schedule()
    assert plan is not None and plan.call.commit_through_step_id == 5


@pytest.mark.parametrize("depth", [2, 1])
def test_a_request_id_reused_right_after_it_finished_is_served(
    tokenizer: Tokenizer, depth: int
):
    # The client sends a new request under the id of one that has just finished, before
    # the engine has freed the old one: the next Step frees it and admits the new one
    # (once refused as "freed and scheduled", which failed every request of the engine).
    eng, link = engine(tokenizer, num_blocks=64, depth=depth)
    other = submit(eng, "other", [6] * 5, max_tokens=12)
    first = submit(eng, "r", [9] * 5, max_tokens=2)
    again: list[Request] = []

    async def scenario() -> None:
        while not any(d.finish_reason for d in list(first.outputs._queue)):  # type: ignore[attr-defined]
            await eng.step()
        again.append(submit(eng, "r", [8] * 5, max_tokens=3))
        await run_until_idle(eng)

    asyncio.run(scenario())
    assert [t for d in drain(first) for t in d.token_ids] == link.model.reference([9] * 5, 2)
    deltas = drain(again[0])
    assert not [d for d in deltas if d.error is not None]
    assert [t for d in deltas for t in d.token_ids] == link.model.reference([8] * 5, 3)
    assert [t for d in drain(other) for t in d.token_ids] == link.model.reference([6] * 5, 12)
    assert link.pool.all_free() and not link.model.held


def record_launches(link: FakeLink) -> list[tuple[int, int]]:
    """Per Execute, in order: how many were out when it went (itself included), and how
    many of its rows stood for a token the executor sampled (use_sampled_token). Checks
    that each call launched ahead names the one before it (previous_step_id)."""
    launches: list[tuple[int, int]] = []
    out = 0
    original = link.execute
    last_id = [0]

    async def execute(call: ExecuteCall, *ids: int) -> ExecuteResult:
        nonlocal out
        out += 1
        used = sum(call.decode_use_sampled_token) + sum(s.use_sampled_token for s in call.seqs)
        launches.append((out, used))
        step_id, previous = ids
        if step_id:  # numbered: the executor uses its sampled tokens
            assert step_id != last_id[0], "each call is numbered anew"
            assert previous == (last_id[0] if out > 1 else 0), "ahead: names the one before"
            last_id[0] = step_id
        else:
            assert out == 1 and not previous
        try:
            return await original(call, *ids)
        finally:
            out -= 1

    link.execute = execute  # type: ignore[method-assign]
    return launches


@pytest.mark.parametrize("uses_sampled_tokens", [True, False])
def test_an_execute_goes_out_before_the_previous_returns_if_the_executor_fills_tokens_in(
    tokenizer: Tokenizer, uses_sampled_tokens: bool
):
    # With an executor that uses its sampled tokens, each decode Execute goes out while the
    # one before is still executing, its rows standing for the tokens that one samples; with
    # one that does not (Describe), one Execute at a time. The same tokens either way.
    eng, link = engine(tokenizer, num_blocks=64, tokens=64)
    link.description = SimpleNamespace(uses_sampled_tokens=uses_sampled_tokens, role="both")
    reqs = [submit(eng, f"r{i}", [5 + i] * (4 + i), max_tokens=6) for i in range(3)]
    slow_executor(link, until_next=uses_sampled_tokens)
    launches = record_launches(link)
    asyncio.run(run_until_idle(eng))
    for i, req in enumerate(reqs):
        assert [t for d in drain(req) for t in d.token_ids] == link.model.reference(
            [5 + i] * (4 + i), 6)
    assert len(launches) == 6  # the prefill, then five decodes
    if uses_sampled_tokens:
        assert launches == [(1, 0)] + [(2, 3)] * 5
    else:
        assert launches == [(1, 0)] * 6
    assert link.pool.all_free() and not link.model.held


def third_rejected(
    tokenizer: Tokenizer, b_arrives_in: int
) -> tuple[Engine, FakeLink, Request, list[Request], list[tuple[int, int]], asyncio.Event]:
    """a runs alone; the third Execute is rejected (INVALID_ARGUMENT); b arrives while
    Execute `b_arrives_in` runs; each Execute ends once the next has arrived (or after
    0.5 s). Returns the engine, its link, a, [b], the launches and the rejection's event."""
    eng, link = engine(tokenizer, num_blocks=64, tokens=64)
    a = submit(eng, "a", [9] * 5, max_tokens=8)
    late: list[Request] = []
    state = slow_executor(
        link, fail_call=3, code=grpc.StatusCode.INVALID_ARGUMENT, until_next=True,
        on_call={b_arrives_in: lambda: late.append(submit(eng, "b", [8] * 5, 4))})
    failed = state["failed"]
    assert isinstance(failed, asyncio.Event)
    return eng, link, a, late, record_launches(link), failed


def assert_a_failed_and_b_served(link: FakeLink, a: Request, b: Request) -> None:
    """a ends with UNAVAILABLE after its two tokens; b gets the reference; nothing held."""
    deltas = drain(a)
    assert [t for d in deltas for t in d.token_ids] == link.model.reference([9] * 5, 2)
    assert deltas[-1].error is not None and deltas[-1].error.code is grpc.StatusCode.UNAVAILABLE
    b_deltas = drain(b)
    assert [t for d in b_deltas for t in d.token_ids] == link.model.reference([8] * 5, 4)
    assert b_deltas[-1].error is None and b_deltas[-1].finish_reason is not None
    assert link.pool.all_free() and not link.model.held


def test_after_a_rejected_batch_the_one_launched_ahead_lands_before_the_next_goes(
    tokenizer: Tokenizer,
):
    # The third Execute is rejected while the fourth, built on the tokens it samples, is out:
    # the executor rejects that one too (its row for a no longer continues what it holds),
    # and the fifth waits for it to land instead of building on it. b arrives during the
    # third, after the fourth was planned, and is served.
    eng, link, a, late, launches, _ = third_rejected(tokenizer, b_arrives_in=3)
    asyncio.run(run_until_idle(eng))
    assert_a_failed_and_b_served(link, a, late[0])
    assert [n for n, _ in launches[:5]] == [1, 2, 2, 2, 1]
    assert launches[3][1] == 1  # the fourth stood for a's token from the rejected third
    assert len(launches) > 5 and launches[5][0] == 2  # then ahead again


def test_a_request_new_in_a_batch_rejected_after_the_one_before_starts_over(
    tokenizer: Tokenizer,
):
    # b arrives while the second Execute runs: its prefill goes out in the fourth, launched
    # ahead on the third, which is rejected. The executor rejects the fourth too; b was in
    # no failed batch of its own, so it starts over (recompute) and is served.
    eng, link, a, late, launches, _ = third_rejected(tokenizer, b_arrives_in=2)
    with structlog.testing.capture_logs() as logs:
        asyncio.run(run_until_idle(eng))
    assert_a_failed_and_b_served(link, a, late[0])
    assert launches[3][0] == 2  # b's prefill, launched ahead on the rejected third
    recomputed = [e for e in logs if e["event"] == "requests_recomputed"]
    assert [e["num"] for e in recomputed] == [1]


def test_a_batch_that_failed_while_the_step_was_out_lands_before_the_next_is_built(
    tokenizer: Tokenizer,
):
    # As above, but the fourth Step answers only after the third Execute has been rejected:
    # that batch lands first, and the fourth is built without a (failed), not launched ahead
    # on it. b's prefill is not rejected; nothing starts over.
    eng, link, a, late, launches, failed = third_rejected(tokenizer, b_arrives_in=2)
    original, steps = link.step, []

    async def step(call: StepCall) -> StepOutcome:
        steps.append(call)
        if len(steps) == 4:
            await asyncio.wait_for(failed.wait(), 5)  # the third Execute fails meanwhile
        return await original(call)

    link.step = step  # type: ignore[method-assign]
    with structlog.testing.capture_logs() as logs:
        asyncio.run(run_until_idle(eng))
    assert_a_failed_and_b_served(link, a, late[0])
    assert launches[3] == (1, 0)  # b's prefill alone, after the third landed
    assert not [e for e in logs if e["event"] == "requests_recomputed"]
    assert [e["event"] for e in logs].count("execute_failed") == 1


def test_an_idle_engine_aborts_a_rejected_batchs_request_before_confirming_later_steps(
    tokenizer: Tokenizer,
):
    # a's whole prompt is in the first batch, which the executor rejects; b arrives while it
    # runs, and its batch (launched on top of it, without a) executes. Then the engine is
    # idle: its housekeeping both aborts a and confirms the steps through b's, which cover
    # the rejected one. The abort must reach the allocator first: a's blocks were never
    # written and must never be cached.
    eng, link = engine(tokenizer, num_blocks=64, tokens=64)
    a = submit(eng, "a", [9] * 8, max_tokens=1)
    slow_executor(link, fail_call=1, code=grpc.StatusCode.INVALID_ARGUMENT)
    calls: list[str] = []
    for name in ("step", "free", "abort"):
        original = getattr(link, name)

        async def record(*args: Any, _original: Any = original, _name: str = name) -> Any:
            calls.append(_name)
            return await _original(*args)

        setattr(link, name, record)

    async def scenario() -> Request:
        await eng.step()  # a's batch goes out
        b = submit(eng, "b", [7] * 5, max_tokens=1)  # planned while it executes
        await run_until_idle(eng)
        return b

    b = asyncio.run(scenario())
    deltas = drain(a)
    assert deltas[-1].error is not None and deltas[-1].error.code is grpc.StatusCode.UNAVAILABLE
    assert [t for d in drain(b) for t in d.token_ids] == link.model.reference([7] * 5, 1)
    assert calls[-2:] == ["abort", "free"]  # the idle housekeeping, in that order
    stored = [e.token_ids for e in link.pool.pool.events.after(0, 1 << 16).events if e.token_ids]
    assert [9, 9, 9, 9] not in stored
    assert link.pool.all_free() and not link.model.held
