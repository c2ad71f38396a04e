"""A KV pool far too small for the load: preemption happens many times, outputs do not change,
every block comes back; a request that could never fit is refused up front. Also through four
gateways at once onto the one executor, which merges their calls into shared forwards: chunked
prefills, copy-on-write forks, swap preemptions, beam searches and overlapped steps, every
output transformers' own. (Before the allocator held the blocks a step's swap copies read
until that step was confirmed, another gateway's step could overwrite them first: one run in
three diverged.)"""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from e2e_stack import (
    Clients,
    beam_request,
    generate,
    generate_many,
    prompts,
    reference_beams,
    reference_constrained_greedy,
    reference_greedy,
    reference_prompt_logprobs,
    sampling,
    start_stack,
)

from common.structured_output import StructuredOutput, to_oneof
from pagedkv.gateway.v1 import gateway_pb2 as gpb
from pagedkv.gateway.v1 import gateway_pb2_grpc as gpb_grpc
from tools.launch import Stack

NUM_BLOCKS = 16  # 256 tokens for 8 concurrent requests of 40 + 48 tokens (704)
# The fourth gateway preempts by recompute and sends one step at a time.
RECOMPUTE_AT_DEPTH_1 = ("--preemption-mode", "recompute", "--async-depth", "1")


# One stack, in swap mode at the default depth (2): swaps cross all three services (the
# allocator's plans, the executor's copies); its fourth gateway recomputes at depth 1. Its
# allocator chooses victims by cost, so swaps and recomputes mix in the swap-mode gateways.
# Recompute and depth 1 are also tested in process against the real allocator core
# (tests/gateway/test_scheduler.py, test_engine.py, test_engine_pipeline.py) and through
# every restart in tests/e2e/test_restart.py (readmission is recompute).
Gateways = tuple[Clients, list[gpb_grpc.GatewayServiceStub], Stack]


@pytest.fixture(scope="module")
def gateways(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateways]:
    """One executor, four gateways (the first is `clients.gateway`)."""
    log_dir: Path = tmp_path_factory.mktemp("stack-swap")
    stack = start_stack(
        log_dir,
        executor_args=("--load-format", "dummy", "--num-blocks", str(NUM_BLOCKS)),
        gateway_args=("--preemption-mode", "swap", "--max-num-batched-tokens", "64"),
        # Victims by cost: swapped or recomputed, each as it costs less (the tail policy,
        # the default, runs in every other stack and in process, tests/gateway).
        allocator_args=("--preemption-policy", "cost"),
    )
    clients = Clients(stack)
    channels = []
    try:
        with ThreadPoolExecutor(3) as pool:  # (as bench.fleet starts its gateways)
            started = list(pool.map(stack.start_gateway, ["gateway-2", "gateway-3",
                                                          "gateway-4"], [0] * 3,
                                    [(), (), RECOMPUTE_AT_DEPTH_1]))
        channels = [grpc.insecure_channel(service.address) for service in started]
        yield clients, [clients.gateway, *map(gpb_grpc.GatewayServiceStub, channels)], stack
    finally:
        for channel in channels:
            channel.close()
        clients.close()
        stack.stop()


@pytest.fixture(scope="module")
def clients(gateways: Gateways) -> Clients:
    return gateways[0]


def test_preemption_keeps_greedy_outputs_and_returns_blocks(clients: Clients):
    # 8 concurrent clients on 16 blocks: many preemptions, outputs equal transformers'. Half
    # ask for their prompt's logprobs, which come once, whole and exact, however their
    # prefills are chunked, swapped and recomputed.
    before = clients.pools()[0].num_preemptions
    batch = [list(p) for p in prompts(8, 40, seed=31)]
    requests = [gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=p), sampling=sampling(
        48, **({"prompt_logprobs": 0} if i % 2 else {}))) for i, p in enumerate(batch)]
    results = generate_many(clients.gateway, requests)
    for i, (prompt, result) in enumerate(zip(batch, results, strict=True)):
        assert tuple(result[0].token_ids) == reference_greedy(tuple(prompt), 48)
        got = [e.logprob for e in result[0].prompt_logprobs]
        assert got == pytest.approx(reference_prompt_logprobs(prompt) if i % 2 else [],
                                    abs=1e-4)
    pools = clients.wait_all_blocks_back()
    num_preemptions = pools[0].num_preemptions - before
    print(f"preemptions: {num_preemptions}")
    # How many depends on how the eight arrive (as few as 4 seen): each needs 6 of the 16
    # blocks to finish, and admission takes a request whose prompt fits, so more start than
    # can finish together.
    assert num_preemptions >= 2
    assert pools[0].num_free_blocks == NUM_BLOCKS


def test_preemption_of_forked_children_keeps_greedy_outputs(clients: Clients):
    # n=4 greedy children of two requests fight for 16 blocks: forks, copy-on-write and
    # preemptions; every child still equals the reference.
    batch = [list(p) for p in prompts(2, 40, seed=71)]
    requests = [gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=p),
                                    sampling=sampling(24, n=4, ignore_eos=True)) for p in batch]
    results = generate_many(clients.gateway, requests)
    for prompt, result in zip(batch, results, strict=True):
        expected = reference_greedy(tuple(prompt), 24, ignore_eos=True)
        assert [tuple(result[i].token_ids) for i in range(4)] == [expected] * 4
    clients.wait_all_blocks_back()


def test_request_that_never_fits_the_pool_is_resource_exhausted(clients: Clients):
    # 300 prompt + 200 completion tokens need 32 blocks; the pool has 16.
    with pytest.raises(grpc.RpcError) as err:
        clients.gateway.Complete(gpb.CompleteRequest(
            token_ids=gpb.TokenIds(ids=[1] * 300), sampling=sampling(200)), timeout=10)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_tokens" in (err.value.details() or "")


def _metric(stack: Stack, service: str, name: str) -> float:
    """One counter or histogram series of a service, summed over its labels."""
    ports = stack.by_name(service).http_ports
    port = ports.get("--metrics-port") or ports["--http-port"]  # a gateway's is its HTTP API
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    found = re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
    assert found, f"{service} exports no {name}"
    return sum(float(v) for v in found)


def test_four_gateways_on_one_executor_give_the_reference_tokens(
    gateways: Gateways,
):
    # Eight requests through four gateways at once: prompts of 40 and 65 tokens (prefills
    # chunked at 64 tokens a step), two of them n=2 (forks: copy-on-write copies), on the 16
    # blocks (swap preemptions). Every output equals the reference; the executor ran forwards
    # that merged several gateways' calls; every block comes back.
    clients, stubs, stack = gateways
    calls_before = _metric(stack, "executor-0", "pagedkv_executor_batch_calls_sum")
    forwards_before = _metric(stack, "executor-0", "pagedkv_executor_batch_calls_count")
    batch = [list(p) for i in range(2) for p in prompts(4, 40 + 25 * i, seed=801 + i)]
    jobs = [(stubs[i % 4], gpb.GenerateRequest(
        token_ids=gpb.TokenIds(ids=prompt), request_id=f"four-{i}",
        sampling=sampling(32, n=2 if i in (1, 6) else 1, ignore_eos=True)), prompt)
        for i, prompt in enumerate(batch)]
    before = clients.pools()[0].num_preemptions
    swaps_before = _metric(stack, "allocator", "pagedkv_allocator_swap_outs_total")
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda job: generate(job[0], job[1]), jobs))
    for (_, request, prompt), done in zip(jobs, results, strict=True):
        expected = reference_greedy(tuple(prompt), 32, ignore_eos=True)
        assert [tuple(done[i].token_ids) for i in range(request.sampling.n or 1)] == [
            expected] * (request.sampling.n or 1), request.request_id
    pools = clients.wait_all_blocks_back()
    assert pools[0].num_preemptions > before, "the pool was meant to be too small"
    assert _metric(stack, "allocator", "pagedkv_allocator_swap_outs_total") > swaps_before
    # GetStats counts the same swaps as the metrics, and some came back in.
    assert pools[0].num_swap_outs == _metric(stack, "allocator",
                                              "pagedkv_allocator_swap_outs_total")
    assert pools[0].num_swapped_out_blocks == _metric(
        stack, "allocator", "pagedkv_allocator_swapped_out_blocks_total")
    assert 0 < pools[0].num_swap_ins <= pools[0].num_swap_outs
    calls = _metric(stack, "executor-0", "pagedkv_executor_batch_calls_sum") - calls_before
    forwards = _metric(stack, "executor-0", "pagedkv_executor_batch_calls_count") - forwards_before
    assert calls > forwards, "no forward merged two gateways' calls"


def test_beam_searches_through_four_gateways_equal_transformers(
    gateways: Gateways,
):
    # Beam searches (forks and frees every step) through the four gateways at once, beside
    # greedy requests: each hypothesis equals transformers' generate(num_beams=k).
    clients, stubs, _ = gateways
    cases = [(2, 2, 1.0, False), (3, 1, 0.5, True), (2, 1, 1.5, "never"), (3, 2, 0.0, False)]
    jobs = [(stubs[i], beam_request(prompt, w, n, 12, lp, e), prompt, (w, n, lp, e))
            for i, ((w, n, lp, e), prompt) in enumerate(
                zip(cases, prompts(4, 13, seed=811), strict=True))]
    greedy = [(stubs[i % 4], gpb.GenerateRequest(
        token_ids=gpb.TokenIds(ids=p), sampling=sampling(20, ignore_eos=True)), p, None)
        for i, p in enumerate(prompts(4, 30, seed=812))]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda job: generate(job[0], job[1]), [*jobs, *greedy]))
    for (_, _, prompt, case), done in zip([*jobs, *greedy], results, strict=True):
        if case is None:
            assert tuple(done[0].token_ids) == reference_greedy(tuple(prompt), 20,
                                                                ignore_eos=True)
            continue
        width, n, penalty, early = case
        expected = reference_beams(prompt, width, n, 12, penalty, early)
        assert [tuple(done[i].token_ids) for i in range(n)] == expected, case
    clients.wait_all_blocks_back()


def test_constrained_outputs_survive_swaps_recomputes_and_both_depths(gateways: Gateways):
    # Structured output under the same pressure, through the four gateways (swap at depth 2,
    # the fourth recompute at depth 1): each output equals the reference's greedy choice
    # under the constraint, however often its request was swapped or recomputed (its
    # generated tokens replayed into the constraint).
    clients, stubs, stack = gateways
    schema = json.dumps({"type": "array", "items": {"type": "integer", "minimum": 0,
                                                    "maximum": 9999},
                         "minItems": 24, "maxItems": 30,
                         "x-guidance": {"whitespace_flexible": False,
                                        "whitespace_pattern": None}})
    constraints = [StructuredOutput("regex", "[a-z0-9 ]{80,90}"),
                   StructuredOutput("json_schema", schema)]
    batch = [list(p) for p in prompts(8, 40, seed=77)]
    # Most through the recomputing gateway, so that it surely runs out of blocks (every
    # output runs to max_tokens: the constraints ask for more).
    jobs = [(stubs[i // 4] if i % 4 == 0 else stubs[3], prompt, constraints[i % 2])
            for i, prompt in enumerate(batch)]
    recomputes_before = _metric(stack, "gateway-4", "vllm:num_preemptions_total")
    before = clients.pools()[0].num_preemptions

    def run(job: tuple[gpb_grpc.GatewayServiceStub, list[int], StructuredOutput]
            ) -> dict[int, Any]:
        stub, prompt, constraint = job
        message = gpb.StructuredOutput()
        to_oneof(constraint, message)
        return generate(stub, gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=prompt),
                                                  sampling=sampling(48, structured_output=message)))

    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(run, jobs))
    for (_, prompt, constraint), done in zip(jobs, results, strict=True):
        assert tuple(done[0].token_ids) == reference_constrained_greedy(prompt, constraint, 48)
    assert clients.pools()[0].num_preemptions > before, "the pool was meant to be too small"
    recomputes = _metric(stack, "gateway-4", "vllm:num_preemptions_total") - recomputes_before
    print(f"recompute preemptions: {recomputes}")
    assert recomputes > 0
    clients.wait_all_blocks_back()

