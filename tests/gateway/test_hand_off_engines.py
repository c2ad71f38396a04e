"""KV hand-off between two engines (engine/hand_off.py): each on the real allocator core and
a fake executor that keeps token ids in its KV slots (in_process.py), so a sampled token
depends on every token read back through the block table: a block moved wrong, or missing,
changes the output. The reference is the fake model's own generation on one executor."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from in_process import CorePool, FakeModel, rpc_error
from test_engine import BLOCK, FakeLink, drain, submit, tokenizer  # noqa: F401 - a fixture

from allocator_svc.core.hand_off import HandOff
from common.errors import ServiceError
from gateway.clients.allocator_client import HandOffReservation
from gateway.clients.call_failures import failure
from gateway.core.batch import Budget
from gateway.core.finish_rules import FinishRules
from gateway.core.request_state import FinishReason, Request
from gateway.core.scheduler import Scheduler
from gateway.core.step import ExecuteCall, ExecuteResult
from gateway.engine.hand_off import HandOffs
from gateway.engine.loop import Engine


@dataclass
class Imported:
    num_blocks: int
    num_bytes: int
    elapsed_ms: float


@dataclass
class HandLink(FakeLink):
    """A FakeLink whose pool can take hand-offs and whose executor can import KV from
    another HandLink's executor (block by block, as ImportKV does)."""

    lease_generation: int = 0
    import_gate: asyncio.Event | None = None  # set: imports wait for it
    compute_gate: asyncio.Event | None = None  # set: Executes wait for it (a long step)
    import_error: grpc.StatusCode | None = None
    calls: list[ExecuteCall] = field(default_factory=list)
    num_imports: int = 0
    launched: list[int] = field(default_factory=list)  # Execute step ids, as sent
    returned: set[int] = field(default_factory=set)  # and as they returned
    # Per import: the Execute it names (previous_step_id) and those sent and not returned.
    imports: list[tuple[int, list[int]]] = field(default_factory=list)

    async def execute(self, call: ExecuteCall, step_id: int = 0,
                      previous_step_id: int = 0) -> ExecuteResult:
        self.launched.append(step_id)
        try:
            return await super().execute(call, step_id, previous_step_id)
        finally:
            self.returned.add(step_id)

    async def compute(self, call: ExecuteCall) -> ExecuteResult:
        self.calls.append(call)
        if self.compute_gate is not None:
            await self.compute_gate.wait()
        return await super().compute(call)

    def take_lease_renewal(self) -> bool:
        taken = super().take_lease_renewal()
        self.lease_renewed = self.renewals > 0
        return taken

    async def reserve_hand_off(
        self, request_id: str, token_ids: Any, num_prompt_tokens: int, cache_salt: str,
        tenant: str, source_model_fingerprint: str, source_block_size: int,
        source_pool_id: str, client_request_id: str, priority: int = 0,
    ) -> HandOffReservation:
        core = self.pool
        try:
            request = core.allocator.reserve_hand_off(HandOff(
                "pool-0", core.epoch, None, request_id, list(token_ids), num_prompt_tokens,
                cache_salt, tenant, source_model_fingerprint, source_block_size,
                priority=priority))
        except ServiceError as exc:
            raise rpc_error(exc) from exc
        core.pool.check_invariants()
        return HandOffReservation(tuple(b.block_id for b in request.blocks),
                                  request.num_cached_tokens, core.pool.blocks.num_free)

    async def import_kv(self, source: HandLink, request_id: str, first_block_index: int,
                        block_ids: Any, num_tokens: int, timeout_s: float | None,
                        previous_step_id: int = 0) -> Imported:
        self.imports.append(
            (previous_step_id, [i for i in self.launched if i not in self.returned]))
        if self.import_gate is not None:
            await self.import_gate.wait()
        if self.import_error is not None:
            raise failure(self.import_error, "a block failed its checksum")
        held = source.model.held.get(request_id)
        if held is None:
            raise failure(grpc.StatusCode.NOT_FOUND, f"source: {request_id} is not held")
        assert held.num_tokens >= num_tokens, "KV asked for beyond what the source computed"
        async with self.executor_lock:  # written in Execute order, as the executor does
            for index, block_id in enumerate(block_ids, start=first_block_index):
                self.model.gpu[block_id] = list(source.model._block(held.table[index]))
        self.num_imports += 1
        return Imported(len(block_ids), len(block_ids) * BLOCK, 0.1)


def description(role: str) -> SimpleNamespace:
    return SimpleNamespace(uses_sampled_tokens=True, role=role, block_size=BLOCK,
                           model_fingerprint="fake-model", kv_layout=("fake-kv", BLOCK),
                           lora_adapters=())


@dataclass
class Pair:
    source: Engine
    target: Engine
    a: HandLink
    b: HandLink
    mover: HandOffs
    outcomes: list[str] = field(default_factory=list)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)  # the engines' loops


def pair(roles: tuple[str, str] = ("prefill", "decode"), depth: int = 2,
         blocks: tuple[int, int] = (64, 64), rebalance_min_gap: int = 0) -> Pair:
    engines: list[Engine] = []
    outcomes: list[str] = []
    mover = HandOffs(lambda: engines, rebalance_min_gap=rebalance_min_gap,
                     observe=lambda outcome, seconds: outcomes.append(outcome))
    links = []
    for name, role, num_blocks in zip("ab", roles, blocks, strict=True):
        link = HandLink(CorePool(num_blocks, BLOCK), FakeModel(BLOCK), pool_id=f"pool-{name}",
                        description=description(role))
        links.append(link)
        engines.append(Engine(
            link=link,  # type: ignore[arg-type]
            scheduler=Scheduler(Budget(max_num_seqs=8, max_num_batched_tokens=32), BLOCK),
            finish_rules=FinishRules(frozenset({2}), max_model_len=256, decoder=tokenizer),
            on_lost=lambda seqs: None, async_depth=depth, mover=mover,
        ))
    return Pair(engines[0], engines[1], links[0], links[1], mover, outcomes)


async def run_both(p: Pair, until: Any = None, timeout_s: float = 20.0) -> None:
    """Run both engines' loops (started once, never cancelled mid-step) until `until()`
    holds, and leave them running; or, with no `until`, until neither has work left nor a
    hand-off under way, and stop them there (idle)."""
    if not p.tasks:
        p.tasks = [asyncio.create_task(e.run()) for e in (p.source, p.target)]
    deadline = time.monotonic() + timeout_s
    while not (until() if until is not None else not any(
            e.busy for e in (p.source, p.target))):
        for task in p.tasks:
            if task.done():
                task.result()  # (a loop never ends: show why it did)
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.002)
    if until is None:
        for task in p.tasks:
            task.cancel()
        await asyncio.gather(*p.tasks, return_exceptions=True)
        p.tasks = []


def tokens_of(req: Request) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for delta in drain(req):
        assert delta.error is None, delta.error
        out.setdefault(delta.index, []).extend(delta.token_ids)
        if delta.finish_reason is not None:
            assert delta.finish_reason is FinishReason.LENGTH
    return out


def assert_all_back(p: Pair) -> None:
    assert p.a.pool.all_free() and p.b.pool.all_free()
    assert not p.a.model.held and not p.b.model.held


PROMPTS = [[5] * 3, [6] * 4, [7, 8] * 4 + [9], [10 + i for i in range(13)], [3] * 16]


@pytest.mark.parametrize("depth", [2, 1])
def test_prefill_engine_hands_every_request_to_the_decode_engine(depth: int):
    p = pair(depth=depth)
    reqs = [submit(p.source, f"r{i}", prompt, max_tokens=9) for i, prompt in enumerate(PROMPTS)]
    asyncio.run(run_both(p))
    for req in reqs:
        assert tokens_of(req) == {0: p.a.model.reference(req.prompt_token_ids, 9)}
    assert p.outcomes == ["moved"] * len(reqs)
    # Each import names an Execute the target sent, at least as late as every one still out
    # when its blocks were reserved (at depth 1 none is out then: it names none).
    assert len(p.b.imports) == len(reqs)
    for previous, out in p.b.imports:
        assert all(step_id <= previous for step_id in out)
        assert previous == 0 if depth == 1 else previous in (0, *p.b.launched)
    # The prefill executor computed prompts only: no decode row ever, one sample each.
    assert not any(call.decode_request_ids for call in p.a.calls)
    assert sum(s.sample for call in p.a.calls for s in call.seqs) == len(reqs)
    # The decode executor never computed a prompt: one token a row, each request new there
    # once (sampling params, its whole table from index 0, starting past its prompt).
    rows = [s for call in p.b.calls for s in call.seqs]
    assert all(len(s.token_ids) == 1 for s in rows)
    firsts = [s for s in rows if s.sampling is not None]
    assert sorted(s.request_id for s in firsts) == sorted(f"r{i}" for i in range(len(reqs)))
    for s in firsts:
        assert s.delta is not None and s.delta.start_index == 0
        assert s.start_position == len(reqs[int(s.request_id[1:])].prompt_token_ids)
    assert_all_back(p)
    # The moved blocks were committed at the target: its cache holds the prompts' full blocks.
    assert p.b.pool.pool.blocks.by_key and p.a.pool.pool.blocks.by_key


def test_a_prefix_already_cached_at_the_target_is_not_moved():
    # The second request shares 8 tokens (2 blocks) with the first, which the target cached
    # when the first moved there: only the rest of its blocks move.
    p = pair()
    first = submit(p.source, "first", [4] * 8 + [5, 6], max_tokens=3)
    imported: list[int] = []
    original = p.b.import_kv

    async def watch(source: HandLink, rid: str, first_index: int, *args: Any) -> Imported:
        imported.append(first_index)
        return await original(source, rid, first_index, *args)

    p.b.import_kv = watch  # type: ignore[method-assign]

    async def scenario() -> Request:
        await run_both(p)
        return submit(p.source, "second", [4] * 8 + [7, 8, 9], max_tokens=3)

    async def both() -> Request:
        second = await scenario()
        await run_both(p)
        return second

    second = asyncio.run(both())
    assert imported == [0, 2]
    for req in (first, second):
        assert tokens_of(req) == {0: p.a.model.reference(req.prompt_token_ids, 3)}
    assert_all_back(p)


def test_n_children_move_one_by_one():
    p = pair()
    req = submit(p.source, "n3", [11, 12, 13, 14, 15, 16], max_tokens=5, n=3)
    asyncio.run(run_both(p))
    reference = p.a.model.reference(req.prompt_token_ids, 5)
    assert tokens_of(req) == {0: reference, 1: reference, 2: reference}
    assert p.outcomes == ["moved"] * 3
    assert_all_back(p)


def test_a_request_that_ends_on_its_first_token_is_not_moved():
    p = pair()
    req = submit(p.source, "one", [5, 6, 7], max_tokens=1)
    asyncio.run(run_both(p))
    assert tokens_of(req) == {0: p.a.model.reference([5, 6, 7], 1)}
    assert p.outcomes == [] and not p.b.calls
    assert_all_back(p)


def test_a_failed_import_leaves_the_request_where_it_is():
    # DATA_LOSS from the import: the reservation is aborted, the request decodes on the
    # prefill executor instead, with the same tokens.
    p = pair()
    p.b.import_error = grpc.StatusCode.DATA_LOSS
    req = submit(p.source, "r", [5] * 6, max_tokens=6)
    asyncio.run(run_both(p))
    assert tokens_of(req) == {0: p.a.model.reference([5] * 6, 6)}
    assert p.outcomes == ["failed"]
    assert any(call.decode_request_ids for call in p.a.calls)
    assert not p.b.calls
    assert_all_back(p)


def test_a_refused_reservation_leaves_the_request_where_it_is():
    # The decode pool (2 blocks of 4 tokens) cannot hold a 13-token request.
    p = pair(blocks=(64, 2))
    req = submit(p.source, "r", [10 + i for i in range(13)], max_tokens=4)
    asyncio.run(run_both(p))
    assert tokens_of(req) == {0: p.a.model.reference(req.prompt_token_ids, 4)}
    assert p.outcomes == ["refused"]
    assert_all_back(p)


def test_a_request_cancelled_during_its_move_is_not_adopted():
    p = pair()
    p.b.import_gate = asyncio.Event()
    req = submit(p.source, "r", [5] * 6, max_tokens=6)

    async def scenario() -> None:
        await run_both(p, until=lambda: p.mover.importing.get("pool-b"))
        # The move waits in its import: cancel, let the source abort it, then let it finish.
        req.cancelled = True
        p.source.cancel()
        assert p.b.import_gate is not None
        await run_both(p, until=lambda: not p.a.pool.pool.requests)
        p.b.import_gate.set()
        await run_both(p)

    asyncio.run(scenario())
    assert p.outcomes == ["gone"]
    assert_all_back(p)


def test_a_draining_engine_moves_its_running_requests():
    # Two engines that do both: requests start on the first; once it drains (its executor
    # left discovery) they move to the second and finish there with the same tokens.
    p = pair(roles=("both", "both"))
    reqs = [submit(p.source, f"r{i}", prompt, max_tokens=60) for i, prompt in enumerate(PROMPTS)]
    unfinished: list[str] = []

    async def scenario() -> None:
        await run_both(p, until=lambda: len(p.source.scheduler.running) == len(reqs) and all(
            s.output_token_ids for s in p.source.scheduler.running))
        unfinished.extend(s.seq_id for s in p.source.scheduler.running if not s.is_finished)
        p.source.draining = True
        p.source.wakeup.set()
        await run_both(p)

    asyncio.run(scenario())
    for req in reqs:
        assert tokens_of(req) == {0: p.a.model.reference(req.prompt_token_ids, 60)}
    assert len(unfinished) == len(reqs)
    assert p.outcomes == ["moved"] * len(reqs)
    moved = {s.request_id for c in p.b.calls for s in c.seqs if s.sampling is not None}
    assert moved == set(unfinished)
    assert_all_back(p)


def test_rebalancing_moves_the_newest_requests_to_an_idle_engine():
    # Six requests decoding on one engine, none on the other: with a minimum gap of 2 the
    # busy engine gives half the difference away, the newest first.
    p = pair(roles=("both", "both"), rebalance_min_gap=2)
    reqs = [submit(p.source, f"r{i}", [20 + i] * 5, max_tokens=16) for i in range(6)]
    asyncio.run(run_both(p))
    for req in reqs:
        assert tokens_of(req) == {0: p.a.model.reference(req.prompt_token_ids, 16)}
    moved = {s.request_id for c in p.b.calls for s in c.seqs if s.sampling is not None}
    assert moved == {"r5", "r4", "r3"}
    assert p.outcomes == ["moved"] * 3
    assert_all_back(p)


def test_a_reservation_whose_answer_is_lost_is_aborted_at_the_target():
    # The target's allocator applied the reservation but its answer never came (a deadline):
    # the target's engine aborts the id before its next step, and the request runs on where
    # it is; nothing stays held in either pool.
    p = pair()
    reserve = p.b.reserve_hand_off

    async def applied_then_lost(*args: Any) -> HandOffReservation:
        await reserve(*args)
        raise failure(grpc.StatusCode.DEADLINE_EXCEEDED, "no answer in time")

    p.b.reserve_hand_off = applied_then_lost  # type: ignore[method-assign]
    req = submit(p.source, "r", [5] * 6, max_tokens=6)
    asyncio.run(run_both(p))
    assert tokens_of(req) == {0: p.a.model.reference([5] * 6, 6)}
    assert p.outcomes == ["refused"]
    assert_all_back(p)


def test_a_cancel_the_target_applied_before_the_kv_arrived_still_stops_the_move():
    # Router.cancel flags the request and wakes every engine; the target applies (and
    # clears) its flag at once, while the source is in a long step (another request's
    # prefill). When the KV then arrives the move must not go on: the cancelled request
    # would decode at the target, unseen by anyone.
    p = pair()
    p.b.import_gate = asyncio.Event()
    req = submit(p.source, "r", [5] * 6, max_tokens=200)

    async def scenario() -> Request:
        await run_both(p, until=lambda: p.mover.importing.get("pool-b"))
        p.a.compute_gate = asyncio.Event()
        long = submit(p.source, "long", [9] * 7, max_tokens=3)
        # Stuck landing that prefill: stepping, its batch taken out of in_flight to await.
        await run_both(p, until=lambda: p.source.stepping and not p.source.in_flight and any(
            w.request_id == "long" for w in p.a.calls[-1].seqs))
        req.cancelled = True
        p.source.cancel()
        p.target.cancel()
        await run_both(p, until=lambda: not p.target.has_cancellations)
        assert p.source.has_cancellations  # still in its step
        assert p.b.import_gate is not None
        p.b.import_gate.set()
        await run_both(p, until=lambda: p.outcomes)
        p.a.compute_gate.set()
        await run_both(p)
        return long

    long = asyncio.run(scenario())
    assert p.outcomes == ["gone", "moved"]  # r's move, then long's
    assert "r" not in {rid for c in p.b.calls for rid in c.decode_request_ids}
    assert not any(s.request_id == "r" for c in p.b.calls for s in c.seqs)
    assert tokens_of(long) == {0: p.a.model.reference([9] * 7, 3)}
    assert_all_back(p)


def test_a_target_that_starts_leaving_mid_move_adopts_nothing_and_waits_for_it():
    # The target leaves discovery while the KV is on its way: it stays busy (its drain waits)
    # until the move is settled, which undoes the reservation; the request decodes at the
    # source instead, with the same tokens.
    p = pair()
    p.b.import_gate = asyncio.Event()
    req = submit(p.source, "r", [5] * 6, max_tokens=8)

    async def scenario() -> None:
        await run_both(p, until=lambda: p.mover.importing.get("pool-b"))
        p.target.draining = True
        assert p.target.busy  # a drain would wait
        assert p.b.import_gate is not None
        p.b.import_gate.set()
        await run_both(p)

    asyncio.run(scenario())
    assert tokens_of(req) == {0: p.a.model.reference([5] * 6, 8)}
    assert p.outcomes == ["refused"] and not p.target.busy
    assert_all_back(p)


def test_a_source_whose_allocator_forgot_its_parked_request_starts_it_over():
    # The source's lease is renewed (its allocator restarted: a fresh pool) while its only
    # sequence is parked and its KV on the way. The idle source still takes the renewal as a
    # step (eviction, readmission), so the old move finds the sequence parked afresh and is
    # dropped. The sequence, computed again, parks again; its second reservation meets the
    # first (not yet aborted: ALREADY_EXISTS), so it decodes at the source, with the same
    # tokens, and nothing stays held anywhere.
    p = pair()
    p.b.import_gate = asyncio.Event()
    req = submit(p.source, "r", [5] * 6, max_tokens=8)

    async def scenario() -> None:
        await run_both(p, until=lambda: p.mover.importing.get("pool-b"))
        p.a.pool = CorePool(64, BLOCK)  # the allocator forgot everything
        p.a.renewals, p.a.lease_renewed = 1, True
        p.source.wakeup.set()
        await run_both(p, until=lambda: p.outcomes == ["refused"])
        assert p.b.import_gate is not None
        p.b.import_gate.set()
        await run_both(p)

    asyncio.run(scenario())
    assert tokens_of(req) == {0: p.a.model.reference([5] * 6, 8)}
    assert p.outcomes == ["refused", "gone"]
    assert_all_back(p)


def test_an_import_names_the_execute_the_target_still_has_out():
    # The target is decoding (each Execute takes a few ms) when later requests' blocks are
    # reserved there: each import names the target's newest Execute, so the executor writes
    # the moved KV after every Execute sent before the reservation (which may still write
    # blocks the reservation took: freed by the Step before it).
    p = pair()
    compute = p.b.compute

    async def slow(call: ExecuteCall) -> ExecuteResult:
        await asyncio.sleep(0.005)
        return await compute(call)

    p.b.compute = slow  # type: ignore[method-assign]
    first = submit(p.source, "first", [5] * 6, max_tokens=40)

    async def scenario() -> list[Request]:
        await run_both(p, until=lambda: p.target.in_flight)
        later = [submit(p.source, f"later{i}", [6 + i] * 5, max_tokens=6) for i in range(3)]
        await run_both(p)
        return later

    later = asyncio.run(scenario())
    for req in (first, *later):
        assert tokens_of(req) == {0: p.a.model.reference(req.prompt_token_ids,
                                                         req.sampling.max_tokens)}
    assert any(out for _, out in p.b.imports), "no import met an Execute out: nothing tested"
    for previous, out in p.b.imports:
        assert all(step_id <= previous for step_id in out)
    assert_all_back(p)
