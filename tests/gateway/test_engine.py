"""The engine's step loop against the real allocator core and a fake executor (in_process)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
import structlog
from in_process import CorePool, FakeModel

from common.errors import Unavailable
from common.step_records import Commit, StepCall
from gateway.api.sampling import SamplingOptions
from gateway.clients.call_failures import CallFailed, failure
from gateway.core.batch import Budget
from gateway.core.drafts import NgramDrafts
from gateway.core.finish_rules import FinishRules
from gateway.core.request_state import CompletionDelta, FinishReason, Request
from gateway.core.scheduler import Scheduler
from gateway.core.step import ExecuteCall, ExecuteResult, StepOutcome, TableDelta
from gateway.engine import recovery
from gateway.engine.loop import Engine
from gateway.engine.recovery import Recovery
from gateway.engine.router import initial_sequences
from gateway.metrics import EngineCollector, snapshot
from gateway.text.detokenizer import Detokenizer
from gateway.text.tokenizer import Tokenizer

BLOCK = 4


@dataclass
class FakeLink:
    pool: CorePool
    model: FakeModel
    pool_id: str = "pool-0"
    num_steps: int = 0
    released: list[str] = field(default_factory=list)
    # A gateway bug, once: "before_step", "after_step" (applied) or "before_execute",
    # at the first call `crash_when` accepts.
    crash_at: str = ""
    crash_when: Callable[[Any], bool] = lambda call: True
    # What the engine reads of the executor's Describe: FakeModel uses its sampled tokens.
    description: Any = field(
        default_factory=lambda: SimpleNamespace(uses_sampled_tokens=True, role="both",
                                                max_draft_tokens=16))
    executor_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    lease_renewed: bool = False

    def take_lease_renewal(self) -> bool:
        taken, self.renewals = self.renewals > 0, max(self.renewals - 1, 0)
        return taken

    def _maybe_crash(self, where: str, call: Any) -> None:
        if self.crash_at == where and self.crash_when(call):
            self.crash_at = ""
            raise RuntimeError(f"a gateway bug {where.replace('_', ' ')}")

    async def step(self, call: StepCall) -> StepOutcome:
        self.num_steps += 1
        self._maybe_crash("before_step", call)
        outcome = self.pool.step(call)
        self._maybe_crash("after_step", call)
        return outcome

    async def execute(
        self, call: ExecuteCall, step_id: int = 0, previous_step_id: int = 0
    ) -> ExecuteResult:
        self._maybe_crash("before_execute", call)
        # As an executor runs them: one at a time, in the order they arrive.
        async with self.executor_lock:
            return await self.compute(call)

    async def compute(self, call: ExecuteCall) -> ExecuteResult:
        """One Execute (tests replace it to make it slow or fail)."""
        self.released += call.release_request_ids
        return self.model.execute(call)

    async def free(
        self, commits: tuple[Commit, ...], request_ids: tuple[str, ...], commit_through: int
    ) -> int:
        return self.pool.free(commits, request_ids, commit_through)

    async def abort(self, request_ids: tuple[str, ...]) -> int:
        return self.pool.abort(request_ids)

    async def fork(self, parent_id: str, child_ids: list[str], request_id: str) -> list[TableDelta]:
        return self.pool.fork(parent_id, child_ids)

    async def release(self, request_ids: list[str]) -> None:
        self.released += request_ids
        self.model.execute(ExecuteCall(tuple(request_ids), (), (), (), ()))

    epoch: int = 1
    refresh_bug: bool = False  # the next refresh (a reconnect) raises a gateway bug

    num_refreshes: int = 0
    renewals: int = 0  # lease renewals the engine has yet to take

    async def refresh(self, timeout_s: float) -> None:
        self.num_refreshes += 1
        if self.refresh_bug:
            self.refresh_bug = False
            raise RuntimeError("a gateway bug while reconnecting")


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.load("models/tiny-llama")


def engine(
    tokenizer: Tokenizer, num_blocks: int, tokens: int = 16, depth: int = 2,
    drafts: NgramDrafts | None = None, model: FakeModel | None = None,
) -> tuple[Engine, FakeLink]:
    """An engine on the real allocator core and a fake model. `depth` 2 (the default, as in
    the gateway): each step is planned, allocated and sent while the previous batch is in
    flight, which lands in the next step, so a test stepping it by hand runs it in one event
    loop; 1: each batch lands in its own step."""
    link = FakeLink(CorePool(num_blocks, BLOCK), model or FakeModel(BLOCK))
    eng = Engine(
        link=link,  # type: ignore[arg-type]
        scheduler=Scheduler(Budget(max_num_seqs=8, max_num_batched_tokens=tokens), BLOCK,
                            drafts=drafts, max_model_len=256),
        finish_rules=FinishRules(frozenset({2}), max_model_len=256, decoder=tokenizer),
        on_lost=lambda seqs: None,
        async_depth=depth,
    )
    return eng, link


DEPTHS = pytest.mark.parametrize("depth", [2, 1])


def submit(eng: Engine, rid: str, prompt: list[int], max_tokens: int, n: int = 1,
           stop: tuple[str, ...] = (), prompt_logprobs: int | None = None) -> Request:
    req = Request(request_id=rid, prompt_token_ids=prompt, cache_salt="",
                  sampling=SamplingOptions(max_tokens=max_tokens, ignore_eos=True, n=n,
                                           stop=stop, prompt_logprobs=prompt_logprobs))
    for seq in initial_sequences(req):
        eng.submit(seq)
    return req


def drain(req: Request) -> list[CompletionDelta]:
    out = []
    while not req.outputs.empty():
        out.append(req.outputs.get_nowait())
    return out


async def run_until_idle(eng: Engine, max_steps: int = 2000) -> None:
    for _ in range(max_steps):
        if not eng.busy:
            return
        await eng.step()
    raise AssertionError("engine never went idle")


@DEPTHS
def test_engine_streams_reference_tokens_and_frees_everything(
    tokenizer: Tokenizer, depth: int
):
    # 4 requests on 12 blocks of 4 tokens: preemption, then the exact reference outputs,
    # one delta per token, a final LENGTH with usage; all blocks back, nothing held.
    eng, link = engine(tokenizer, num_blocks=12, depth=depth)
    reqs = [submit(eng, f"r{i}", [i + 5] * (6 + i), max_tokens=10) for i in range(4)]
    asyncio.run(run_until_idle(eng))
    assert link.pool.num_preemptions > 0
    for req in reqs:
        deltas = drain(req)
        tokens = [t for d in deltas for t in d.token_ids]
        assert tokens == link.model.reference(req.prompt_token_ids, 10)
        assert deltas[-1].finish_reason is FinishReason.LENGTH
        assert deltas[-1].usage is not None and deltas[-1].usage.completion_tokens == 10
    assert link.pool.all_free() and not link.model.held


@DEPTHS
def test_engine_pool_usage_gauges_read_the_allocators_count(tokenizer: Tokenizer, depth: int):
    # The blocks-used gauges are the pool's own count, as the allocator's latest answer said
    # (every request's blocks, this gateway's or not): mid-run the same as the pool's; once
    # idle (the last Free went out) zero, and the usage fraction with it.
    eng, link = engine(tokenizer, num_blocks=32, depth=depth)
    link.description = SimpleNamespace(uses_sampled_tokens=True, num_blocks=32, role="both")
    assert snapshot(eng).num_blocks_used == 0  # nothing reported yet
    submit(eng, "a", [5] * 9, max_tokens=6)
    submit(eng, "n2", [7] * 6, max_tokens=6, n=2)
    collector = EngineCollector("m")

    async def scenario() -> list[int]:
        seen = []
        for _ in range(4):
            await eng.step()
            pool = link.pool.pool
            seen.append(snapshot(eng).num_blocks_used)
            # (At depth 2 a batch may be in flight: its Step was the latest answer.)
            assert seen[-1] == pool.config.num_blocks - pool.blocks.num_free
        await run_until_idle(eng)
        return seen

    seen = asyncio.run(scenario())
    assert min(seen) > 0
    collector.engines = [snapshot(eng)]
    values = {(m.name, tuple(s.labels.values())): s.value
              for m in collector.collect() for s in m.samples}
    assert values[("vllm:kv_cache_usage_perc", ("m",))] == 0.0
    assert values[("pagedkv_pool_blocks_used", ("m", "pool-0"))] == 0
    assert link.pool.all_free()


@pytest.mark.parametrize("num_cpu_blocks", [0, 16])
@DEPTHS
def test_engine_fork_and_swap_preemption_give_reference_outputs(
    tokenizer: Tokenizer, num_cpu_blocks: int, depth: int
):
    # n=3 next to two plain requests on 8 blocks, swap mode: the children share the prompt
    # (copy-on-write), requests are swapped out (or recomputed without CPU blocks); every
    # completion equals the reference; all blocks back, nothing held.
    eng, link = engine(tokenizer, num_blocks=8, depth=depth)
    eng.scheduler.swap = True
    link.pool = CorePool(8, BLOCK, num_cpu_blocks=num_cpu_blocks)
    reqs = [submit(eng, "n3", [4] * 9, 8, n=3), submit(eng, "a", [6] * 7, 8),
            submit(eng, "b", [8] * 7, 8)]
    asyncio.run(run_until_idle(eng))
    assert link.pool.num_preemptions > 0
    assert (link.model.num_swapped_out > 0) == (num_cpu_blocks > 0)
    for req in reqs:
        deltas = drain(req)
        for index in range(req.sampling.n):
            tokens = [t for d in deltas if d.index == index for t in d.token_ids]
            assert tokens == link.model.reference(req.prompt_token_ids, 8)
    assert link.pool.all_free() and not link.model.held


@pytest.mark.parametrize("num_cpu_blocks", [0, 16])
@DEPTHS
def test_engine_prompt_logprobs_come_whole_once_through_preemption(
    tokenizer: Tokenizer, num_cpu_blocks: int, depth: int
):
    # Requests asking for their prompt's logprobs on 8 blocks, in 5-token chunks, swapped
    # or recomputed, one with n=3, one whose prompt another request has cached: each
    # completion's first delta carries one entry per prompt token, each as the executor
    # computed it, and no other delta carries any.
    eng, link = engine(tokenizer, num_blocks=8, tokens=5, depth=depth)
    eng.scheduler.swap = True
    link.pool = CorePool(8, BLOCK, num_cpu_blocks=num_cpu_blocks)
    cached = submit(eng, "cached", [5] * 12, 1)
    asyncio.run(run_until_idle(eng))
    hit = submit(eng, "hit", [5] * 12 + [9], 6, prompt_logprobs=0)  # computes all 13
    asyncio.run(run_until_idle(eng))
    assert drain(cached)[-1].usage.cached_prompt_tokens == 0
    assert drain(hit)[-1].usage.cached_prompt_tokens == 0
    again = submit(eng, "again", [5] * 12 + [9], 1)  # hits what the one before cached
    asyncio.run(run_until_idle(eng))
    assert drain(again)[-1].usage.cached_prompt_tokens == 12
    hit = submit(eng, "hit-2", [5] * 12 + [9], 6, prompt_logprobs=0)
    reqs = [submit(eng, "n3", [4] * 9, 8, n=3, prompt_logprobs=0),
            submit(eng, "a", [6, 7] * 5, 8, prompt_logprobs=1),
            submit(eng, "b", [8] * 7, 8), hit]
    asyncio.run(run_until_idle(eng))
    assert link.pool.num_preemptions > 0
    for req in reqs:
        deltas = drain(req)
        for index in range(req.sampling.n):
            mine = [d for d in deltas if d.index == index]
            assert [t for d in mine for t in d.token_ids] == link.model.reference(
                req.prompt_token_ids, req.sampling.max_tokens)
            carried = [d.prompt_logprobs for d in mine if d.prompt_logprobs is not None]
            if req.sampling.prompt_logprobs is None:
                assert carried == []
                continue
            assert len(carried) == 1 and mine[0].prompt_logprobs is not None
            first, *rest = carried[0]
            assert first is None
            assert [(e.logprob, e.rank) for e in rest] == link.model.reference_prompt_logprobs(
                req.prompt_token_ids)
            assert [e.token_id for e in rest] == req.prompt_token_ids[1:]
    assert link.pool.all_free() and not link.model.held


def test_engine_fails_a_request_whose_prompt_logprobs_never_come(tokenizer: Tokenizer):
    # An executor that ignores prompt_logprobs (one built before them): the request fails
    # with a message naming the field, instead of a response with holes; nothing is held.
    class WithoutPromptLogprobs(FakeModel):
        def execute(self, call: ExecuteCall) -> ExecuteResult:
            return dataclasses.replace(super().execute(call), prompt_logprobs=())

    eng, link = engine(tokenizer, num_blocks=8)
    link.model = WithoutPromptLogprobs(BLOCK)
    req = submit(eng, "a", [4] * 9, 4, prompt_logprobs=0)
    plain = submit(eng, "b", [6] * 7, 4)
    asyncio.run(run_until_idle(eng))
    (delta,) = drain(req)
    assert delta.error is not None and "SamplingParams.prompt_logprobs" in str(delta.error)
    assert [t for d in drain(plain) for t in d.token_ids] == link.model.reference([6] * 7, 4)
    assert link.pool.all_free() and not link.model.held


@pytest.mark.parametrize("stop_at", [2, 5])
@DEPTHS
def test_engine_finishes_a_completion_at_its_stop_string(
    tokenizer: Tokenizer, depth: int, stop_at: int
):
    # The engine decides stop strings as it decides EOS: each completion of an n=2 request
    # ends at the token that completes its stop string (finish_reason STOP, the detokenizer's
    # own text at that token), while the pool swaps and preempts; it is finished and given
    # back; the other requests run to their reference; nothing leaks.
    eng, link = engine(tokenizer, num_blocks=8, depth=depth)
    eng.scheduler.swap = True
    link.pool = CorePool(8, BLOCK, num_cpu_blocks=16)
    prompt = [4] * 9
    reference = link.model.reference(prompt, 8)
    text = Detokenizer.for_prompt(tokenizer, prompt)
    texts = []
    for token in reference:
        text.add(token)
        texts.append(text.text)
    last = next(k for k in range(stop_at, len(reference)) if texts[k] != texts[k - 1])
    stopped = submit(eng, "n2", prompt, 8, n=2, stop=(texts[last],))
    others = [submit(eng, "a", [6] * 7, 8), submit(eng, "b", [8] * 7, 8)]
    asyncio.run(run_until_idle(eng))
    assert link.pool.num_preemptions > 0
    deltas = drain(stopped)
    for index in (0, 1):
        mine = [d for d in deltas if d.index == index]
        assert [t for d in mine for t in d.token_ids] == reference[: last + 1]
        assert mine[-1].finish_reason is FinishReason.STOP
    for req in others:
        assert [t for d in drain(req) for t in d.token_ids] == link.model.reference(
            req.prompt_token_ids, 8)
    assert link.pool.all_free() and not link.model.held and not eng.busy


@DEPTHS
def test_engine_cancellation_aborts_and_releases(tokenizer: Tokenizer, depth: int):
    # A request cancelled mid-stream: aborted at the allocator, released at the executor.
    eng, link = engine(tokenizer, num_blocks=64, depth=depth)
    req = submit(eng, "c", [7] * 9, max_tokens=100)

    async def scenario() -> None:
        for _ in range(3):
            await eng.step()
        req.cancelled = True
        eng.cancel()
        await run_until_idle(eng)

    asyncio.run(scenario())
    assert link.pool.all_free() and not link.model.held
    assert "c" in link.released


@DEPTHS
def test_engine_preempted_request_is_released_before_readmission(
    tokenizer: Tokenizer, depth: int
):
    # 6 blocks for two 20-token requests, whole prompts per step: the preempted one is
    # released at the executor before it is created again (the fake refuses a second
    # creation), and both outputs equal the reference.
    eng, link = engine(tokenizer, num_blocks=6, tokens=64, depth=depth)
    reqs = [submit(eng, f"p{i}", [3 + i] * 8, max_tokens=12) for i in range(2)]
    asyncio.run(run_until_idle(eng))
    for req in reqs:
        tokens = [t for d in drain(req) for t in d.token_ids]
        assert tokens == link.model.reference(req.prompt_token_ids, 12)
    assert not link.model.held


def test_engine_fails_sequences_of_a_rejected_step(tokenizer: Tokenizer):
    # The executor rejects a step (INVALID_ARGUMENT): that request fails with UNAVAILABLE,
    # its blocks are aborted, the engine keeps serving the next request.
    eng, link = engine(tokenizer, num_blocks=64, depth=1)
    req = submit(eng, "bad", [9] * 5, max_tokens=4)

    original = link.compute

    async def reject(call: ExecuteCall) -> ExecuteResult:
        raise failure(grpc.StatusCode.INVALID_ARGUMENT, "no")

    link.compute = reject  # type: ignore[method-assign]
    asyncio.run(eng.step())
    (delta,) = drain(req)
    assert delta.error is not None and "rejected" in str(delta.error)
    link.compute = original  # type: ignore[method-assign]
    ok = submit(eng, "ok", [9] * 5, max_tokens=4)
    asyncio.run(run_until_idle(eng))
    assert [t for d in drain(ok) for t in d.token_ids] == link.model.reference([9] * 5, 4)
    assert link.pool.all_free()




async def run_loop_until_idle(eng: Engine, timeout_s: float = 10.0) -> None:
    """The engine's own loop (with its error handling) until it has nothing left to do."""
    task = asyncio.get_running_loop().create_task(eng.run())
    try:
        for _ in range(int(timeout_s / 0.01)):
            await asyncio.sleep(0.01)
            if not eng.busy:
                return
        raise AssertionError("engine never went idle")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


CRASHES = {
    # the Step carrying a's free never goes out
    "before_step": lambda call: bool(call.free_request_ids),
    # c is admitted at the allocator, the gateway never learns it
    "after_step": lambda call: (
        bool(call.decode_request_ids)
        and any(i.is_new for i in call.items)
    ),
    # the Execute carrying a's release never goes out
    "before_execute": lambda call: bool(call.release_request_ids),
}


@pytest.mark.parametrize("where", list(CRASHES))
@DEPTHS
def test_engine_bug_mid_step_fails_requests_and_leaks_nothing(
    tokenizer: Tokenizer, where: str, depth: int
):
    # A gateway bug interrupts a step at `where`: the open requests fail with INTERNAL,
    # every block is back at the allocator and the executor holds nothing.
    eng, link = engine(tokenizer, num_blocks=64, depth=depth)
    link.crash_at, link.crash_when = where, CRASHES[where]
    reqs = [submit(eng, "a", [3] * 5, max_tokens=2), submit(eng, "b", [4] * 11, max_tokens=30),
            submit(eng, "c", [5] * 7, max_tokens=30, n=2)]
    with structlog.testing.capture_logs() as logs:
        asyncio.run(run_loop_until_idle(eng))
    assert not link.crash_at, "the bug was never hit"
    assert any(e["event"] == "engine_step_failed" for e in logs)
    for req in reqs[1:]:
        errors = [d.error for d in drain(req) if d.error is not None]
        assert errors and errors[0].code is grpc.StatusCode.INTERNAL
    assert link.pool.all_free() and not link.model.held


@DEPTHS
def test_engine_stops_exactly_at_the_stop_token(tokenizer: Tokenizer, depth: int):
    # The completion ends exactly at the stop token id, reports STOP with its usage, and
    # everything is given back. (Stop strings: test_engine_host.py, through the frontend.)
    prompt = [9] * 6
    eng, link = engine(tokenizer, num_blocks=32, depth=depth)
    reference = link.model.reference(prompt, 24)
    stop_at = next(i for i in range(3, len(reference)) if reference[i] not in reference[:i])
    req = Request(request_id="s", prompt_token_ids=prompt, cache_salt="",
                  sampling=SamplingOptions(max_tokens=24, ignore_eos=True,
                                           stop_token_ids=frozenset({reference[stop_at]})))
    for seq in initial_sequences(req):
        eng.submit(seq)
    asyncio.run(run_until_idle(eng))
    deltas = drain(req)
    assert [t for d in deltas for t in d.token_ids] == reference[: stop_at + 1]
    assert deltas[-1].finish_reason is FinishReason.STOP
    assert deltas[-1].usage is not None and deltas[-1].usage.completion_tokens == stop_at + 1
    assert link.pool.all_free() and not link.model.held


def test_a_bug_while_reconnecting_does_not_end_the_engine_loop(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
):
    # The executor was lost; the first reconnect attempt hits a gateway bug. The loop logs
    # it, tries again, reconnects, and serves the next request with the reference tokens.
    monkeypatch.setattr(recovery, "RECONNECT_INTERVAL_S", 0.01)
    eng, link = engine(tokenizer, num_blocks=64)
    eng.healthy, link.refresh_bug = False, True
    req = submit(eng, "after", [6] * 5, max_tokens=4)
    with structlog.testing.capture_logs() as logs:
        asyncio.run(run_loop_until_idle(eng))
    events = [e["event"] for e in logs]
    assert "engine_reconnect_failed" in events and "executor_reconnected" in events
    assert [t for d in drain(req) for t in d.token_ids] == link.model.reference([6] * 5, 4)
    assert link.pool.all_free()


def test_a_release_the_executor_refuses_waits_for_the_next_execute(tokenizer: Tokenizer):
    # Releases that go out on their own (nothing else to run) are refused. They are logged,
    # not resent on every loop (which kept the engine busy forever), and not dropped: the
    # next Execute carries them, ahead of the same id readmitted (a client reusing its id),
    # so neither that request nor an unrelated one in the same step fails.
    eng, link = engine(tokenizer, num_blocks=64)
    calls: list[list[str]] = []

    async def refuse(request_ids: list[str]) -> None:
        calls.append(list(request_ids))
        raise failure(grpc.StatusCode.INTERNAL, "refused")

    link.release = refuse  # type: ignore[method-assign]
    first = submit(eng, "a", [3] * 5, max_tokens=3)
    with structlog.testing.capture_logs() as logs:
        asyncio.run(run_loop_until_idle(eng))
        assert calls == [["a"]] and "a" in link.model.held  # refused, engine idle anyway
        again = submit(eng, "a", [4] * 6, max_tokens=3)
        other = submit(eng, "b", [5] * 7, max_tokens=3)
        asyncio.run(run_loop_until_idle(eng))
    events = [e["event"] for e in logs]
    assert "engine_step_failed" not in events and "executor_release_refused" in events
    assert "a" in link.released  # carried by the Execute that readmitted "a"
    for req, prompt in ((first, [3] * 5), (again, [4] * 6), (other, [5] * 7)):
        assert [t for d in drain(req) for t in d.token_ids] == link.model.reference(prompt, 3)
    assert link.pool.all_free()


def record_release(link: FakeLink, order: list[str]) -> None:
    """The link's Release notes "release" in `order` as it goes out."""
    release = link.release

    async def recorded(request_ids: list[str]) -> None:
        order.append("release")
        await release(request_ids)

    link.release = recorded  # type: ignore[method-assign]


def assert_served_and_whole(link: FakeLink, req: Request, prompt: list[int],
                            max_tokens: int) -> None:
    """The request got the reference tokens, and nothing is left held anywhere."""
    assert [t for d in drain(req) for t in d.token_ids] == link.model.reference(prompt,
                                                                                 max_tokens)
    assert link.pool.all_free() and not link.model.held


def test_an_idle_engines_free_and_release_go_out_side_by_side(tokenizer: Tokenizer):
    # A finished request's Free (allocator) and Release (executor) have no step to ride on.
    # They go out at once, so a request arriving meanwhile waits for the slower of the two,
    # not their sum: here the Free does not return until the Release has arrived.
    eng, link = engine(tokenizer, num_blocks=64)
    free = link.free
    order: list[str] = []

    async def free_after_release(commits: tuple[Commit, ...], request_ids: tuple[str, ...],
                                 commit_through: int) -> int:
        order.append("free sent")
        for _ in range(100):
            if "release" in order:
                break
            await asyncio.sleep(0.001)
        order.append("free returns")
        return await free(commits, request_ids, commit_through)

    link.free = free_after_release  # type: ignore[method-assign]
    record_release(link, order)
    req = submit(eng, "a", [3] * 5, max_tokens=3)
    asyncio.run(run_until_idle(eng))
    assert order == ["free sent", "release", "free returns"]
    assert_served_and_whole(link, req, [3] * 5, 3)


def test_an_idle_free_the_allocator_refuses_is_sent_again_and_releases_still_go(
        tokenizer: Tokenizer):
    # The idle Free refused once (a transient error): the executor's releases, sent beside
    # it, are not held back by it, and the Free goes out again until the pool is whole.
    eng, link = engine(tokenizer, num_blocks=64)
    free = link.free
    refusals = [failure(grpc.StatusCode.INTERNAL, "try again")]
    order: list[str] = []

    async def refuse_once(commits: tuple[Commit, ...], request_ids: tuple[str, ...],
                          commit_through: int) -> int:
        if refusals:
            order.append("free refused")
            raise refusals.pop()
        order.append("free")
        return await free(commits, request_ids, commit_through)

    link.free = refuse_once  # type: ignore[method-assign]
    record_release(link, order)
    req = submit(eng, "a", [3] * 5, max_tokens=3)
    with structlog.testing.capture_logs() as logs:
        asyncio.run(run_loop_until_idle(eng))
    assert order == ["free refused", "release", "free"]
    assert "allocator_free_failed" in [e["event"] for e in logs]
    assert_served_and_whole(link, req, [3] * 5, 3)


@DEPTHS
def test_engine_streams_each_batchs_outputs_as_it_lands(tokenizer: Tokenizer, depth: int):
    # A landed batch's deltas are in the stream at once: at depth 2 while the next Execute
    # (sent before it landed) computes, at depth 1 before the next one is sent. In order,
    # and exactly the reference.
    eng, link = engine(tokenizer, num_blocks=64, depth=depth)
    req = submit(eng, "o", [5] * 6, max_tokens=4)
    seen_at_start: list[int] = []
    seen_while_running: list[int] = []
    original = link.compute

    async def slow_execute(call: ExecuteCall) -> ExecuteResult:
        seen_at_start.append(req.outputs.qsize())
        await asyncio.sleep(0.05)  # a forward pass
        seen_while_running.append(req.outputs.qsize())
        return await original(call)

    link.compute = slow_execute  # type: ignore[method-assign]
    asyncio.run(run_until_idle(eng))
    # One token per Execute (the prompt fits one step).
    assert seen_at_start == ([0, 0, 1, 2] if depth == 2 else [0, 1, 2, 3])
    assert seen_while_running == [0, 1, 2, 3]
    deltas = drain(req)
    assert [t for d in deltas for t in d.token_ids] == link.model.reference([5] * 6, 4)
    assert deltas[-1].finish_reason is FinishReason.LENGTH


def test_engine_delivers_a_steps_outputs_as_it_returns(tokenizer: Tokenizer):
    eng, link = engine(tokenizer, num_blocks=64, tokens=64, depth=1)
    reqs = [submit(eng, f"q{i}", [5 + i] * 6, max_tokens=4) for i in range(3)]
    asyncio.run(eng.step())
    assert [r.outputs.qsize() for r in reqs] == [1, 1, 1]
    assert not eng.outbox


def test_engine_delivers_outputs_before_any_call_off_the_hot_path(tokenizer: Tokenizer):
    # A Fork, an orphan abort and a lone Release find the step's deltas already in their
    # streams; so does an error reported with Engine.fail.
    eng, link = engine(tokenizer, num_blocks=64, tokens=64, depth=1)
    a = submit(eng, "a", [5] * 6, max_tokens=3)
    submit(eng, "p", [7] * 6, max_tokens=3, n=2)
    queued: dict[str, list[int]] = {"fork": [], "abort": [], "release": []}
    fork, abort, release = link.fork, link.abort, link.release

    async def record_fork(parent_id: str, child_ids: list[str], request_id: str) -> Any:
        queued["fork"].append(a.outputs.qsize())
        return await fork(parent_id, child_ids, request_id)

    async def record_abort(request_ids: tuple[str, ...]) -> None:
        queued["abort"].append(a.outputs.qsize())
        await abort(request_ids)

    async def record_release(request_ids: list[str]) -> None:
        queued["release"].append(a.outputs.qsize())
        await release(request_ids)

    link.fork, link.abort, link.release = (  # type: ignore[method-assign]
        record_fork, record_abort, record_release
    )
    asyncio.run(eng.step())  # both prefills; p's parent forks after a's first delta
    assert queued["fork"] == [1]
    asyncio.run(eng.step())  # a's second delta
    eng.orphans.note(["nobody"])
    asyncio.run(eng.step())
    assert queued["abort"] and set(queued["abort"]) == {2}

    idle, idle_link = engine(tokenizer, num_blocks=64)
    held = Request(request_id="h", prompt_token_ids=[6], cache_salt="",
                   sampling=SamplingOptions(max_tokens=1))
    delta = CompletionDelta(index=0, token_ids=(7,), text="")
    at_release: list[int] = []

    async def lone_release(request_ids: list[str]) -> None:
        at_release.append(held.outputs.qsize())

    idle_link.release = lone_release  # type: ignore[method-assign]
    idle.outbox.append((held, delta))
    idle.scheduler.pending.release_ids.append("gone")
    asyncio.run(idle.step())
    assert at_release == [1]

    failing, _ = engine(tokenizer, num_blocks=64)
    req = submit(failing, "e", [8] * 6, max_tokens=3)
    failing.outbox.append((req, delta))
    failing.fail(failing.scheduler.sequences()[0], Unavailable("gone"))
    first, second = drain(req)
    assert first == delta and second.error is not None
    assert second.error.code is grpc.StatusCode.UNAVAILABLE


@DEPTHS
def test_engine_streams_outputs_before_a_failed_steps_error(
    tokenizer: Tokenizer, depth: int
):
    # The allocator rejects Step k+1 after step k's tokens: they reach the client before
    # the error; nothing leaks.
    eng, link = engine(tokenizer, num_blocks=64, depth=depth)
    req = submit(eng, "f", [9] * 5, max_tokens=8)
    original = link.step

    async def reject_third(call: StepCall) -> StepOutcome:
        if link.num_steps == 2:
            link.num_steps += 1
            raise failure(grpc.StatusCode.INVALID_ARGUMENT, "no")
        return await original(call)

    link.step = reject_third  # type: ignore[method-assign]
    asyncio.run(run_until_idle(eng))
    deltas = drain(req)
    assert [t for d in deltas[:-1] for t in d.token_ids] == link.model.reference([9] * 5, 2)
    assert deltas[-1].error is not None and deltas[-1].error.code is grpc.StatusCode.UNAVAILABLE
    assert link.pool.all_free()


def test_engine_streams_outputs_before_pausing_for_a_lost_allocator(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
):
    # The allocator does not answer Step k+1: step k's tokens reach the client before the
    # engine pauses and retries (they do not wait out the outage).
    eng, link = engine(tokenizer, num_blocks=64, depth=1)
    req = submit(eng, "u", [9] * 5, max_tokens=8)
    original = link.step
    queued_at_pause: list[int] = []
    unreachable = Recovery.allocator_unreachable

    async def pause(self: Recovery, exc: CallFailed) -> None:
        queued_at_pause.append(req.outputs.qsize())
        await unreachable(self, exc)

    async def lost_second(call: StepCall) -> StepOutcome:
        if link.num_steps == 1:
            link.num_steps += 1
            raise failure(grpc.StatusCode.UNAVAILABLE, "gone")
        return await original(call)

    monkeypatch.setattr(Recovery, "allocator_unreachable", pause)
    link.step = lost_second  # type: ignore[method-assign]
    asyncio.run(eng.step())
    asyncio.run(eng.step())
    assert queued_at_pause == [1]


def test_engine_streams_outputs_before_moving_requests_elsewhere(tokenizer: Tokenizer):
    # The executor is lost mid-run: the tokens it computed reach the stream before the
    # requests are handed on (another executor continues after them), whether the loss
    # shows on an Execute or anywhere else (Recovery.lose_executor itself).
    eng, link = engine(tokenizer, num_blocks=64, depth=1)
    req = submit(eng, "m", [6] * 5, max_tokens=8)
    handed_on: list[tuple[int, int]] = []
    eng.on_lost = lambda seqs: handed_on.append((len(seqs), req.outputs.qsize()))
    original = link.compute
    calls = 0

    async def lost_third(call: ExecuteCall) -> ExecuteResult:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise failure(grpc.StatusCode.UNAVAILABLE, "gone")
        return await original(call)

    link.compute = lost_third  # type: ignore[method-assign]
    for _ in range(3):
        asyncio.run(eng.step())
    assert handed_on == [(1, 2)]
    assert [t for d in drain(req) for t in d.token_ids] == link.model.reference([6] * 5, 2)

    eng2, _ = engine(tokenizer, num_blocks=64, depth=1)
    req2 = submit(eng2, "m2", [6] * 5, max_tokens=8)
    asyncio.run(eng2.step())
    eng2.on_lost = lambda seqs: handed_on.append((len(seqs), req2.outputs.qsize()))
    eng2.recovery.lose_executor()
    assert handed_on[-1] == (1, 1)


def test_a_lease_renewed_mid_work_registers_the_pool_again(tokenizer: Tokenizer):
    # The allocator restarted while the engine was busy (an orphan's abort failing, say):
    # the step that takes the new lease registers the pool again at once. Waiting for a
    # Step to find the pool unknown never came: routing leaves out a pool its allocator does
    # not know, so no request went there.
    eng, link = engine(tokenizer, num_blocks=64)
    eng.orphans.note(["gone"])  # work: an abort the allocator never confirmed
    link.renewals = 1

    async def scenario() -> None:
        await eng.step()

    asyncio.run(scenario())
    assert link.num_refreshes == 1 and not eng.orphans


@DEPTHS
def test_a_lost_fork_leaks_none_of_the_children_it_made(tokenizer: Tokenizer, depth: int):
    # The allocator applies an n=2 request's Fork but the answer is lost: the parent fails
    # with UNAVAILABLE, and the children the allocator made, which no sequence tracks, are
    # aborted as orphans before the next Step: every block comes back.
    eng, link = engine(tokenizer, num_blocks=32, depth=depth)
    fork = link.fork

    async def applied_then_lost(parent_id: str, child_ids: list[str], request_id: str) -> Any:
        await fork(parent_id, child_ids, request_id)
        raise failure(grpc.StatusCode.UNAVAILABLE, "cut off")

    link.fork = applied_then_lost  # type: ignore[method-assign]
    req = submit(eng, "n2", [7] * 6, max_tokens=6, n=2)
    asyncio.run(run_until_idle(eng))
    errors = [d.error for d in drain(req) if d.error is not None]
    assert errors and "fork failed (UNAVAILABLE)" in str(errors[0])
    assert link.pool.all_free() and not link.model.held and not eng.orphans


class ShortMemory(FakeModel):
    """Its next token depends on the last two only: outputs fall into cycles that prompt
    lookup drafts, and a draft is accepted exactly when it is that token."""

    def next_token(self, tokens: list[int]) -> int:
        return (tokens[-1] + tokens[-2] + 1) % 7


@pytest.mark.parametrize("num_blocks", [64, 9])  # 9: preemptions too
def test_drafted_outputs_equal_the_reference_and_the_pool_accounts_for_them(
        tokenizer: Tokenizer, num_blocks: int):
    """Speculative decoding through the engine and the real allocator core: the verified
    drafts land with the executor's token, and everything equals decoding without them."""
    drafts = NgramDrafts(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=2)
    eng, link = engine(tokenizer, num_blocks=num_blocks, tokens=24, depth=1, drafts=drafts,
                       model=ShortMemory(BLOCK))
    # [1, 6, 5, 1, 6]: its first draft (5, after 1, 6) is wrong: the model says 1.
    prompts = [[3, 4, 5, 6, 7], [8, 1, 8, 2], [1, 6, 5, 1, 6], [9, 10, 11]]
    reqs = [submit(eng, f"d{i}", p, max_tokens=20 + 3 * i) for i, p in enumerate(prompts)]
    asyncio.run(run_until_idle(eng))
    scheduler = eng.scheduler
    assert scheduler.num_accepted_tokens > 10  # many steps emitted more than one token
    if num_blocks == 64:  # (with preemptions, the step with the wrong draft may differ)
        assert scheduler.num_draft_tokens > scheduler.num_accepted_tokens
    for req, prompt in zip(reqs, prompts, strict=True):
        deltas = drain(req)
        tokens = [t for d in deltas for t in d.token_ids]
        assert tokens == link.model.reference(prompt, req.sampling.max_tokens)
        assert deltas[-1].finish_reason is FinishReason.LENGTH
        assert deltas[-1].usage.completion_tokens == req.sampling.max_tokens
    assert link.pool.all_free() and not link.model.held
    if num_blocks == 9:
        assert link.pool.num_preemptions > 0


def test_a_stop_token_among_accepted_drafts_ends_the_completion_there(tokenizer: Tokenizer):
    drafts = NgramDrafts(num_speculative_tokens=6, prompt_lookup_max=2, prompt_lookup_min=2)
    eng, link = engine(tokenizer, num_blocks=32, tokens=24, depth=1, drafts=drafts,
                       model=ShortMemory(BLOCK))
    # One period of the model's cycle: the output repeats it, drafted from the prompt. Its
    # 5 is first generated inside a run of six accepted drafts, two of them after it.
    prompt = [1, 6, 1, 1, 3, 5, 2, 1, 4, 6, 4, 4, 2, 0, 3, 4]
    reference = link.model.reference(prompt, 40)
    assert reference[:8] == [1, 6, 1, 1, 3, 5, 2, 1]
    req = Request(request_id="s", prompt_token_ids=prompt, cache_salt="",
                  sampling=SamplingOptions(max_tokens=40, ignore_eos=True,
                                           stop_token_ids=frozenset({5})))
    for seq in initial_sequences(req):
        eng.submit(seq)
    asyncio.run(run_until_idle(eng))
    deltas = drain(req)
    assert [t for d in deltas for t in d.token_ids] == [1, 6, 1, 1, 3, 5]
    assert deltas[-1].finish_reason is FinishReason.STOP
    assert deltas[-1].usage.completion_tokens == 6
    assert eng.scheduler.num_accepted_tokens == 6  # 1, 1, 3, 5 emitted; 2, 1 dropped
    assert link.pool.all_free() and not link.model.held


@pytest.mark.parametrize("max_draft_tokens", [2, 0])
def test_drafts_follow_what_the_executor_verifies_as_described_now(
        tokenizer: Tokenizer, max_draft_tokens: int):
    """At most the executor's Describe.max_draft_tokens, read every step (it may have been
    replaced); none while it verifies none. The outputs are the same."""
    drafts = NgramDrafts(num_speculative_tokens=6, prompt_lookup_max=2, prompt_lookup_min=2)
    eng, link = engine(tokenizer, num_blocks=32, tokens=24, depth=1, drafts=drafts,
                       model=ShortMemory(BLOCK))
    link.description.max_draft_tokens = max_draft_tokens
    prompt = [1, 6, 1, 1, 3, 5, 2, 1, 4, 6, 4, 4, 2, 0, 3, 4]  # (the model's cycle)
    req = submit(eng, "m", prompt, max_tokens=30)
    asyncio.run(run_until_idle(eng))
    assert [t for d in drain(req) for t in d.token_ids] == link.model.reference(prompt, 30)
    assert link.model.most_drafts == max_draft_tokens
    assert (eng.scheduler.num_drafts > 0) is (max_draft_tokens > 0)
    assert link.pool.all_free() and not link.model.held


def test_with_drafting_on_only_steps_that_may_draft_give_up_the_overlap(tokenizer: Tokenizer):
    """Drafts build on landed tokens, so a step in which a greedy request may be drafted for
    waits for the batch in flight; requests never drafted for (here: sampled) keep depth 2.
    Outputs equal the reference either way."""
    drafts = NgramDrafts(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=2)
    eng, link = engine(tokenizer, num_blocks=64, tokens=24, depth=2, drafts=drafts,
                       model=ShortMemory(BLOCK))
    launched_ahead: list[bool] = []
    execute = link.execute

    async def counting(call: Any, step_id: int = 0, previous_step_id: int = 0) -> Any:
        launched_ahead.append(bool(previous_step_id))
        await asyncio.sleep(0.002)  # a forward takes time: the next step is planned meanwhile
        return await execute(call, step_id, previous_step_id)

    link.execute = counting  # type: ignore[method-assign]
    prompts = [[3, 4, 5, 6, 7], [8, 1, 8, 2]]

    def sampled(rid: str, prompt: list[int]) -> Request:  # the fake model ignores temperature
        req = Request(request_id=rid, prompt_token_ids=prompt, cache_salt="",
                      sampling=SamplingOptions(max_tokens=20, ignore_eos=True, temperature=0.8,
                                               seed=1))
        for seq in initial_sequences(req):
            eng.submit(seq)
        return req

    reqs = [sampled(f"s{i}", p) for i, p in enumerate(prompts)]
    asyncio.run(run_until_idle(eng))
    assert eng.scheduler.num_drafts == 0 and sum(launched_ahead) >= 5  # overlapped
    greedy = [submit(eng, f"g{i}", p, max_tokens=20) for i, p in enumerate(prompts)]
    launched_ahead.clear()
    recorded = eng.stats.num_steps
    asyncio.run(run_until_idle(eng))
    assert eng.scheduler.num_accepted_tokens > 0 and not any(launched_ahead)  # depth 1
    # Every step's stats are kept, those landed before the next is planned too.
    assert eng.stats.num_steps - recorded == len(launched_ahead)
    for req, prompt in zip(reqs + greedy, prompts * 2, strict=True):
        tokens = [t for d in drain(req) for t in d.token_ids]
        assert tokens == link.model.reference(prompt, 20)
    assert link.pool.all_free() and not link.model.held
