"""Beam search through the engine (gateway/engine/beams.py) on the real allocator core and a
fake executor whose log-probabilities depend on every token read back through the block
table: forks share blocks, the partial last block is copied on write, pruned beams are freed,
and the hypotheses equal the same search run directly over whole token lists."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass

import grpc
import pytest
from in_process import CorePool, FakeModel
from test_engine import BLOCK, drain, engine, run_until_idle
from test_engine import tokenizer as tokenizer  # the module-scoped fixture

from bench.beam_search import SearchSteps, tally
from common.errors import Unavailable
from common.step_records import StepCall
from gateway.api.sampling import SamplingOptions
from gateway.clients.call_failures import failure
from gateway.core.beam_search import BeamConfig, BeamSearch, EarlyStopping
from gateway.core.request_state import FinishReason, Request
from gateway.core.step import ExecuteCall, ExecuteResult, Sampled, StepOutcome
from gateway.engine.loop import Engine
from gateway.engine.router import initial_sequences
from gateway.text.tokenizer import Tokenizer

EOS = 2
TOP = 20  # top logprobs the fake executor returns for every row


@dataclass(slots=True)
class ScoringModel(FakeModel):
    """FakeModel whose rows also report their most likely next tokens (as the executor's
    top_logprobs): a function of every token read back through the block table."""

    def logprobs(self, tokens: list[int]) -> list[tuple[int, float]]:
        acc = 7
        for t in tokens:
            acc = (acc * 31 + t) % 1_000_003
        scores = [(t, -((acc * 131 + t * 7919) % 10007) / 997.0) for t in range(self.vocab_size)]
        return sorted(scores, key=lambda s: (-s[1], s[0]))[:TOP]

    def execute(self, call: ExecuteCall) -> ExecuteResult:
        result = FakeModel.execute(self, call)
        tops = [tuple(self.logprobs(self._read(self.held[rid])))
                for rid in call.decode_request_ids]
        tokens = tuple(
            Sampled(s.request_id, s.token_id, 0.0, tuple(self.logprobs(self._read(
                self.held[s.request_id]))))
            for s in result.tokens)
        return ExecuteResult(tokens=tokens, compute_ms=0.0,
                             decode_token_ids=result.decode_token_ids,
                             decode_logprobs=(0.0,) * len(tops), decode_top_logprobs=tuple(tops))


def beam_engine(tokenizer: Tokenizer, num_blocks: int, depth: int, tokens: int = 16,
                max_num_seqs: int = 8) -> tuple[Engine, ScoringModel]:
    eng, link = engine(tokenizer, num_blocks=num_blocks, tokens=tokens, depth=depth)
    model = ScoringModel(BLOCK)
    link.model = model
    eng.scheduler.budget = type(eng.scheduler.budget)(max_num_seqs, tokens)
    return eng, model


def beam_config(width: int, n: int, max_tokens: int, length_penalty: float = 1.0,
                early: EarlyStopping = EarlyStopping.HEURISTIC) -> BeamConfig:
    return BeamConfig(width, n, max_tokens, frozenset({EOS}), length_penalty, early)


def submit_beams(eng: Engine, rid: str, prompt: list[int], config: BeamConfig) -> Request:
    req = Request(request_id=rid, prompt_token_ids=prompt, cache_salt="",
                  sampling=SamplingOptions(max_tokens=config.max_tokens, n=config.num_return,
                                           beam=config))
    for seq in initial_sequences(req):
        eng.submit(seq)
    return req


def reference(model: ScoringModel, prompt: list[int], config: BeamConfig
              ) -> list[tuple[int, ...]]:
    """The same search over whole token lists: no blocks, no engine."""
    search = BeamSearch.start(config, 0)
    names = itertools.count(1)
    while not search.done:
        search.select([model.logprobs(prompt + b.token_ids) for b in search.running],
                      lambda parent: next(names))
    return [h.token_ids for h in search.results()]


def completions(req: Request) -> dict[int, tuple[int, ...]]:
    deltas = drain(req)
    assert all(d.error is None for d in deltas), deltas
    assert all(d.finish_reason is not None and d.usage is not None for d in deltas)
    assert sorted(d.index for d in deltas) == list(range(req.sampling.n))
    for d in deltas:
        stopped = d.token_ids[-1] == EOS
        assert d.finish_reason is (FinishReason.STOP if stopped else FinishReason.LENGTH)
        assert d.usage is not None and d.usage.completion_tokens == len(d.token_ids)
    return {d.index: d.token_ids for d in deltas}


@pytest.mark.parametrize("depth", [2, 1])
@pytest.mark.parametrize(("width", "n", "length_penalty", "early"), [
    (2, 2, 1.0, EarlyStopping.HEURISTIC),
    (3, 2, 2.0, EarlyStopping.NEVER),
    (4, 3, 0.5, EarlyStopping.WHEN_FULL),
])
def test_beam_search_through_the_engine_equals_the_direct_search(
    tokenizer: Tokenizer, depth: int, width: int, n: int, length_penalty: float,
    early: EarlyStopping,
):
    # Two searches (prompts of 6 and 9 tokens: partial last blocks) beside a plain request,
    # on a pool that holds them: the same hypotheses as the direct search, in order; every
    # block back, nothing held at the executor.
    eng, model = beam_engine(tokenizer, num_blocks=64, depth=depth)
    configs = [beam_config(width, n, 12, length_penalty, early) for _ in range(2)]
    prompts = [[5, 9, 11, 3, 4, 6], [8] * 9]
    reqs = [submit_beams(eng, f"b{i}", p, c)
            for i, (p, c) in enumerate(zip(prompts, configs, strict=True))]
    plain = Request(request_id="plain", prompt_token_ids=[4] * 7, cache_salt="",
                    sampling=SamplingOptions(max_tokens=10, ignore_eos=True))
    for seq in initial_sequences(plain):
        eng.submit(seq)
    asyncio.run(run_until_idle(eng))
    for req, prompt, config in zip(reqs, prompts, configs, strict=True):
        expected = reference(model, prompt, config)
        assert completions(req) == dict(enumerate(expected))
    assert [t for d in drain(plain) for t in d.token_ids] == model.reference([4] * 7, 10)
    assert eng.link.pool.all_free() and not model.held  # type: ignore[attr-defined]
    assert eng.link.pool.pool.num_cow_copies > 0  # type: ignore[attr-defined]


@pytest.mark.parametrize("depth", [2, 1])
def test_a_lone_search_holds_per_step_what_the_beam_benchmark_counts(
    tokenizer: Tokenizer, depth: int
):
    # Width 3, a 6-token prompt, 10 steps, alone in the pool: after each of its Steps the
    # pool's blocks in use are the distinct blocks of its beams' tables, and the Step's rows
    # times the blocks of prompt + (k - 1) tokens are their tables' lengths summed: the two
    # counts bench/beam_search.py reads from the allocator's recording. Sharing saves blocks.
    eng, model = beam_engine(tokenizer, num_blocks=64, depth=depth)
    link = eng.link
    pool = link.pool.pool  # type: ignore[attr-defined]
    rows: list[int] = []
    used: list[int] = []
    distinct: list[int] = []
    lengths: list[int] = []
    original = link.step

    async def step(call: StepCall) -> StepOutcome:
        outcome = await original(call)
        tables = [r.blocks for r in pool.requests.values()]
        rows.append(len(call.decode_request_ids) + len(call.items))
        used.append(pool.config.num_blocks - pool.blocks.num_free)
        distinct.append(len({b.block_id for t in tables for b in t}))
        lengths.append(sum(len(t) for t in tables))
        return outcome

    link.step = step  # type: ignore[method-assign]
    prompt = [5, 9, 11, 3, 4, 6]
    config = BeamConfig(3, 1, 10, frozenset())  # no stop token: all 10 steps
    req = submit_beams(eng, "lone", prompt, config)
    asyncio.run(run_until_idle(eng))
    assert completions(req) == dict(enumerate(reference(model, prompt, config)))
    steps = SearchSteps(len(prompt), tuple(rows), tuple(used))
    assert list(steps.used) == distinct and steps.unshared(BLOCK) == lengths
    assert tally(steps, BLOCK)["num_steps"] == 10 and rows[0] == 1 and max(rows) == 3
    assert tally(steps, BLOCK)["sum_blocks"] < tally(steps, BLOCK)["sum_blocks_unshared"]
    assert pool.num_cow_copies > 0 and link.pool.all_free()  # type: ignore[attr-defined]


@pytest.mark.parametrize("num_cpu_blocks", [0, 32])
@pytest.mark.parametrize("depth", [2, 1])
def test_beams_preempted_or_split_across_steps_give_the_same_hypotheses(
    tokenizer: Tokenizer, depth: int, num_cpu_blocks: int
):
    # Width 4 with 3 sequences a step, on a pool of 16 blocks shared with two plain
    # requests: beams wait for their siblings across steps and are preempted (recomputed, or
    # swapped out with CPU blocks); the hypotheses do not change, and nothing leaks.
    eng, model = beam_engine(tokenizer, num_blocks=16, depth=depth, max_num_seqs=3)
    if num_cpu_blocks:
        eng.scheduler.swap = True
        eng.link.pool = CorePool(16, BLOCK, num_cpu_blocks=num_cpu_blocks)  # type: ignore
    config = BeamConfig(4, 4, 10, frozenset())  # no EOS: all 10 steps
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    req = submit_beams(eng, "b", prompt, config)
    plains = []
    for i in range(2):
        plain = Request(request_id=f"p{i}", prompt_token_ids=[6 + i] * 12, cache_salt="",
                        sampling=SamplingOptions(max_tokens=16, ignore_eos=True))
        plains.append(plain)
        for seq in initial_sequences(plain):
            eng.submit(seq)
    asyncio.run(run_until_idle(eng))
    assert eng.link.pool.num_preemptions > 0  # type: ignore[attr-defined]
    assert (model.num_swapped_out > 0) == bool(num_cpu_blocks)
    assert completions(req) == dict(enumerate(reference(model, prompt, config)))
    for plain in plains:
        tokens = [t for d in drain(plain) for t in d.token_ids]
        assert tokens == model.reference(plain.prompt_token_ids, 16)
    assert eng.link.pool.all_free() and not model.held  # type: ignore[attr-defined]


@pytest.mark.parametrize("num_cpu_blocks", [0, 32])
@pytest.mark.parametrize("depth", [2, 1])
@pytest.mark.parametrize(("num_blocks", "max_num_seqs", "num_searches"), [
    (16, 8, 4), (16, 3, 4), (17, 8, 4), (18, 8, 3),
])
def test_searches_that_together_overflow_the_pool_all_finish(
    tokenizer: Tokenizer, depth: int, num_cpu_blocks: int, num_blocks: int, max_num_seqs: int,
    num_searches: int,
):
    # Width 4, 2-token prompts (little to share), 14 tokens each: one search alone fits the
    # pool, several do not. A beam pushed out (or not admitted) for room makes its siblings
    # that wait for the selection give their blocks back, so no search holds blocks while
    # waiting for room another holds (before that rule these stalled): all finish, exact.
    eng, model = beam_engine(tokenizer, num_blocks=num_blocks, depth=depth,
                             max_num_seqs=max_num_seqs)
    if num_cpu_blocks:
        eng.scheduler.swap = True
        eng.link.pool = CorePool(num_blocks, BLOCK, num_cpu_blocks=num_cpu_blocks)  # type: ignore
    config = BeamConfig(4, 2, 14, frozenset())
    prompts = [[3 + 7 * i, 50 + i] for i in range(num_searches)]
    reqs = [submit_beams(eng, f"s{i}", p, config) for i, p in enumerate(prompts)]
    asyncio.run(run_until_idle(eng, max_steps=4000))
    assert eng.link.pool.num_preemptions > 0  # type: ignore[attr-defined]
    for req, prompt in zip(reqs, prompts, strict=True):
        assert completions(req) == dict(enumerate(reference(model, prompt, config)))
    assert eng.link.pool.all_free() and not model.held  # type: ignore[attr-defined]


@pytest.mark.parametrize("depth", [2, 1])
def test_a_cancelled_search_frees_every_beam(tokenizer: Tokenizer, depth: int):
    # Cancelled after a few steps (beams forked, some pruned): every beam is aborted at the
    # allocator and released at the executor; nothing is emitted.
    eng, model = beam_engine(tokenizer, num_blocks=64, depth=depth)
    req = submit_beams(eng, "c", [7] * 9, beam_config(3, 1, 40))

    async def scenario() -> None:
        for _ in range(6):
            await eng.step()
        search = req.beam_search
        assert search is not None and len(search.running) == 3
        req.cancelled = True
        eng.cancel()
        await run_until_idle(eng)

    asyncio.run(scenario())
    assert drain(req) == []
    assert eng.link.pool.all_free() and not model.held  # type: ignore[attr-defined]


@pytest.mark.parametrize("depth", [2, 1])
def test_a_refused_fork_fails_the_search_and_leaks_nothing(tokenizer: Tokenizer, depth: int):
    # The allocator refuses the search's first Fork: its stream gets UNAVAILABLE naming it;
    # once the client goes (as the frontend cancels on an error), every block is back.
    eng, model = beam_engine(tokenizer, num_blocks=64, depth=depth)
    link = eng.link

    async def refuse(parent_id: str, child_ids: list[str], request_id: str) -> None:
        raise failure(grpc.StatusCode.FAILED_PRECONDITION, "no")

    link.fork = refuse  # type: ignore[method-assign]
    req = submit_beams(eng, "f", [7] * 9, beam_config(3, 1, 10))
    asyncio.run(run_until_idle(eng))
    errors = [d.error for d in drain(req)]
    assert errors and all(isinstance(e, Unavailable) for e in errors)
    assert "beam fork failed (FAILED_PRECONDITION)" in str(errors[0])
    req.cancelled = True
    eng.cancel()
    asyncio.run(run_until_idle(eng))
    assert link.pool.all_free() and not model.held  # type: ignore[attr-defined]


@pytest.mark.parametrize("depth", [2, 1])
def test_a_lost_beam_fork_leaks_none_of_the_children_it_made(tokenizer: Tokenizer, depth: int):
    # The allocator applies the search's first Fork but the answer is lost: the search fails,
    # and the children the allocator made are aborted as orphans: every block comes back.
    eng, model = beam_engine(tokenizer, num_blocks=64, depth=depth)
    link = eng.link
    fork = link.fork

    async def applied_then_lost(parent_id: str, child_ids: list[str], request_id: str) -> object:
        await fork(parent_id, child_ids, request_id)
        raise failure(grpc.StatusCode.UNAVAILABLE, "cut off")

    link.fork = applied_then_lost  # type: ignore[method-assign]
    req = submit_beams(eng, "f", [7] * 9, beam_config(3, 1, 10))
    asyncio.run(run_until_idle(eng))
    errors = [d.error for d in drain(req)]
    assert errors and "beam fork failed (UNAVAILABLE)" in str(errors[0])
    req.cancelled = True
    eng.cancel()
    asyncio.run(run_until_idle(eng))
    assert link.pool.all_free() and not model.held and not eng.orphans  # type: ignore[attr-defined]
