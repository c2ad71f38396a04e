"""Tenant quotas count sequences, not requests: a request counts its n (its beam width with
beam search), at the door (api/frontend.py, --tenant-max-requests) and in each executor's
scheduler (core/scheduler.py, --tenant-max-running)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import cast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from in_process import CorePool, FakeModel
from test_scheduler import BLOCK, add, drive

from common.errors import InvalidArgument, ResourceExhausted
from gateway.api.frontend import Frontend, ModelInfo, PromptInput
from gateway.api.sampling import ModelLimits, RawSampling, SamplingOptions
from gateway.core.batch import Budget
from gateway.core.request_state import Request
from gateway.core.scheduler import Scheduler
from gateway.core.tenants import TenantGate
from gateway.engine.host import EngineHost
from gateway.text.tokenizer import Tokenizer
from tests.budget import examples

QUOTA = 8


@dataclass(slots=True)
class Pool:
    pool_id: str = "pool-0"


@dataclass(slots=True)
class FakeHost:
    """Takes every request; cancelling is a no-op (the engines are not under test here)."""

    queued: list[Request] = field(default_factory=list)

    async def submit(self, request: Request) -> Pool:
        self.queued.append(request)
        return Pool()

    def cancel(self, request: Request) -> None:
        pass


def _frontend(host: FakeHost) -> Frontend:
    return Frontend(
        tokenizer=cast(Tokenizer, None),  # token ids only: nothing is tokenized
        limits=ModelLimits(max_model_len=64, vocab_size=100, max_n=16,
                           pool_capacity_tokens=1 << 16, max_beam_width=10),
        engines=cast(EngineHost, host),
        info=ModelInfo("tiny", 64, 100, (2,)),
        max_seqs_per_tenant=QUOTA,
    )


def _raw(width: int, beam: bool) -> RawSampling:
    if beam:
        return RawSampling(max_tokens=4, temperature=0.0, use_beam_search=True, n=1,
                           beam_width=width)
    return RawSampling(max_tokens=4, n=width)


OPS = st.lists(st.one_of(
    st.tuples(st.just("submit"), st.sampled_from(["a", "b"]), st.integers(1, 10),
              st.booleans()),
    st.tuples(st.just("finish"), st.integers(0, 20)),
), max_size=40)


@settings(max_examples=examples(200), deadline=None)
@given(ops=OPS)
def test_tenant_quota_counts_sequences_as_the_model_does(ops: list[tuple]) -> None:
    # A model of the quota: each tenant's in-flight sequences, each request counting n or
    # its beam width. A request is admitted exactly when it fits what the tenant has left;
    # one wider than the whole quota is INVALID_ARGUMENT (waiting cannot help), one that
    # merely does not fit now RESOURCE_EXHAUSTED; finishing gives its sequences back.
    host = FakeHost()
    frontend = _frontend(host)
    in_flight: list[tuple[Request, int]] = []
    model = {"a": 0, "b": 0}

    async def scenario() -> None:
        for op in ops:
            if op[0] == "finish":
                if in_flight:
                    request, width = in_flight.pop(op[1] % len(in_flight))
                    frontend.abandon(request)
                    model[request.tenant] -= width
                continue
            _, tenant, width, beam = op
            submit = frontend.submit(PromptInput(token_ids=[5, 6, 7]), _raw(width, beam), "",
                                     "", tenant=tenant)
            if width > QUOTA:
                with pytest.raises(InvalidArgument, match=(
                        rf"runs {width} sequences .* at most {QUOTA} in flight at once "
                        rf"\(--tenant-max-requests {QUOTA}\)")):
                    await submit
            elif model[tenant] + width > QUOTA:
                with pytest.raises(ResourceExhausted, match=(
                        rf"has {model[tenant]} sequences in flight and this request needs "
                        rf"{width} more")):
                    await submit
            else:
                request = await submit
                assert request.num_seqs == width
                in_flight.append((request, width))
                model[tenant] += width
            assert {t: frontend.tenant_seqs[t] for t in model} == model

    asyncio.run(scenario())


def _tenant_request(rid: str, n: int, prompt_len: int = 6) -> Request:
    """A tenant's request (the tenant is the id's first letter); a one-token prompt starts
    as n plain sequences, a longer one as a prefill parent that the engine forks."""
    req = Request(request_id=rid, prompt_token_ids=[ord(rid[0]), ord(rid[1]), 5, 6, 7, 8][
                      :prompt_len],
                  sampling=SamplingOptions(max_tokens=6, n=n, ignore_eos=True), cache_salt="")
    req.tenant = rid[0]
    return req


def test_scheduler_tenant_running_quota_counts_each_requests_n() -> None:
    # Quota 8 sequences a tenant on this executor: a's first request (n=8) fills it, so a's
    # second (n=8) is passed over and b's (n=1), behind it, is admitted in the same step:
    # counting requests, a would have run 16 sequences before b got in.
    sched = Scheduler(budget=Budget(max_num_seqs=32, max_num_batched_tokens=256),
                      block_size=BLOCK, tenants=TenantGate(QUOTA))
    for rid, n in (("a1", 8), ("a2", 8), ("b1", 1)):
        add(sched, _tenant_request(rid, n))
    plan = sched.schedule()
    assert plan is not None
    assert [i.request_id.split("-")[0] for i in plan.call.items if i.is_new] == ["a1", "b1"]


def test_scheduler_two_tenants_run_to_completion_within_their_quotas() -> None:
    # Two tenants with n=4 and n=3 requests on one pool (one-token prompts: n sequences
    # each from the start): no step runs more than QUOTA of a tenant's sequences, a request
    # wider than that still runs (alone), and all finish.
    sched = Scheduler(budget=Budget(max_num_seqs=32, max_num_batched_tokens=256),
                      block_size=BLOCK, tenants=TenantGate(QUOTA))
    pool, model = CorePool(256, BLOCK), FakeModel(BLOCK)
    requests = [_tenant_request(rid, n, prompt_len=1) for rid, n in
                (("a1", 4), ("a2", 4), ("a3", 4), ("b1", 3), ("b2", 3), ("b3", 3), ("c1", 10))]
    for req in requests:
        add(sched, req)
    most: dict[str, int] = {}

    def observe(token: int) -> bool:  # called as each sampled token lands
        for tenant in ("a", "b", "c"):
            live = [s for s in (*sched.running, *sched.swapped)
                    if s.request.tenant == tenant and not s.is_finished]
            most[tenant] = max(most.get(tenant, 0), len(live))
        return False

    drive(sched, pool, model, stops=observe)
    assert sched.num_unfinished == 0
    assert most["a"] <= QUOTA and most["b"] <= QUOTA
    assert most["c"] == 10  # wider than the quota: it ran alone
    assert pool.all_free()
