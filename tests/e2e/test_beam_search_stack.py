"""Beam search through the whole stack (real subprocesses, tiny-llama with dummy weights,
fp32): the hypotheses equal transformers' generate(num_beams=k) token for token over gRPC and
HTTP; every block comes back, also after a cancellation mid-search; bad input is refused with
a precise status and changes nothing."""

from __future__ import annotations

import json
import time

import grpc
import httpx
import pytest
from e2e_stack import (
    EOS,
    Clients,
    beam_request,
    generate,
    generate_many,
    prompts,
    reference_beams,
    tokenizer,
)

from pagedkv.gateway.v1 import gateway_pb2 as gpb


@pytest.fixture(scope="module")
def stack_clients(tiny_stack: Clients) -> tuple[Clients, str]:
    """The shared tiny stack (e2e_stack.start_tiny_stack): 200 blocks, beams up to 4 wide,
    max_model_len 1024."""
    return tiny_stack, tiny_stack.http


@pytest.fixture(scope="module")
def clients(stack_clients: tuple[Clients, str]) -> Clients:
    return stack_clients[0]


CASES = [  # width, n, length_penalty, early_stopping
    (2, 2, 1.0, False), (3, 2, 0.5, True), (4, 3, 2.0, "never"), (4, 4, -1.0, False),
    (3, 1, 0.0, "never"), (2, 1, 1.5, True),
]


def test_beam_search_equals_transformers_generate_num_beams(clients: Clients):
    # 6 configurations x 2 prompts (mixed lengths: partial last blocks), each with EOS alone
    # and with two more stop tokens taken from its own output (hypotheses end early, early
    # stopping matters), all submitted at once: each completion is transformers' hypothesis
    # of that rank, token for token, one response each, with its finish reason and usage.
    jobs = []
    for k, (width, n, penalty, early) in enumerate(CASES):
        for prompt in prompts(2, 7 + 11 * k, seed=k):
            first = reference_beams(prompt, width, 1, 16, penalty, early)[0]
            extra = tuple(dict.fromkeys(t for t in first[3:8] if t != EOS))[:2 if width < 4 else 1]
            for stops in ((), extra):
                jobs.append((prompt, width, n, penalty, early, stops))
    requests = [beam_request(p, w, n, 16, lp, e, s) for p, w, n, lp, e, s in jobs]
    results = generate_many(clients.gateway, requests)
    for (prompt, width, n, penalty, early, stops), result in zip(jobs, results, strict=True):
        expected = reference_beams(prompt, width, n, 16, penalty, early, (EOS, *stops))
        assert sorted(result) == list(range(n))
        got = [tuple(result[i].token_ids) for i in range(n)]
        assert got == expected, (prompt, width, n, penalty, early, stops)
        for i, tokens in enumerate(got):
            done = result[i]
            assert done.num_responses == 1  # streamed at the end, whole
            stopped = tokens[-1] in (EOS, *stops)
            assert done.finish_reason == (gpb.FINISH_REASON_STOP if stopped
                                          else gpb.FINISH_REASON_LENGTH)
            assert done.text == tokenizer().decode(list(tokens), skip_special_tokens=True)
            assert done.usage is not None and done.usage.completion_tokens == len(tokens)
            assert done.usage.prompt_tokens == len(prompt)
    clients.wait_all_blocks_back()


def test_beam_search_over_http_takes_best_of_as_the_width(
        clients: Clients, stack_clients: tuple[Clients, str]):
    # /v1/completions with vLLM's fields: best_of 4 beams, n 2 returned, length_penalty,
    # early_stopping "never"; the choices are transformers' two best, in order.
    prompt = next(prompts(1, 21, seed=40))
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 12, "n": 2, "best_of": 4,
            "use_beam_search": True, "length_penalty": 0.5, "early_stopping": "never"}
    reply = httpx.post(f"{stack_clients[1]}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    choices = reply.json()["choices"]
    expected = reference_beams(prompt, 4, 2, 12, 0.5, "never")
    assert [c["index"] for c in choices] == [0, 1]
    texts = [tokenizer().decode(list(e), skip_special_tokens=True) for e in expected]
    assert [c["text"] for c in choices] == texts
    # Streamed: one chunk per hypothesis when the search ends, then [DONE].
    with httpx.stream("POST", f"{stack_clients[1]}/v1/completions",
                      json={**body, "stream": True}, timeout=60) as stream:
        events = [line[6:] for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    assert sorted((c["index"], c["text"]) for c in chunks) == list(enumerate(texts))
    clients.wait_all_blocks_back()


def test_a_search_cancelled_midway_gives_every_block_back(clients: Clients):
    # Width 4, up to 600 tokens without EOS: the client gives up after half a second (beams
    # forked, pruned, holding shared and copied blocks); every block comes back.
    prompt = next(prompts(1, 37, seed=41))
    call = clients.gateway.Generate(gpb.GenerateRequest(
        token_ids=gpb.TokenIds(ids=prompt), sampling=gpb.SamplingParams(
            max_tokens=600, n=2, use_beam_search=True, beam_width=4, ignore_eos=True)))
    try:
        # The search is running once its beams were forked (4, and for a moment a pruned
        # one whose Free rides on the next Step).
        deadline = time.monotonic() + 30
        while clients.pools()[0].num_requests < 4:
            assert time.monotonic() < deadline, "the search never forked its beams"
            time.sleep(0.05)
    finally:
        call.cancel()
    clients.wait_all_blocks_back()


def _beam(**fields: object) -> gpb.SamplingParams:
    fields.setdefault("max_tokens", 8)
    return gpb.SamplingParams(use_beam_search=True, **fields)  # type: ignore[arg-type]


BAD = [
    (_beam(beam_width=0), "beam_width (best_of over HTTP) is 0; it must be in [1, 4]"),
    (_beam(beam_width=5), "beam_width (best_of over HTTP) is 5; it must be in [1, 4]"),
    (_beam(beam_width=2, n=3), "sampling.n is 3; beam search returns at most beam_width (2)"),
    (_beam(beam_width=2, temperature=0.7), "sampling.temperature is not supported with "
                                           "use_beam_search"),
    (_beam(beam_width=2, stop=["x"]), "sampling.stop is not supported with use_beam_search"),
    (_beam(beam_width=2, logprobs=2), "sampling.logprobs is not supported"),
    (_beam(beam_width=2, seed=3), "sampling.seed is not supported"),
    (_beam(beam_width=2, length_penalty=float("nan")), "sampling.length_penalty is nan"),
    (_beam(beam_width=2, length_penalty=float("inf")), "sampling.length_penalty is inf"),
    (_beam(beam_width=4, stop_token_ids=[5, 6, 7, 8]), "needs the 24 most likely next tokens"),
    (gpb.SamplingParams(max_tokens=8, beam_width=2), "sampling.beam_width is set without "
                                                     "use_beam_search"),
    (gpb.SamplingParams(max_tokens=8, early_stopping=gpb.EARLY_STOPPING_NEVER),
     "sampling.early_stopping is set without use_beam_search"),
]


@pytest.mark.parametrize(("params", "message"), BAD)
def test_bad_beam_search_input_is_invalid_argument_and_changes_nothing(
        clients: Clients, params: gpb.SamplingParams, message: str):
    # Refused before anything is queued: no request, no block at the allocator.
    before = clients.pools()[0]
    with pytest.raises(grpc.RpcError) as err:
        generate(clients.gateway, gpb.GenerateRequest(text="hello", sampling=params))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in (err.value.details() or "")
    after = clients.pools()[0]
    assert after.num_requests == 0 and after.num_used_blocks == 0
    assert after.num_prefix_queries == before.num_prefix_queries


def test_a_search_that_cannot_fit_the_pool_is_resource_exhausted(clients: Clients):
    # 4 beams x 1,008 tokens each, counted without sharing, exceed the 200 x 16 slots (one
    # beam alone fits).
    with pytest.raises(grpc.RpcError) as err:
        generate(clients.gateway, gpb.GenerateRequest(
            token_ids=gpb.TokenIds(ids=[1] * 24), sampling=_beam(beam_width=4, max_tokens=984)))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "narrow the beam" in (err.value.details() or "")


@pytest.mark.parametrize(("body", "message"), [
    ({"best_of": 0}, "beam_width (best_of over HTTP) is 0"),
    ({"best_of": 2, "n": 3}, "n is 3; beam search returns at most beam_width (2)"),
    ({"best_of": 2, "temperature": 0.5}, "temperature is not supported with use_beam_search"),
    ({"best_of": 2, "length_penalty": 11}, "length_penalty is 11"),
])
def test_bad_beam_search_input_over_http_is_a_400_naming_the_field(
        clients: Clients, stack_clients: tuple[Clients, str], body: dict[str, object],
        message: str):
    payload = {"model": "tiny-llama", "prompt": "hello", "max_tokens": 8,
               "use_beam_search": True, **body}
    reply = httpx.post(f"{stack_clients[1]}/v1/completions", json=payload, timeout=30)
    assert reply.status_code == 400, reply.text
    assert message in reply.json()["error"]["message"]
    pool = clients.pools()[0]
    assert pool.num_requests == 0 and pool.num_used_blocks == 0


def test_best_of_other_than_n_without_beam_search_is_refused_over_http(
        stack_clients: tuple[Clients, str]):
    payload = {"model": "tiny-llama", "prompt": "hello", "max_tokens": 4, "n": 1, "best_of": 3}
    reply = httpx.post(f"{stack_clients[1]}/v1/completions", json=payload, timeout=30)
    assert reply.status_code == 400
    assert "only supported with use_beam_search" in reply.json()["error"]["message"]
