"""Merging callers' Execute calls: which calls one forward takes (against a simple model of the
rule, over random queues), the runner's merged step against the calls run one at a time, and
the compute queue's turns."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.errors import InvalidArgument, NotFound, ServiceError
from executor_svc.compute_thread import ComputeQueue, compute_thread
from executor_svc.merged_calls import CallShape, calls_to_merge
from executor_svc.runner import ModelRunner
from executor_svc.step import (
    BlockCopy,
    BlockTableDelta,
    SamplingParams,
    SequenceWork,
    StepRequest,
    StepResult,
)
from tests.budget import examples

from .oracle import random_prompts

# -- which calls merge -------------------------------------------------------------------


def _shape(names: str, step_id: int = 0, previous: int = 0, tokens: int = 1) -> CallShape:
    ids = frozenset(names)
    return CallShape(step_id, previous, ids, len(ids), tokens * len(ids))


def test_disjoint_calls_merge_until_a_limit():
    waiting = [_shape("a"), _shape("bc"), _shape("d"), _shape("ef")]
    assert calls_to_merge(waiting, 64, 2048) == [0, 1, 2, 3]
    assert calls_to_merge(waiting, 4, 2048) == [0, 1, 2]  # ef: 6 sequences
    assert calls_to_merge(waiting, 64, 3) == [0, 1]
    # A call that does not fit is passed over; a younger one that fits goes.
    assert calls_to_merge([_shape("a"), _shape("bcd"), _shape("e")], 2, 2048) == [0, 2]


def test_the_oldest_call_runs_even_past_the_limits():
    assert calls_to_merge([_shape("abc", tokens=900), _shape("d")], 2, 100) == [0]


def test_a_callers_next_call_waits_for_the_forward_after_its_current_one():
    # b2 builds on b1 (previous_step_id) and names the same request; c2 builds on c1, which
    # is passed over: c2 waits too, so a caller's calls never overtake each other.
    waiting = [_shape("a", 1), _shape("b", 2), _shape("b", 3, previous=2),
               _shape("cde", 4), _shape("c", 5, previous=4), _shape("f", 6)]
    assert calls_to_merge(waiting, 3, 2048) == [0, 1, 5]
    # A release of a request an older call steps is a clash too.
    release = CallShape(7, 0, frozenset({"a"}), 0, 0)
    assert calls_to_merge([_shape("a", 1), release, _shape("g", 8)], 64, 2048) == [0, 2]


_calls = st.lists(
    st.tuples(st.sets(st.sampled_from("abcdefgh"), max_size=3), st.integers(0, 6),
              st.integers(1, 5), st.integers(1, 40)),
    min_size=1, max_size=12)


@settings(max_examples=examples(300), deadline=None)
@given(_calls, st.integers(1, 8), st.integers(1, 120))
def test_turns_keep_every_chain_in_order_and_the_limits(raw, max_seqs, max_tokens):
    # The queue drained turn by turn: every call runs once; the first turn's calls are those
    # the rule allows, read off a simple model; a call runs after every older call that names
    # a request it names or the step it builds on; a turn of several calls keeps the limits.
    waiting = [CallShape(i + 1, prev if 0 < prev <= i else 0, frozenset(names), len(names),
                         tokens)
               for i, (names, prev, _, tokens) in enumerate(raw)]
    turn_of: dict[int, int] = {}
    queue, turn = list(waiting), 0
    while queue:
        taken = calls_to_merge(queue, max_seqs, max_tokens)
        assert taken and taken[0] == 0, "the oldest call always runs"
        chosen = [queue[i] for i in taken]
        if len(chosen) > 1:
            assert sum(c.num_seqs for c in chosen) <= max_seqs
            assert sum(c.num_tokens for c in chosen) <= max_tokens
        for call in chosen:
            turn_of[call.step_id] = turn
        queue = [c for i, c in enumerate(queue) if i not in taken]
        turn += 1
    assert len(turn_of) == len(waiting)
    for later in waiting:
        for older in waiting[: later.step_id - 1]:
            if older.request_ids & later.request_ids or later.previous_step_id == older.step_id:
                assert turn_of[older.step_id] < turn_of[later.step_id]


# -- the runner's merged step ------------------------------------------------------------


def _first(rid: str, tokens: list[int], blocks: list[int], sample: bool = True) -> SequenceWork:
    return SequenceWork(rid, tuple(tokens), 0, BlockTableDelta(0, tuple(blocks)),
                        SamplingParams(), sample=sample)


def _next(rid: str, token: int, position: int) -> SequenceWork:
    return SequenceWork(rid, (token,), position, sample=True)


def test_merged_calls_equal_the_calls_one_at_a_time(make_runner: Callable[..., ModelRunner]):
    # Two callers' calls (a prefill with a copy-on-write copy, a decode with a swap-out and
    # a release) in one forward give each caller the tokens, logprobs and counts the calls
    # give one after another on a second runner, and leave the same state.
    prompts = random_prompts(512, [20, 9, 13])
    apart, merged = make_runner(num_blocks=32), make_runner(num_blocks=32)
    for runner in (apart, merged):
        runner.execute(StepRequest(seqs=(_first("b", prompts[1], [4]),
                                         _first("b-gone", prompts[2], [5]))))
    b_next = apart.requests["b"].sampled_token
    assert b_next is not None
    a_call = StepRequest(seqs=(_first("a", prompts[0], [1, 2]),), copies=(BlockCopy(4, 6),))
    b_call = StepRequest(seqs=(_next("b", b_next, 9),), release_request_ids=("b-gone",),
                         swap_out=(BlockCopy(5, 0),))
    one_by_one = [apart.execute(a_call), apart.execute(b_call)]
    together = merged.execute_merged([a_call, b_call])
    for alone, beside in zip(one_by_one, together, strict=True):
        assert isinstance(beside, StepResult)
        assert beside.num_tokens == alone.num_tokens
        assert [(t.request_id, t.token_id) for t in beside.tokens] == [
            (t.request_id, t.token_id) for t in alone.tokens]
        for x, y in zip(alone.tokens, beside.tokens, strict=True):
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
    assert together[0].timings == together[1].timings  # type: ignore[union-attr]
    assert merged.requests.keys() == apart.requests.keys() == {"a", "b"}
    for rid in ("a", "b"):
        assert merged.requests[rid].block_table == apart.requests[rid].block_table
        assert merged.requests[rid].num_tokens == apart.requests[rid].num_tokens
    assert merged.cache.cpu_kv[0].equal(apart.cache.cpu_kv[0])  # the swap-out
    assert merged.cache.cpu_kv[0].abs().sum() > 0
    assert merged.cache.kv[:, :, 6].equal(apart.cache.kv[:, :, 6])  # the copy
    # (made before b's decode wrote its tenth slot into block 4)
    assert merged.cache.kv[:, :, 6, :9].equal(merged.cache.kv[:, :, 4, :9])


def test_a_refused_call_changes_nothing_and_the_others_run(tiny_runner: ModelRunner):
    # Refused calls (an unknown request; a block outside the pool, with a release and a copy
    # that must not happen) get their own errors; the call between them runs as alone.
    prompt = random_prompts(512, [10])[0]
    tiny_runner.execute(StepRequest(seqs=(_first("held", prompt, [3]),)))
    before = tiny_runner.cache.kv[:, :, 7].clone()
    ghost = StepRequest(seqs=(_next("ghost", 5, 4),))
    out_of_pool = StepRequest(seqs=(_first("far", prompt, [10_000]),),
                              release_request_ids=("held",), copies=(BlockCopy(3, 7),))
    good = StepRequest(seqs=(_first("good", prompt, [1]),))
    results = tiny_runner.execute_merged([ghost, good, out_of_pool])
    assert isinstance(results[0], NotFound) and isinstance(results[2], InvalidArgument)
    assert "outside" in str(results[2])
    assert isinstance(results[1], StepResult)
    assert [t.request_id for t in results[1].tokens] == ["good"]
    assert set(tiny_runner.requests) == {"held", "good"}
    assert tiny_runner.cache.kv[:, :, 7].equal(before)


# -- the compute queue -------------------------------------------------------------------


def test_the_queue_merges_waiting_calls_and_keeps_jobs_in_their_place():
    # While a turn runs, calls and a job queue up: the calls before the job merge into one
    # turn, the job runs alone after them, the calls after it merge in the turn after; a call
    # withdrawn before its turn never runs; a refusal goes to its own caller only.
    turns: list[list[str]] = []
    gate = threading.Event()

    def execute_merged(steps: list[StepRequest]) -> list[object]:
        names = [s.release_request_ids[0] for s in steps]
        turns.append(names)
        if names == ["first"]:
            assert gate.wait(30)
        return [InvalidArgument(f"{n} refused") if n.startswith("bad") else n for n in names]

    def call(name: str) -> StepRequest:
        return StepRequest(release_request_ids=(name,))

    async def scenario() -> list[object]:
        queue = ComputeQueue(compute_thread(), execute_merged, 64, 2048)
        first = queue.execute(call("first"))
        while not turns:
            await asyncio.sleep(0.001)
        second, bad, withdrawn = (queue.execute(call(n)) for n in ("second", "bad", "gone"))
        assert queue.withdraw(withdrawn) and not queue.withdraw(first)
        def job_fn() -> str:
            turns.append(["job"])
            return "ran"

        job = queue.run(job_fn)
        third, fourth = queue.execute(call("third")), queue.execute(call("fourth"))
        assert queue.num_waiting() == 5
        gate.set()
        return await asyncio.gather(first, second, bad, job, third, fourth,
                                    return_exceptions=True)

    outcomes = asyncio.run(scenario())
    assert turns == [["first"], ["second", "bad"], ["job"], ["third", "fourth"]]
    assert outcomes[:2] == ["first", "second"] and outcomes[3:] == ["ran", "third", "fourth"]
    assert isinstance(outcomes[2], ServiceError) and str(outcomes[2]) == "bad refused"


def test_a_failed_turn_fails_its_calls_only_and_the_queue_goes_on():
    def execute_merged(steps: list[StepRequest]) -> list[object]:
        if steps[0].release_request_ids == ("boom",):
            raise RuntimeError("the forward failed")
        return ["ok"] * len(steps)

    async def scenario() -> tuple[BaseException | None, object]:
        queue = ComputeQueue(compute_thread(), execute_merged, 64, 2048)
        failed = queue.execute(StepRequest(release_request_ids=("boom",)))
        error = None
        try:
            await failed
        except RuntimeError as exc:
            error = exc
        return error, await queue.execute(StepRequest(release_request_ids=("after",)))

    error, after = asyncio.run(scenario())
    assert str(error) == "the forward failed" and after == "ok"
