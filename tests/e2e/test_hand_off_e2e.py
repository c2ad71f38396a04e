"""KV hand-off through the whole stack, real subprocesses on loopback: a prefill executor
(--role prefill) computes each prompt and its first token, then the request moves with its KV
to the decode executor (--role decode), which never computes a prompt; and an executor that
leaves discovery hands its running requests to the one that stays. Every output equals
transformers' own greedy generate, and every block comes back in both pools."""

from __future__ import annotations

import re
import threading
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch
from e2e_stack import (
    MODEL,
    Clients,
    generate,
    generate_many,
    http_base,
    prompts,
    reference_constrained_greedy,
    reference_greedy,
    reference_model,
    reference_prompt_logprobs,
    sampling,
    start_stack,
    wait_for,
)
from transformers import GenerationConfig

from common.structured_output import StructuredOutput
from pagedkv.gateway.v1 import gateway_pb2 as gpb
from pagedkv.gateway.v1 import gateway_pb2_grpc as gpb_grpc
from tools.launch import Stack, StackSpec


def hand_offs(base: str) -> dict[str, float]:
    """The gateway's pagedkv_hand_offs counter, by outcome."""
    text = urllib.request.urlopen(f"{base}/metrics", timeout=10).read().decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(
        r'pagedkv_hand_offs_total\{[^}]*outcome="(\w+)"[^}]*\} (\S+)', text)}


@pytest.fixture(scope="module")
def split(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Clients, str, Stack]]:
    log_dir: Path = tmp_path_factory.mktemp("split")
    stack = start_stack(log_dir, num_executors=2, num_prefill_executors=1,
                        executor_args=("--load-format", "dummy", "--num-blocks", "256"))
    clients = Clients(stack)
    yield clients, http_base(stack), stack
    clients.close()
    stack.stop()


def test_prefill_and_decode_executors_keep_every_output(split: tuple[Clients, str, Stack]):
    # Prompts ending inside a block, at a boundary and past one; all concurrent. Two ask for
    # their prompt's logprobs, which the prefill executor computes before the move.
    clients, base, stack = split
    batch = [list(p) for n, seed in ((5, 1), (16, 2), (17, 3), (31, 4), (48, 5), (64, 6))
             for p in prompts(1, n, seed=700 + seed)]
    before = hand_offs(base).get("moved", 0.0)
    results = generate_many(clients.gateway, [
        gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=p), sampling=sampling(
            20, ignore_eos=True, **({"prompt_logprobs": 0} if i in (2, 5) else {})))
        for i, p in enumerate(batch)])
    for i, (prompt, result) in enumerate(zip(batch, results, strict=True)):
        assert tuple(result[0].token_ids) == reference_greedy(tuple(prompt), 20, ignore_eos=True)
        got = [e.logprob for e in result[0].prompt_logprobs]
        assert got == pytest.approx(
            reference_prompt_logprobs(prompt) if i in (2, 5) else [], abs=1e-4)
    assert hand_offs(base).get("moved", 0.0) - before == len(batch)
    pools = {p.pool_id: p for p in clients.wait_all_blocks_back()}
    prefill, decode = stack.executor_addrs()
    info = clients.gateway.GetModelInfo(gpb.GetModelInfoRequest(), timeout=10)
    assert {e.address: e.role for e in info.executors} == {prefill: "prefill", decode: "decode"}
    # The decode pool looked up no prompt (it admitted nothing); the prefill pool did.
    assert pools[prefill].num_prefix_queries > 0 and pools[decode].num_prefix_queries == 0


def test_two_gateways_hand_off_onto_one_decode_executor(split: tuple[Clients, str, Stack]):
    # A second gateway on the same executors: both gateways' requests move, KV and all, onto
    # the one decode executor, whose forwards merge both gateways' calls between their
    # ImportKV writes. Every output is the reference's; every block comes back.
    clients, base, stack = split
    with grpc.insecure_channel(stack.start_gateway("gateway-2").address) as channel:
        stubs = [clients.gateway, gpb_grpc.GatewayServiceStub(channel)]
        batch = [list(p) for p in prompts(8, 21, seed=730)]
        before = hand_offs(base).get("moved", 0.0) + hand_offs(
            http_base(stack, "gateway-2")).get("moved", 0.0)
        with ThreadPoolExecutor(len(batch)) as pool:
            results = list(pool.map(lambda i: generate(stubs[i % 2], gpb.GenerateRequest(
                token_ids=gpb.TokenIds(ids=batch[i]), sampling=sampling(16, ignore_eos=True))),
                range(len(batch))))
        moved = hand_offs(base).get("moved", 0.0) + hand_offs(
            http_base(stack, "gateway-2")).get("moved", 0.0)
    for prompt, result in zip(batch, results, strict=True):
        assert tuple(result[0].token_ids) == reference_greedy(tuple(prompt), 16, ignore_eos=True)
    assert moved - before == len(batch)
    clients.wait_all_blocks_back()


def test_a_moved_request_keeps_its_penalties_and_n(split: tuple[Clients, str, Stack]):
    # n = 2 children move one by one; a repetition penalty counts the prompt and the tokens
    # generated before the move (the decode executor gets them as history_token_ids).
    clients, base, _ = split
    prompt = next(prompts(1, 24, seed=720))
    twice = generate(clients.gateway, gpb.GenerateRequest(
        token_ids=gpb.TokenIds(ids=prompt), sampling=sampling(12, ignore_eos=True, n=2)))
    expected = reference_greedy(tuple(prompt), 12, ignore_eos=True)
    assert [tuple(twice[i].token_ids) for i in (0, 1)] == [expected, expected]
    penalised = generate(clients.gateway, gpb.GenerateRequest(
        token_ids=gpb.TokenIds(ids=prompt),
        sampling=sampling(16, ignore_eos=True, repetition_penalty=1.5)))[0]
    config = GenerationConfig(max_new_tokens=16, do_sample=False, pad_token_id=0,
                              eos_token_id=None, repetition_penalty=1.5)
    with torch.no_grad():
        out = reference_model().generate(torch.tensor([prompt]), generation_config=config)
    assert penalised.token_ids == out[0, len(prompt):].tolist()
    clients.wait_all_blocks_back()


def test_a_moved_request_keeps_its_structured_output(split: tuple[Clients, str, Stack]):
    # The prefill executor samples the first token under the constraint; the decode executor
    # starts the constraint over after it. n = 2 children move one by one.
    clients, base, _ = split
    prompt = next(prompts(1, 20, seed=740))
    constraint = StructuredOutput("regex", "[a-z]{3,6}-[0-9]{2,5}")
    message = gpb.StructuredOutput(regex=constraint.spec)
    before = hand_offs(base).get("moved", 0.0)
    done = generate(clients.gateway, gpb.GenerateRequest(
        token_ids=gpb.TokenIds(ids=prompt), sampling=sampling(24, n=2,
                                                              structured_output=message)))
    expected = reference_constrained_greedy(prompt, constraint, 24)
    assert [tuple(done[i].token_ids) for i in (0, 1)] == [expected, expected]
    assert hand_offs(base).get("moved", 0.0) - before == 2
    clients.wait_all_blocks_back()


def test_a_leaving_executor_hands_its_running_requests_over(tmp_path: Path):
    # Requests run on executor B alone; A joins, then B leaves discovery: B's requests move,
    # KV and all, to A and finish there (the same tokens), and B leaves at once instead of
    # after its longest request.
    listed = tmp_path / "executors.txt"
    stack = Stack(StackSpec(
        model=MODEL, num_executors=2, allocator_port=0, executor_port=0, gateway_port=0,
        log_dir=str(tmp_path), executor_args=("--load-format", "dummy", "--num-blocks", "512"),
        gateway_args=("--executor-addrs-file", str(listed), "--discovery-interval-s", "0.1"),
    )).start_backends()
    clients = None
    try:
        staying, leaving = stack.executor_addrs()
        listed.write_text(f"{leaving}\n")
        stack.start_gateway("gateway")
        clients = Clients(stack)
        base = http_base(stack)

        def executors() -> list[str]:
            info = clients.gateway.GetModelInfo(gpb.GetModelInfoRequest(), timeout=10)
            return sorted(e.address for e in info.executors)

        batch = list(prompts(4, 20, seed=740))
        results: dict[int, list[int]] = {}
        streamed = [0] * len(batch)

        def run(index: int) -> None:
            def seen(n: int) -> None:
                streamed[index] = n
            done = generate(clients.gateway, gpb.GenerateRequest(  # type: ignore[union-attr]
                token_ids=gpb.TokenIds(ids=batch[index]),
                sampling=sampling(400, ignore_eos=True)), on_tokens=seen, timeout=300)
            results[index] = done[0].token_ids

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(batch))]
        for thread in threads:
            thread.start()
        wait_for(lambda: all(streamed), "every request streaming on the leaving executor")
        listed.write_text(f"{leaving}\n{staying}\n")
        wait_for(lambda: executors() == sorted([staying, leaving]), "the other executor")
        listed.write_text(f"{staying}\n")
        wait_for(lambda: executors() == [staying], "the leaving executor to hand over")
        for thread in threads:
            thread.join(300)
        for index, prompt in enumerate(batch):
            assert tuple(results[index]) == reference_greedy(tuple(prompt), 400, ignore_eos=True)
        assert hand_offs(base).get("moved", 0.0) == len(batch)  # each was running there
        clients.wait_all_blocks_back()
    finally:
        if clients is not None:
            clients.close()
        stack.stop()
