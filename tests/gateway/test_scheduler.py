"""The scheduler against the real allocator core and a fake executor (in_process)."""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from in_process import CorePool, FakeModel

from gateway.api.sampling import SamplingOptions
from gateway.core.batch import Batch, Budget, ScheduledStep
from gateway.core.request_state import Request, SeqStatus, Sequence
from gateway.core.scheduler import Scheduler
from gateway.core.step import Grant, Preemption, StepOutcome, TableDelta
from gateway.engine.router import initial_sequences

BLOCK = 4


def request(rid: str, prompt: list[int], max_tokens: int = 4, n: int = 1) -> Request:
    return Request(request_id=rid, prompt_token_ids=prompt,
                   sampling=SamplingOptions(max_tokens=max_tokens, n=n), cache_salt="")


def scheduler(seqs: int = 8, tokens: int = 64) -> Scheduler:
    return Scheduler(budget=Budget(max_num_seqs=seqs, max_num_batched_tokens=tokens),
                     block_size=BLOCK)


def add(sched: Scheduler, req: Request) -> list[Sequence]:
    seqs = initial_sequences(req)
    for seq in seqs:
        sched.add(seq)
    return seqs


def drive(
    sched: Scheduler, pool: CorePool, model: FakeModel, max_steps: int = 5000,
    pipelined: bool = False, stops: Callable[[int], bool] = lambda token: False,
    ahead: bool = False,
) -> int:
    """Run every queued sequence to max_tokens (or a token `stops` accepts); returns the
    number of steps. `pipelined`: the engine's order, each Step planned and sent while the
    previous batch is in flight, which executes only after that Step (its writes land after
    the Step's frees and preemptions, as on a real executor). `ahead` (pipelined): also each
    batch is built and launched before the previous one lands, with stand-ins for the
    tokens it samples, which the model fills in (use_sampled_token)."""
    steps = 0
    flights: deque[Batch] = deque()

    def land() -> list[tuple[Sequence, int]]:
        batch = flights.popleft()
        return sched.apply_result(batch, model.execute(batch.call))

    def take_outputs(sampled: list[tuple[Sequence, int]]) -> None:
        for seq, token in sampled:
            if seq.is_finished:
                continue
            if len(seq.output_token_ids) >= seq.request.sampling.max_tokens or stops(token):
                sched.finish(seq)

    while True:
        plan = sched.schedule(bool(flights))
        if plan is None or not plan.call.has_items():
            while flights:
                take_outputs(land())
            if plan is None:
                if not sched.pending.has_allocator_work():
                    break
                continue
        steps += 1
        assert steps < max_steps, "no progress"
        outcome = pool.step(plan.call)
        if ahead and flights:
            sched.advance(flights[0])
            batch = sched.apply_outcome(plan, outcome)
            sched.launch(batch)
            flights.append(batch)
            take_outputs(land())  # the batch before, which its tokens fill in
            continue
        sampled = land() if flights else []
        if not plan.call.has_items():
            take_outputs(sampled)
            continue
        flights.append(sched.apply_outcome(plan, outcome))
        sched.launch(flights[-1])
        take_outputs(sampled)  # the engine's order: after the next batch went out
        if not pipelined:
            take_outputs(land())
    model.execute(sched.apply_outcome(*_empty_step(sched)).call)  # last releases
    return steps


def _empty_step(sched: Scheduler):  # type: ignore[no-untyped-def]
    from common.step_records import StepCall
    from gateway.core.batch import ScheduledStep

    return ScheduledStep(call=StepCall(), seqs={}), StepOutcome()


def launch_then_allocate(
    sched: Scheduler, pool: CorePool
) -> tuple[Batch, ScheduledStep, StepOutcome]:
    """Step 1's batch goes out (launched, not landed); step 2 is planned and allocated
    while it runs, as the pipelined engine does."""
    plan = sched.schedule()
    assert plan is not None
    first = sched.apply_outcome(plan, pool.step(plan.call))
    sched.launch(first)
    plan = sched.schedule(in_flight=True)
    assert plan is not None
    return first, plan, pool.step(plan.call)


def test_scheduler_lists_running_decodes_before_waiting_prefills():
    # One request is decoding; a new one waits: the decode comes first, one token.
    sched = scheduler()
    pool, model = CorePool(64, BLOCK), FakeModel(BLOCK)
    add(sched, request("a", [1, 2, 3]))
    plan = sched.schedule()
    assert plan is not None
    batch = sched.apply_outcome(plan, pool.step(plan.call))
    sched.apply_result(batch, model.execute(batch.call))
    add(sched, request("b", [4, 5]))
    plan = sched.schedule()
    assert plan is not None
    # a's decode travels in the decode column, which comes before the items; its sampled
    # token's value in the appends.
    assert plan.call.decode_request_ids == ("a",)
    assert plan.call.append_request_ids == ("a",)
    assert plan.call.append_token_ids == (model.reference([1, 2, 3], 1)[0],)
    assert [(i.request_id, i.num_tokens, i.is_new) for i in plan.call.items] == [("b", 2, True)]
    assert plan.call.items[0].prompt_token_ids == (4, 5)


def test_scheduler_chunks_prefill_under_the_token_budget():
    # A 10-token prompt with a budget of 4 tokens per step: chunks 4, 4, 2; sampling at 2.
    sched = scheduler(tokens=4)
    pool, model = CorePool(64, BLOCK), FakeModel(BLOCK)
    add(sched, request("a", list(range(10)), max_tokens=1))
    chunks = []
    while (plan := sched.schedule()) is not None and plan.call.items:
        batch = sched.apply_outcome(plan, pool.step(plan.call))
        work = batch.call.seqs[0]
        chunks.append((work.start_position, len(work.token_ids), work.sample))
        for seq, _ in sched.apply_result(batch, model.execute(batch.call)):
            sched.finish(seq)
    assert chunks == [(0, 4, False), (4, 4, False), (8, 2, True)]


def test_scheduler_respects_max_num_seqs():
    # Three waiting requests, two sequences per step: the third waits.
    sched = scheduler(seqs=2)
    for rid in "abc":
        add(sched, request(rid, [1, 2]))
    plan = sched.schedule()
    assert plan is not None
    assert [i.request_id for i in plan.call.items] == ["a", "b"]


def test_scheduler_first_execute_carries_sampling_and_full_table():
    # A new request's first Execute creates its state: sampling and table from index 0.
    sched = scheduler()
    pool = CorePool(64, BLOCK)
    add(sched, request("a", list(range(6))))
    plan = sched.schedule()
    assert plan is not None
    batch = sched.apply_outcome(plan, pool.step(plan.call))
    (work,) = batch.call.seqs
    assert work.sampling is not None and work.sample
    assert work.delta == TableDelta(0, (0, 1))
    assert work.token_ids == tuple(range(6)) and work.start_position == 0


def test_scheduler_sends_plain_decodes_as_columns_and_pairs_their_tokens_in_order():
    # a (3 tokens) and b (4 tokens, a full block) are prefilled; next step both decode: a
    # inside its block (a compact column row), b entering a new block (its delta needs a
    # SeqWork); a new request c comes third. Sampled tokens pair with the rows in order.
    sched = scheduler()
    pool, model = CorePool(64, BLOCK), FakeModel(BLOCK)
    a = add(sched, request("a", [1, 2, 3]))[0]
    b = add(sched, request("b", [4, 5, 6, 7]))[0]
    plan = sched.schedule()
    assert plan is not None
    batch = sched.apply_outcome(plan, pool.step(plan.call))
    assert batch.call.decode_request_ids == () and batch.num_decodes == 0
    sched.apply_result(batch, model.execute(batch.call))
    c = add(sched, request("c", [8, 9]))[0]
    plan = sched.schedule()
    assert plan is not None
    batch = sched.apply_outcome(plan, pool.step(plan.call))
    call = batch.call
    assert call.decode_request_ids == ("a",)
    assert call.decode_token_ids == (a.output_token_ids[0],) and call.decode_positions == (3,)
    assert [(w.request_id, w.start_position, w.delta) for w in call.seqs] == [
        ("b", 4, TableDelta(1, (2,))), ("c", 0, TableDelta(0, (3,)))
    ]
    assert batch.scheduled == [(a, 1), (b, 1), (c, 2)] and batch.num_decodes == 1
    result = model.execute(call)
    assert sched.apply_result(batch, result) == [
        (a, result.decode_token_ids[0]), (b, result.tokens[0].token_id),
        (c, result.tokens[1].token_id),
    ]
    assert a.output_token_ids == model.reference([1, 2, 3], 2)
    assert b.output_token_ids == model.reference([4, 5, 6, 7], 2)


def test_scheduler_outputs_match_reference_without_preemption():
    # Plenty of blocks: every request's tokens equal the fake model's reference.
    sched = scheduler(seqs=4, tokens=16)
    pool, model = CorePool(256, BLOCK), FakeModel(BLOCK)
    reqs = [request(f"r{i}", [i + 1] * (3 + 5 * i), max_tokens=6) for i in range(6)]
    seqs = [add(sched, r)[0] for r in reqs]
    drive(sched, pool, model)
    for r, seq in zip(reqs, seqs, strict=True):
        assert seq.output_token_ids == model.reference(r.prompt_token_ids, 6)
    assert pool.num_preemptions == 0
    assert pool.all_free() and not model.held


def test_scheduler_recompute_preemption_keeps_outputs_and_returns_blocks():
    # 10 blocks of 4 tokens for 5 requests of up to 14 tokens: preemption must happen.
    sched = scheduler(seqs=8, tokens=32)
    pool, model = CorePool(10, BLOCK), FakeModel(BLOCK)
    reqs = [request(f"r{i}", [i + 3] * 6, max_tokens=8) for i in range(5)]
    seqs = [add(sched, r)[0] for r in reqs]
    drive(sched, pool, model)
    assert pool.num_preemptions > 0
    assert sched.num_preemptions == pool.num_preemptions
    for r, seq in zip(reqs, seqs, strict=True):
        assert seq.output_token_ids == model.reference(r.prompt_token_ids, 8)
    assert pool.all_free() and not model.held


def test_scheduler_preempted_request_rejoins_queue_front_and_is_released():
    # A recompute preemption: state reset, queued first, released at the executor next step.
    sched = scheduler()
    pool = CorePool(64, BLOCK)
    a = add(sched, request("a", [1, 2, 3]))[0]
    add(sched, request("b", [4]))
    plan = sched.schedule()
    assert plan is not None
    sched.apply_outcome(plan, pool.step(plan.call))
    a.output_token_ids.append(9)
    a.num_computed_tokens = 3
    plan = sched.schedule()
    assert plan is not None
    outcome = StepOutcome(preempted=(Preemption("a", swapped=False),),
                          grants={"b": Grant("b", None, 0, 1, 0)})
    batch = sched.apply_outcome(plan, outcome)
    assert batch.call.release_request_ids == ("a",)
    assert list(sched.waiting) == [a] and a.status is SeqStatus.WAITING
    assert a.num_computed_tokens == 0 and not a.known_to_executor
    plan = sched.schedule()
    assert plan is not None
    new = [i for i in plan.call.items if i.is_new]
    assert new[0].prompt_token_ids == (1, 2, 3, 9)


def test_scheduler_finish_queues_commit_free_and_release():
    # A finished request: its commit and free ride on the next Step, its release on Execute.
    sched = scheduler()
    pool, model = CorePool(64, BLOCK), FakeModel(BLOCK)
    a = add(sched, request("a", [1, 2, 3, 4, 5]))[0]
    plan = sched.schedule()
    assert plan is not None
    batch = sched.apply_outcome(plan, pool.step(plan.call))
    sched.apply_result(batch, model.execute(batch.call))
    sched.finish(a)
    plan = sched.schedule()
    assert plan is not None
    assert plan.call.free_request_ids == ("a",) and plan.call.items == ()
    assert [(c.request_id, c.num_computed_tokens) for c in plan.call.commits] == [("a", 5)]
    assert sched.pending.release_ids == ["a"]


def test_scheduler_abort_of_waiting_request_sends_nothing():
    # Cancelled before admission: nothing to abort anywhere.
    sched = scheduler()
    a = add(sched, request("a", [1, 2]))[0]
    sched.abort(a)
    assert sched.schedule() is None
    assert not sched.pending.abort_request_ids and not sched.pending.release_ids


def test_scheduler_fork_replaces_parent_with_children_sharing_its_table():
    # n=3: the parent computes prompt[:-1]; after fork the children append the last token.
    sched = scheduler()
    pool, model = CorePool(64, BLOCK), FakeModel(BLOCK)
    req = request("r", [5, 6, 7, 8, 9, 10], n=3)
    (parent,) = add(sched, req)
    assert parent.is_prefill_parent and parent.token_ids == [5, 6, 7, 8, 9]
    plan = sched.schedule()
    assert plan is not None
    batch = sched.apply_outcome(plan, pool.step(plan.call))
    assert batch.call.seqs[0].sample is False
    assert sched.apply_result(batch, model.execute(batch.call)) == []
    assert sched.ready_to_fork(batch) == [parent]
    children = [Sequence(seq_id=f"r-{i}", request=req, index=i, seed_offset=i) for i in range(3)]
    tables = pool.fork(parent.seq_id, [c.seq_id for c in children])
    assert tables == [TableDelta(0, (0, 1))] * 3
    sched.fork(parent, children, tables)
    plan = sched.schedule()
    assert plan is not None
    # Each child decodes the last prompt token (the decode column; its value appended).
    assert plan.call.decode_request_ids == ("r-0", "r-1", "r-2") and not plan.call.items
    assert plan.call.append_request_ids == ("r-0", "r-1", "r-2")
    assert plan.call.append_token_ids == (10, 10, 10)
    assert plan.call.free_request_ids == ("r-prefill",)
    assert children[1].exec_sampling().seed is None
    # Writing position 5 into the shared partial block 1: copy-on-write for all but the last,
    # which then holds block 1 alone and writes in place (no grant at all). Each child's first
    # Execute carries its whole table: the Fork's, with the copy in place.
    outcome = pool.step(plan.call)
    assert "r-2" not in outcome.grants and "r-2" not in outcome.appended
    batch = sched.apply_outcome(plan, outcome)
    assert [(w.request_id, w.delta) for w in batch.call.seqs] == [
        ("r-0", TableDelta(0, (0, 2))), ("r-1", TableDelta(0, (0, 3))),
        ("r-2", TableDelta(0, (0, 1)))]
    assert all(c.fork_table is None for c in children)  # handed over
    assert [(c.src_block_id, c.dst_block_id) for c in batch.call.copies] == [(1, 2), (1, 3)]
    sampled = sched.apply_result(batch, model.execute(batch.call))
    expected = model.reference([5, 6, 7, 8, 9, 10], 1)
    assert [(s.seq_id, t) for s, t in sampled] == [(c.seq_id, expected[0]) for c in children]


def fork_after_prefill(sched: Scheduler, pool: CorePool, model: FakeModel, req: Request
                       ) -> list[Sequence]:
    """An n > 1 request's prefill parent computed, then forked into its children."""
    (parent,) = add(sched, req)
    plan = sched.schedule()
    assert plan is not None
    batch = sched.apply_outcome(plan, pool.step(plan.call))
    sched.apply_result(batch, model.execute(batch.call))
    children = [Sequence(seq_id=f"{req.request_id}-{i}", request=req, index=i, seed_offset=i)
                for i in range(req.sampling.n)]
    sched.fork(parent, children, pool.fork(parent.seq_id, [c.seq_id for c in children]))
    return children


def test_scheduler_forked_child_at_a_block_boundary_sends_the_fork_table_and_its_new_block():
    # n=2, prompt of 9: the parent computes 8 tokens (two full blocks, 0 and 1); each child's
    # first decode enters a new block (the allocator's compact "appended" form, no grant).
    # Its first Execute carries the Fork's table with that block appended.
    sched = scheduler()
    pool, model = CorePool(64, BLOCK), FakeModel(BLOCK)
    children = fork_after_prefill(sched, pool, model, request("r", list(range(5, 14)), n=2))
    plan = sched.schedule()
    assert plan is not None
    outcome = pool.step(plan.call)
    assert outcome.appended == {"r-0": 2, "r-1": 3} and not outcome.grants
    batch = sched.apply_outcome(plan, outcome)
    assert [(w.request_id, w.start_position, w.delta) for w in batch.call.seqs] == [
        ("r-0", 8, TableDelta(0, (0, 1, 2))), ("r-1", 8, TableDelta(0, (0, 1, 3)))]
    expected = model.reference(list(range(5, 14)), 1)
    sampled = sched.apply_result(batch, model.execute(batch.call))
    assert [(s.seq_id, t) for s, t in sampled] == [(c.seq_id, expected[0]) for c in children]
    # Later grants are changes to the executor's copy: plain decodes, no table sent.
    plan = sched.schedule()
    assert plan is not None
    batch = sched.apply_outcome(plan, pool.step(plan.call))
    assert batch.call.decode_request_ids == ("r-0", "r-1") and not batch.call.seqs


def test_scheduler_beam_child_of_a_parent_that_copied_first_writes_in_place():
    # A beam forked after its first step goes on beside its child (keep_parent), ahead of it
    # in the next step: the parent copies the shared partial block 1 -> 2, so the child holds
    # block 1 alone and writes in place with no grant; its first Execute still carries its
    # whole table (the Fork's).
    sched = scheduler()
    pool, model = CorePool(64, BLOCK), FakeModel(BLOCK)
    prompt = [5, 6, 7, 8, 9, 10]
    req = request("b", prompt, max_tokens=4)
    (beam,) = add(sched, req)
    beam.is_beam = True  # its tokens are appended by hand, as a search picks them
    plan = sched.schedule()
    assert plan is not None
    batch = sched.apply_outcome(plan, pool.step(plan.call))
    ((_, first),) = sched.apply_result(batch, model.execute(batch.call))
    child = Sequence(seq_id="b-1", request=req, index=1, is_beam=True)
    sched.fork(beam, [child], pool.fork(beam.seq_id, [child.seq_id]), keep_parent=True)
    beam.beam_candidates = None
    beam.output_token_ids.append(first)
    child.output_token_ids.append(42)
    plan = sched.schedule()
    assert plan is not None and plan.call.decode_request_ids == ("b", "b-1")
    outcome = pool.step(plan.call)
    assert outcome.grants["b"].delta == TableDelta(1, (2,))
    assert "b-1" not in outcome.grants and "b-1" not in outcome.appended
    batch = sched.apply_outcome(plan, outcome)
    assert [(w.request_id, w.start_position, w.delta) for w in batch.call.seqs] == [
        ("b", 6, TableDelta(1, (2,))), ("b-1", 6, TableDelta(0, (0, 1)))]
    assert [(c.src_block_id, c.dst_block_id) for c in batch.call.copies] == [(1, 2)]
    assert sched.apply_result(batch, model.execute(batch.call)) == [
        (beam, model.next_token([*prompt, first])), (child, model.next_token([*prompt, 42]))]


def test_scheduler_forked_child_swapped_out_before_its_first_execute_gets_the_swap_in_table():
    # The allocator swaps a child out in its first step: the Fork's table is stale (the blocks
    # went to CPU), and the swap-in grant carries the whole new table instead.
    sched = scheduler()
    sched.swap = True
    pool, model = CorePool(64, BLOCK), FakeModel(BLOCK)
    children = fork_after_prefill(sched, pool, model, request("r", [5, 6, 7, 8, 9, 10], n=2))
    plan = sched.schedule()
    assert plan is not None
    sched.apply_outcome(plan, StepOutcome(preempted=(Preemption("r-1", swapped=True),),
                                          appended={}, grants={}))
    assert children[1].status is SeqStatus.SWAPPED and children[1].fork_table is None
    plan = sched.schedule()
    assert plan is not None
    grant = Grant("r-1", TableDelta(0, (7, 8)), 0, 1, 5)
    batch = sched.apply_outcome(plan, StepOutcome(grants={"r-1": grant}))
    work = next(w for w in batch.call.seqs if w.request_id == "r-1")
    assert work.delta == TableDelta(0, (7, 8)) and work.sampling is not None


@settings(max_examples=25, deadline=None)
@given(
    prompts=st.lists(st.integers(min_value=1, max_value=14), min_size=1, max_size=6),
    max_tokens=st.integers(min_value=1, max_value=6),
    num_blocks=st.integers(min_value=5, max_value=24),
    budget=st.integers(min_value=1, max_value=20),
)
@pytest.mark.parametrize("mode", ["ahead", "pipelined", "sequential"])
def test_scheduler_any_pool_and_budget_gives_reference_outputs(
    prompts: list[int], max_tokens: int, num_blocks: int, budget: int, mode: str
):
    # Whatever the pool size and token budget: same tokens, all blocks back, nothing held.
    sched = scheduler(seqs=4, tokens=budget)
    pool, model = CorePool(num_blocks, BLOCK), FakeModel(BLOCK)
    reqs = [request(f"r{i}", [(i * 7 + j) % 90 + 1 for j in range(p)], max_tokens=max_tokens)
            for i, p in enumerate(prompts)]
    run_to_reference(sched, pool, model, reqs, max_tokens, mode)


def _stop_token(token: int) -> bool:
    """A stand-in for EOS or a stop token: a sequence may end before max_tokens, while the
    pipelined step after it is already planned (and allocated) for it."""
    return token % 7 == 0


def run_to_reference(sched: Scheduler, pool: CorePool, model: FakeModel,
                     reqs: list[Request], max_tokens: int, mode: str = "sequential") -> None:
    """Drive every request that fits the pool alone (the gateway rejects the others up
    front): each gets the reference tokens (up to a stop token, when pipelined), and all
    blocks come back, nothing held."""
    num_blocks = pool.pool.config.num_blocks
    reqs = [r for r in reqs if -(-(len(r.prompt_token_ids) + max_tokens) // BLOCK) <= num_blocks]
    seqs = [add(sched, r)[0] for r in reqs]
    pipelined = mode != "sequential"
    stops = _stop_token if pipelined else (lambda token: False)
    drive(sched, pool, model, pipelined=pipelined, stops=stops, ahead=mode == "ahead")
    for r, seq in zip(reqs, seqs, strict=True):
        expected = model.reference(r.prompt_token_ids, max_tokens)
        ends = [i for i, token in enumerate(expected) if stops(token)]
        assert seq.output_token_ids == (expected[: ends[0] + 1] if ends else expected)
    assert sched.num_preemptions == pool.num_preemptions
    assert pool.all_free() and not model.held


@settings(max_examples=40, deadline=None)
@given(
    prompts=st.lists(st.integers(min_value=1, max_value=14), min_size=1, max_size=6),
    shared=st.integers(min_value=0, max_value=12),
    max_tokens=st.integers(min_value=1, max_value=6),
    num_blocks=st.integers(min_value=5, max_value=24),
    num_cpu_blocks=st.integers(min_value=0, max_value=12),
    budget=st.integers(min_value=1, max_value=20),
    swap=st.booleans(),
)
@pytest.mark.parametrize("mode", ["ahead", "pipelined", "sequential"])
def test_scheduler_shared_prefixes_and_swap_give_reference_outputs(
    prompts: list[int], shared: int, max_tokens: int, num_blocks: int, num_cpu_blocks: int,
    budget: int, swap: bool, mode: str,
):
    # Prompts sharing a prefix (prefix-cache hits), recompute or swap preemption (with or
    # without CPU blocks), any budget: same tokens, all blocks back, nothing held.
    sched = scheduler(seqs=4, tokens=budget)
    sched.swap = swap
    pool, model = CorePool(num_blocks, BLOCK, num_cpu_blocks=num_cpu_blocks), FakeModel(BLOCK)
    prefix = [(3 * j) % 90 + 1 for j in range(shared)]
    reqs = [request(f"r{i}", prefix + [(i * 7 + j) % 90 + 1 for j in range(p)],
                    max_tokens=max_tokens)
            for i, p in enumerate(prompts)]
    run_to_reference(sched, pool, model, reqs, max_tokens, mode)


@pytest.mark.parametrize("front", [True, False])
def test_scheduler_add_puts_sequence_at_the_requested_end(front: bool):
    # Re-queued sequences (executor lost) go first; new ones last.
    sched = scheduler()
    a = add(sched, request("a", [1]))[0]
    b = Sequence(seq_id="b", request=request("b", [2]), index=0)
    sched.add(b, front=front)
    assert list(sched.waiting) == ([b, a] if front else [a, b])


def test_scheduler_swapped_request_sends_its_token_once():
    # Swapped out in a step that carried its sampled token, then deferred on swap-in:
    # the allocator recorded the token at once, so it is never sent again.
    sched = scheduler()
    sched.swap = True
    pool, model = CorePool(64, BLOCK), FakeModel(BLOCK)
    a = add(sched, request("a", [1, 2, 3]))[0]
    plan = sched.schedule()
    assert plan is not None
    batch = sched.apply_outcome(plan, pool.step(plan.call))
    sched.apply_result(batch, model.execute(batch.call))
    plan = sched.schedule()  # the decode of a: carries its sampled token
    assert plan is not None and plan.call.append_token_ids == (a.output_token_ids[0],)
    sched.apply_outcome(plan, StepOutcome(preempted=(Preemption("a", swapped=True),)))
    assert a.status is SeqStatus.SWAPPED and a.num_allocator_tokens == 4
    plan = sched.schedule()  # swap-in attempt: no new token to send
    assert plan is not None and plan.call.append_request_ids == ()
    assert [(i.request_id, i.num_tokens) for i in plan.call.items] == [("a", 1)]
    sched.apply_outcome(plan, StepOutcome(deferred_request_ids=frozenset({"a"})))
    assert a.status is SeqStatus.SWAPPED and a.num_allocator_tokens == 4
    plan = sched.schedule()
    assert plan is not None
    grant = Grant("a", TableDelta(0, (9,)), 0, 1, 3)
    batch = sched.apply_outcome(plan, StepOutcome(grants={"a": grant}))
    assert a.status is SeqStatus.RUNNING
    (work,) = batch.call.seqs
    assert work.start_position == 3 and work.token_ids == (a.output_token_ids[0],)
    assert work.delta == TableDelta(0, (9,)) and work.sampling is None


def test_scheduler_child_seed_wraps_to_uint64():
    # seed + index must stay a valid uint64 on the wire (2**64 - 1 + 1 wraps to 0).
    req = Request(request_id="r", prompt_token_ids=[5, 6, 7], cache_salt="",
                  sampling=SamplingOptions(max_tokens=4, n=2, seed=2**64 - 1))
    child = Sequence(seq_id="r-1", request=req, index=1, seed_offset=1)
    assert child.exec_sampling().seed == 0


def test_scheduler_overlapped_plans_on_top_of_the_batch_in_flight():
    # While a batch executes, the next plan decodes what it samples (by count: no value yet)
    # and continues a chunked prefill where the batch will leave it; the values follow in
    # the appends of the plan after.
    sched, pool, model = scheduler(tokens=8), CorePool(32, BLOCK), FakeModel(BLOCK)
    (a,) = add(sched, request("a", [5, 6, 7], max_tokens=5))
    (b,) = add(sched, request("b", list(range(10, 22)), max_tokens=5))  # 12 tokens: chunked
    plan = sched.schedule()
    assert plan is not None
    first = sched.apply_outcome(plan, pool.step(plan.call))  # a's prompt, b's first 5
    sched.launch(first)
    plan = sched.schedule(in_flight=True)
    assert plan is not None
    call = plan.call
    # Numbered; nothing executed yet to confirm.
    assert (call.step_id, call.commit_through_step_id) == (2, 0)
    assert call.decode_request_ids == ("a",)
    assert [(i.request_id, i.num_tokens) for i in call.items] == [("b", 7)]
    assert call.append_request_ids == ()
    outcome = pool.step(call)
    sampled = sched.apply_result(first, model.execute(first.call))  # the batch returns
    assert [(s.seq_id, t) for s, t in sampled] == [("a", model.reference([5, 6, 7], 1)[0])]
    second = sched.apply_outcome(plan, outcome)
    assert second.call.decode_request_ids == ("a",)  # the executor learns its value
    assert second.call.decode_token_ids == (a.output_token_ids[0],)
    sched.launch(second)
    plan = sched.schedule(in_flight=True)
    assert plan is not None
    assert plan.call.append_request_ids == ("a",)
    assert plan.call.append_token_ids == (a.output_token_ids[0],)
    assert set(plan.call.decode_request_ids) == {"a", "b"}
    # The first batch executed: its Step (1) is confirmed; the second's is still in flight.
    assert (plan.call.step_id, plan.call.commit_through_step_id) == (3, 1)


def test_scheduler_overlapped_skips_a_sequence_whose_last_token_is_in_flight():
    sched, pool = scheduler(), CorePool(32, BLOCK)
    add(sched, request("a", [5, 6, 7], max_tokens=1))
    plan = sched.schedule()
    assert plan is not None
    sched.launch(sched.apply_outcome(plan, pool.step(plan.call)))
    assert sched.schedule(in_flight=True) is None  # its one token is being sampled


def test_scheduler_a_sequence_ending_while_the_allocator_preempts_it_sends_it_no_more():
    # Pipelined: b ends (a stop token) in the batch in flight, while the Step already sent
    # makes room for a by preempting b (recompute), which frees it at the allocator. Nothing
    # queued for b may reach the allocator afterwards (it would name an unknown request),
    # and b does not come back.
    sched, pool, model = scheduler(), CorePool(2, BLOCK), FakeModel(BLOCK)
    (a,) = add(sched, request("a", [5, 6, 7, 8], max_tokens=5))
    (b,) = add(sched, request("b", [9, 10, 11, 12], max_tokens=5))
    first, plan, outcome = launch_then_allocate(sched, pool)  # one full block each
    assert plan.call.decode_request_ids == ("a", "b")
    # Both need a second block: b, behind a, is preempted.
    assert [p.request_id for p in outcome.preempted] == ["b"]
    sched.apply_result(first, model.execute(first.call))
    sched.finish(b)  # its sampled token was a stop token
    second = sched.apply_outcome(plan, outcome)
    assert b.is_finished and b not in sched.waiting
    assert "b" not in sched.pending.free_request_ids and "b" not in sched.pending.commits
    sched.launch(second)
    plan = sched.schedule(in_flight=True)
    assert plan is not None
    pool.step(plan.call)  # accepted: it names only a
    assert a.status is SeqStatus.RUNNING


def test_scheduler_sends_each_value_once_after_an_overlapped_step():
    # The engine may plan with nothing in flight right after an overlapped step (an orphan
    # abort lands the batch first): the value of the token decoded by count and the newest
    # one go once each, in order, with a plain decode; the run still ends at the reference.
    sched, pool, model = scheduler(), CorePool(32, BLOCK), FakeModel(BLOCK)
    (a,) = add(sched, request("a", [5, 6, 7], max_tokens=6))
    first, plan, outcome = launch_then_allocate(sched, pool)
    sched.apply_result(first, model.execute(first.call))
    second = sched.apply_outcome(plan, outcome)
    sched.launch(second)
    assert a.num_allocator_tokens == 3  # its first output was decoded by count
    sched.apply_result(second, model.execute(second.call))  # landed: nothing in flight
    plan = sched.schedule()
    assert plan is not None and not plan.call.items
    assert plan.call.append_request_ids == ("a", "a")
    assert plan.call.append_token_ids == tuple(a.output_token_ids[:2])
    assert plan.call.decode_request_ids == ("a",)
    third = sched.apply_outcome(plan, pool.step(plan.call))  # accepted
    sched.apply_result(third, model.execute(third.call))
    drive(sched, pool, model, pipelined=True)
    assert a.output_token_ids == model.reference([5, 6, 7], 6)
    assert pool.all_free() and not model.held


def test_scheduler_a_sequence_preempted_while_its_batch_ran_is_named_no_more():
    # Depth 2: b's batch lands after the Step already out preempted it by recompute, which
    # freed it at the allocator: the next Step names it nowhere (the allocator would refuse
    # an unknown request), and confirms b's executed step by id, which skips it.
    sched, pool, model = scheduler(), CorePool(2, BLOCK), FakeModel(BLOCK)
    add(sched, request("a", [5, 6, 7, 8], max_tokens=5))
    (b,) = add(sched, request("b", [9, 10, 11, 12], max_tokens=5))
    first, plan, outcome = launch_then_allocate(sched, pool)
    assert [p.request_id for p in outcome.preempted] == ["b"]
    sched.apply_result(first, model.execute(first.call))
    assert sched.pending.executed_through == first.step_id == 1
    sched.apply_outcome(plan, outcome)
    assert b.status is SeqStatus.WAITING
    plan = sched.schedule()
    assert plan is not None and plan.call.commit_through_step_id == 1
    call = plan.call
    named = {*call.decode_request_ids, *call.append_request_ids, *call.free_request_ids,
             *call.abort_request_ids, *(c.request_id for c in call.commits),
             *(i.request_id for i in call.items if not i.is_new)}
    assert "b" not in named
    pool.step(call)  # accepted


def test_scheduler_confirms_each_executed_step_once_when_idle():
    # An idle engine's housekeeping (a Free) carries the newest executed step's id when no
    # call has carried it yet; then there is nothing to send. Every Step carries it anyway
    # (idempotent at the allocator).
    sched = scheduler()
    sched.pending.executed_through = 3
    plan = sched.schedule()
    assert plan is not None and not plan.call.has_items()
    assert plan.call.commit_through_step_id == 3 and plan.call.step_id == 0
    assert sched.schedule() is None
    add(sched, request("a", [5, 6, 7]))
    plan = sched.schedule()
    assert plan is not None and plan.call.has_items()
    assert (plan.call.step_id, plan.call.commit_through_step_id) == (1, 3)


@pytest.mark.parametrize("swapped", [False, True], ids=["recompute", "swap"])
def test_scheduler_a_sequence_started_over_then_preempted_is_queued_once(swapped: bool):
    # b's batch was lost after its next Step went out (recovery starts it over); that
    # Step's outcome then preempts it: b stays queued once, for readmission, and its abort
    # goes only where the allocator still holds it (swapped out, not freed).
    sched = scheduler()
    pool, model = CorePool(16, BLOCK), FakeModel(BLOCK)
    [b] = add(sched, request("b", [1, 2, 3], max_tokens=8))
    plan = sched.schedule()
    assert plan is not None
    batch = sched.apply_outcome(plan, pool.step(plan.call))
    sched.apply_result(batch, model.execute(batch.call))
    plan = sched.schedule()  # b decodes
    assert plan is not None
    sched.recompute(b)
    sched.apply_outcome(plan, StepOutcome(preempted=(Preemption("b", swapped=swapped),)))
    assert list(sched.waiting) == [b] and not sched.running and not sched.swapped
    assert b.status is SeqStatus.WAITING and not b.known_to_allocator
    assert ("b" in sched.pending.abort_request_ids) == swapped


def test_a_tenant_at_its_block_quota_stands_aside_for_other_tenants():
    # The allocator defers tenant a's request (a holds its 2-block quota) and admits b's
    # behind it: a's waiting requests then stand aside, so the next step does not carry them
    # again ahead of the other tenants'; once a's running request ends, a goes on.
    sched = Scheduler(budget=Budget(max_num_seqs=8, max_num_batched_tokens=64),
                      block_size=BLOCK)
    pool, model = CorePool(64, BLOCK), FakeModel(BLOCK)
    pool.allocator.limits = replace(pool.allocator.limits, max_blocks_per_tenant=2)
    prompt = [5] * (2 * BLOCK)

    def tenant_request(rid: str) -> Request:
        req = request(rid, [ord(rid[1]), *prompt[1:]], max_tokens=50)
        req.tenant = rid[0]
        return req

    def step(plan: Any) -> StepOutcome:
        outcome = pool.step(plan.call)
        batch = sched.apply_outcome(plan, outcome)
        sched.apply_result(batch, model.execute(batch.call))
        return outcome

    (a1,) = add(sched, tenant_request("a1"))
    step(sched.schedule())
    for rid in ("a2", "b1", "a3", "b2"):
        add(sched, tenant_request(rid))
    plan = sched.schedule()
    assert [i.request_id for i in plan.call.items] == ["a2", "b1", "a3", "b2"]
    assert step(plan).deferred_request_ids == {"a2", "a3", "b2"}
    assert sched.tenants.blocked == {"a"}  # b2 was deferred last: space or quota, unknown
    plan = sched.schedule()
    assert [i.request_id for i in plan.call.items if i.is_new] == ["b2"]
    step(plan)
    sched.finish(a1)
    plan = sched.schedule()
    assert [i.request_id for i in plan.call.items if i.is_new][:1] == ["a2"]


def test_a_full_pool_deferring_every_admission_blames_no_tenant():
    # Every new item deferred for lack of space: no quota is to blame, so no tenant stands
    # aside (it once marked all but the last, and a tenant with nothing running here was
    # never cleared: its requests waited forever). Here with no quota at all.
    sched = Scheduler(budget=Budget(max_num_seqs=8, max_num_batched_tokens=256),
                      block_size=BLOCK)
    pool, model = CorePool(6, BLOCK), FakeModel(BLOCK)

    def tenant_request(rid: str, length: int) -> Request:  # no prefix shared with another
        req = request(rid, [ord(rid[0]), *[5] * (length - 1)], max_tokens=40)
        req.tenant = rid[0]
        return req

    (big,) = add(sched, tenant_request("z1", 4 * BLOCK))
    plan = sched.schedule()
    batch = sched.apply_outcome(plan, pool.step(plan.call))
    sched.apply_result(batch, model.execute(batch.call))
    for rid in ("a1", "b1", "c1"):
        add(sched, tenant_request(rid, 3 * BLOCK))
    plan = sched.schedule()
    outcome = pool.step(plan.call)
    assert outcome.deferred_request_ids == {"a1", "b1", "c1"}
    sched.apply_outcome(plan, outcome)
    assert sched.tenants.blocked == set()
    sched.finish(big)
    plan = sched.schedule()
    assert [i.request_id for i in plan.call.items if i.is_new] == ["a1", "b1", "c1"]


def test_a_tenant_with_nothing_here_is_deferred_again_not_set_aside():
    # a's blocks are held elsewhere (another gateway's requests: here, requests admitted on
    # the pool directly): a deferral by quota cannot be cleared by anything of this
    # scheduler's, so a is not set aside; its request is simply carried again.
    sched = Scheduler(budget=Budget(max_num_seqs=8, max_num_batched_tokens=64),
                      block_size=BLOCK)
    pool, model = CorePool(64, BLOCK), FakeModel(BLOCK)
    pool.allocator.limits = replace(pool.allocator.limits, max_blocks_per_tenant=2)
    other = Scheduler(budget=Budget(max_num_seqs=8, max_num_batched_tokens=64),
                      block_size=BLOCK)
    prompt = [5] * (2 * BLOCK)

    def tenant_request(rid: str) -> Request:
        req = request(rid, [ord(rid[1]), *prompt[1:]], max_tokens=50)
        req.tenant = rid[0]
        return req

    sched.step_ids = itertools.count(1000)  # after the other's on the shared pool
    add(other, tenant_request("a0"))  # the other gateway's: holds a's quota
    plan = other.schedule()
    other.apply_outcome(plan, pool.step(plan.call))
    for rid in ("a1", "b1"):
        add(sched, tenant_request(rid))
    plan = sched.schedule()
    outcome = pool.step(plan.call)
    assert outcome.deferred_request_ids == {"a1"}
    batch = sched.apply_outcome(plan, outcome)
    sched.apply_result(batch, model.execute(batch.call))
    assert sched.tenants.blocked == set()
    plan = sched.schedule()
    assert [i.request_id for i in plan.call.items if i.is_new] == ["a1"]


def prioritized(rid: str, prompt: list[int], priority: int, max_tokens: int = 4) -> Request:
    return Request(request_id=rid, prompt_token_ids=prompt, cache_salt="",
                   sampling=SamplingOptions(max_tokens=max_tokens, priority=priority))


def test_scheduler_waiting_queue_orders_by_priority_then_arrival():
    # Lower priority values first; FCFS among equals (vLLM's priority policy).
    sched = scheduler()
    for rid, level in (("a", 1), ("b", 0), ("c", 2), ("d", 0), ("e", 1)):
        add(sched, prioritized(rid, [3, 4], level))
    assert [s.request.request_id for s in sched.waiting] == ["b", "d", "a", "e", "c"]
    # A preempted request goes in front of the waiting ones of its own priority only.
    seq = Sequence(seq_id="p", request=prioritized("p", [5], 1), index=0)
    sched.add(seq, front=True)
    assert [s.request.request_id for s in sched.waiting] == ["b", "d", "p", "a", "e", "c"]
    plan = sched.schedule()
    assert plan is not None
    assert [i.request_id for i in plan.call.items] == ["b", "d", "p", "a", "e", "c"]
    # Each new item carries its level: the allocator's cost policy preempts the least urgent.
    assert [i.priority for i in plan.call.items] == [0, 0, 1, 1, 1, 2]


def test_scheduler_preempts_the_lowest_priority_running_request_first():
    # Three requests admitted in arrival order, the urgent one last; the pool then runs
    # short. The allocator preempts from the tail of the step's order: the running queue is
    # in priority order, so the least urgent request goes, never the urgent one.
    sched = scheduler(seqs=8, tokens=64)
    pool, model = CorePool(6, BLOCK), FakeModel(BLOCK)
    low = add(sched, prioritized("low", [3] * 4, priority=5, max_tokens=12))[0]
    mid = add(sched, prioritized("mid", [4] * 4, priority=1, max_tokens=12))[0]
    urgent = add(sched, prioritized("urgent", [5] * 4, priority=0, max_tokens=12))[0]
    assert [s.request.request_id for s in sched.waiting] == ["urgent", "mid", "low"]
    drive(sched, pool, model)
    assert pool.num_preemptions > 0
    assert urgent.num_preemptions == 0
    assert low.num_preemptions >= mid.num_preemptions
    for seq in (low, mid, urgent):
        assert seq.output_token_ids == model.reference(seq.request.prompt_token_ids, 12)
    assert pool.all_free() and not model.held


def test_scheduler_running_order_follows_priority_after_admission():
    sched = scheduler()
    pool = CorePool(64, BLOCK)
    add(sched, prioritized("late-urgent", [1, 2], priority=0))
    add(sched, prioritized("relaxed", [3, 4], priority=9))
    plan = sched.schedule()
    assert plan is not None
    sched.apply_outcome(plan, pool.step(plan.call))
    add(sched, prioritized("urgent-2", [5, 6], priority=0))
    plan = sched.schedule()
    assert plan is not None
    sched.apply_outcome(plan, pool.step(plan.call))
    assert [s.request.request_id for s in sched.running] == ["late-urgent", "urgent-2",
                                                             "relaxed"]


def test_scheduler_readmissions_after_recompute_are_counted_apart():
    # The same workload as above: every prompt counts once as a prefix-cache query; the
    # readmissions of preempted requests (prompt + generated tokens) are sent as resumed.
    sched = scheduler(seqs=8, tokens=32)
    pool, model = CorePool(10, BLOCK), FakeModel(BLOCK)
    reqs = [request(f"r{i}", [i + 3] * 6, max_tokens=8) for i in range(5)]
    for r in reqs:
        add(sched, r)
    drive(sched, pool, model)
    assert pool.num_preemptions > 0
    core = pool.pool
    assert core.num_prefix_queries == sum(len(r.prompt_token_ids) for r in reqs)
    assert core.num_resumed_prefix_queries > 0
