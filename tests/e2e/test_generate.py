"""The whole system on one executor: greedy parity with transformers, the unary call, prefix
caching, n > 1, cancellation and bad input. Real subprocesses on loopback."""

from __future__ import annotations

import grpc
import pytest
from e2e_stack import (
    TINY_STACK_BLOCKS,
    Clients,
    generate,
    generate_many,
    prompts,
    reference_greedy,
    sampling,
    tokenizer,
)

from pagedkv.gateway.v1 import gateway_pb2 as gpb


@pytest.fixture(scope="module")
def clients(tiny_stack: Clients) -> Clients:
    """The shared tiny stack (e2e_stack.start_tiny_stack): max_n 4, 256-token steps,
    max_model_len 1024."""
    return tiny_stack


def test_generate_greedy_matches_transformers_for_concurrent_streams(clients: Clients):
    # 8 concurrent streaming clients (mixed lengths, some over the 256-token step budget).
    batch = [list(p) for p in prompts(4, 20)] + [list(p) for p in prompts(3, 300, seed=1)]
    text = "The quick brown fox jumps over the lazy dog."
    requests = [gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=p), sampling=sampling(24))
                for p in batch]
    requests.append(gpb.GenerateRequest(text=text, sampling=sampling(24)))
    batch.append(tokenizer().encode(text))
    results = generate_many(clients.gateway, requests)
    for prompt, result in zip(batch, results, strict=True):
        done = result[0]
        expected = reference_greedy(tuple(prompt), 24)
        assert tuple(done.token_ids) == expected
        assert done.text == tokenizer().decode(list(expected), skip_special_tokens=True)
        assert done.usage is not None and done.usage.prompt_tokens == len(prompt)
        assert done.usage.completion_tokens == len(expected)
        assert done.num_responses == len(expected)  # one response per step with a token
    clients.wait_all_blocks_back()


def test_complete_returns_the_streamed_completion(clients: Clients):
    # The unary call collects exactly what the stream sends.
    prompt = next(prompts(1, 12, seed=5))
    response = clients.gateway.Complete(
        gpb.CompleteRequest(token_ids=gpb.TokenIds(ids=prompt), sampling=sampling(10)),
        timeout=60,
    )
    (completion,) = response.completions
    assert tuple(completion.token_ids) == reference_greedy(tuple(prompt), 10)
    assert completion.finish_reason in (gpb.FINISH_REASON_LENGTH, gpb.FINISH_REASON_STOP)


def test_tokenize_and_model_info(clients: Clients):
    # Tokenize uses the preset's tokenizer; model info reports the executor and its pool.
    text = "Hello wörld"
    assert list(clients.gateway.Tokenize(gpb.TokenizeRequest(text=text)).token_ids) == \
        tokenizer().encode(text)
    info = clients.gateway.GetModelInfo(gpb.GetModelInfoRequest())
    assert info.max_model_len == 1024 and info.vocab_size == 512  # min(gateway, executor)
    assert list(info.eos_token_ids) == [2]
    (executor,) = info.executors
    assert executor.num_blocks == TINY_STACK_BLOCKS and executor.block_size == 16
    assert executor.healthy


def test_generate_stops_at_max_model_len(clients: Clients):
    # A 1000-token prompt with max_tokens 100 ends at max_model_len 1024: 24 tokens, LENGTH.
    prompt = next(prompts(1, 1000, seed=3))
    done = generate(clients.gateway, gpb.GenerateRequest(
        token_ids=gpb.TokenIds(ids=prompt), sampling=sampling(100, ignore_eos=True)))[0]
    assert done.finish_reason == gpb.FINISH_REASON_LENGTH
    assert len(done.token_ids) == 24
    assert tuple(done.token_ids) == reference_greedy(tuple(prompt), 24, ignore_eos=True)


def test_generate_stop_string_ends_completion(clients: Clients):
    # A stop string taken from the greedy output ends it there; the text stops before it.
    prompt = next(prompts(1, 10, seed=7))
    full = generate(clients.gateway, gpb.GenerateRequest(
        token_ids=gpb.TokenIds(ids=prompt), sampling=sampling(16, ignore_eos=True)))[0]
    stop = full.text[5:8]
    assert stop.strip(), f"need a visible stop string in {full.text!r}"
    done = generate(clients.gateway, gpb.GenerateRequest(
        token_ids=gpb.TokenIds(ids=prompt), sampling=sampling(16, stop=[stop], ignore_eos=True)))
    assert done[0].finish_reason == gpb.FINISH_REASON_STOP
    assert done[0].text == full.text[: full.text.find(stop)]


@pytest.mark.parametrize("include_stop", [False, True])
def test_generate_stop_string_across_tokens_with_n_2_ends_both_and_frees_everything(
    clients: Clients, include_stop: bool
):
    # A stop string of four characters across a token boundary, n = 2 greedy (the children
    # are alike): each completion ends at the token that completes the match, its usage
    # counts that token, its text is cut there (or just after the stop string), nothing the
    # engine sampled later leaks, and every block comes back.
    prompt = next(prompts(1, 12, seed=23))
    full = generate(clients.gateway, gpb.GenerateRequest(
        token_ids=gpb.TokenIds(ids=prompt), sampling=sampling(32, ignore_eos=True)))[0]
    decode = tokenizer().decode
    ends = [len(decode(full.token_ids[: k + 1], skip_special_tokens=True))
            for k in range(len(full.token_ids))]
    assert decode(full.token_ids, skip_special_tokens=True) == full.text
    at = next(e for e in ends[4:] if full.text[e - 2 : e + 2].strip()
              and full.text.find(full.text[e - 2 : e + 2]) == e - 2)
    stop = full.text[at - 2 : at + 2]
    last = next(k for k, e in enumerate(ends) if e >= at + 2)  # completes the match
    done = generate(clients.gateway, gpb.GenerateRequest(
        token_ids=gpb.TokenIds(ids=prompt), sampling=sampling(
            32, stop=[stop], n=2, ignore_eos=True, include_stop_str_in_output=include_stop)))
    for completion in (done[0], done[1]):
        assert completion.finish_reason == gpb.FINISH_REASON_STOP
        assert completion.text == full.text[: at + 2 if include_stop else at - 2]
        assert completion.token_ids == full.token_ids[: last + 1]
        assert completion.usage is not None
        assert completion.usage.completion_tokens == last + 1
    clients.wait_all_blocks_back()


def test_generate_prefix_cache_hit_keeps_output_and_salts_never_share(clients: Clients):
    # Two prompts share 160 tokens: the second reports cached tokens; another salt gets none.
    shared = next(prompts(1, 160, seed=11))
    first = shared + [7, 8, 9]
    second = shared + [10, 11, 12, 13]
    for prompt in (first, second):
        done = generate(clients.gateway, gpb.GenerateRequest(
            token_ids=gpb.TokenIds(ids=prompt), sampling=sampling(8), cache_salt="tenant-a"))[0]
        assert tuple(done.token_ids) == reference_greedy(tuple(prompt), 8)
    assert done.usage is not None and done.usage.cached_prompt_tokens == 160
    other = generate(clients.gateway, gpb.GenerateRequest(
        token_ids=gpb.TokenIds(ids=second), sampling=sampling(8), cache_salt="tenant-b"))[0]
    assert other.usage is not None and other.usage.cached_prompt_tokens == 0
    assert tuple(other.token_ids) == reference_greedy(tuple(second), 8)
    clients.wait_all_blocks_back()


def test_generate_n_with_seed_is_reproducible_and_children_differ(clients: Clients):
    # n=4 sampled completions of one prompt, seed 1234: same outputs twice, not all equal.
    prompt = next(prompts(1, 40, seed=13))
    request = gpb.GenerateRequest(
        token_ids=gpb.TokenIds(ids=prompt),
        sampling=gpb.SamplingParams(max_tokens=12, temperature=1.0, seed=1234, n=4,
                                    ignore_eos=True),
    )
    first = generate(clients.gateway, request)
    second = generate(clients.gateway, request)
    assert sorted(first) == [0, 1, 2, 3]
    outputs = [tuple(first[i].token_ids) for i in range(4)]
    assert outputs == [tuple(second[i].token_ids) for i in range(4)]
    assert len(set(outputs)) > 1 and all(len(o) == 12 for o in outputs)
    assert all(first[i].usage.prompt_tokens == 40 for i in range(4))  # type: ignore[union-attr]
    clients.wait_all_blocks_back()


def test_generate_n_greedy_children_all_equal_the_reference(clients: Clients):
    # n=3 greedy: the children share the prompt's blocks (the last one partial: copy-on-write
    # when they write into it) and must each produce transformers' greedy output.
    prompt = next(prompts(1, 40, seed=37))
    done = generate(clients.gateway, gpb.GenerateRequest(
        token_ids=gpb.TokenIds(ids=prompt), sampling=sampling(12, n=3, ignore_eos=True)))
    expected = reference_greedy(tuple(prompt), 12, ignore_eos=True)
    assert [tuple(done[i].token_ids) for i in range(3)] == [expected] * 3
    clients.wait_all_blocks_back()


def test_generate_cancelled_stream_gives_every_block_back(clients: Clients):
    # The client closes the stream after 3 responses of a long completion.
    prompt = next(prompts(1, 50, seed=17))
    call = clients.gateway.Generate(gpb.GenerateRequest(
        token_ids=gpb.TokenIds(ids=prompt), sampling=sampling(1500, ignore_eos=True)))
    for i, _ in enumerate(call):
        if i == 2:
            break
    call.cancel()
    pools = clients.wait_all_blocks_back()
    assert pools[0].num_free_blocks == TINY_STACK_BLOCKS


def test_generate_deadline_exceeded_gives_every_block_back(clients: Clients):
    # A deadline that expires mid-stream: DEADLINE_EXCEEDED, then all blocks are back.
    prompt = next(prompts(1, 30, seed=19))
    with pytest.raises(grpc.RpcError) as err:
        generate(clients.gateway, gpb.GenerateRequest(
            token_ids=gpb.TokenIds(ids=prompt), sampling=sampling(1500, ignore_eos=True)),
            timeout=1.0)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    clients.wait_all_blocks_back()


BAD_INPUTS = [
    (gpb.GenerateRequest(text="", sampling=sampling(4)), "prompt"),
    (gpb.GenerateRequest(sampling=sampling(4)), "prompt"),
    (gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=[1] * 1024), sampling=sampling(4)),
     "max_model_len"),
    (gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=[1, 9999]), sampling=sampling(4)),
     "prompt token_ids"),
    (gpb.GenerateRequest(text="hi", sampling=gpb.SamplingParams(max_tokens=0)),
     "sampling.max_tokens"),
    (gpb.GenerateRequest(text="hi", sampling=gpb.SamplingParams(temperature=-1)),
     "sampling.temperature"),
    (gpb.GenerateRequest(text="hi", sampling=gpb.SamplingParams(top_p=0)), "sampling.top_p"),
    (gpb.GenerateRequest(text="hi", sampling=gpb.SamplingParams(top_p=1.01)), "sampling.top_p"),
    (gpb.GenerateRequest(text="hi", sampling=gpb.SamplingParams(n=5)), "sampling.n"),
    (gpb.GenerateRequest(text="hi", sampling=gpb.SamplingParams(stop_token_ids=[512])),
     "sampling.stop_token_ids"),
    # (Chat on a model without a chat template: test_fuzzed_input.py, over both APIs.)
]


@pytest.mark.parametrize(("request_", "field"), BAD_INPUTS)
def test_generate_bad_input_is_invalid_argument_naming_the_field(
    clients: Clients, request_: gpb.GenerateRequest, field: str
):
    # Each malformed request: INVALID_ARGUMENT with the field in the message.
    with pytest.raises(grpc.RpcError) as err:
        generate(clients.gateway, request_)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in (err.value.details() or "")


def test_gateway_keeps_serving_after_bad_input(clients: Clients):
    # After every rejection above, a good request still gets its reference output.
    prompt = next(prompts(1, 9, seed=23))
    done = generate(clients.gateway, gpb.GenerateRequest(
        token_ids=gpb.TokenIds(ids=prompt), sampling=sampling(6)))[0]
    assert tuple(done.token_ids) == reference_greedy(tuple(prompt), 6)


def test_generate_duplicate_request_id_in_flight_is_already_exists(clients: Clients):
    # A client-chosen request id may not be reused while its first request still streams.
    prompt = next(prompts(1, 8, seed=29))
    first = clients.gateway.Generate(gpb.GenerateRequest(
        token_ids=gpb.TokenIds(ids=prompt), sampling=sampling(1500, ignore_eos=True),
        request_id="dup-1"))
    next(iter(first))
    with pytest.raises(grpc.RpcError) as err:
        generate(clients.gateway, gpb.GenerateRequest(
            token_ids=gpb.TokenIds(ids=prompt), sampling=sampling(4), request_id="dup-1"))
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    first.cancel()
    clients.wait_all_blocks_back()


@pytest.mark.parametrize(("first_id", "first_n", "second_id", "second_n", "taken"), [
    ("fam", 2, "fam-1", 1, "fam-1"),  # a plain request named like a running child
    ("pp", 2, "pp-prefill", 1, "pp-prefill"),  # ...like a running prefill parent
    ("kid-0", 1, "kid", 2, "kid-0"),  # an n > 1 request whose child a running request names
])
def test_generate_request_id_taken_by_another_requests_sequence_is_already_exists(
    clients: Clients, first_id: str, first_n: int, second_id: str, second_n: int, taken: str,
):
    # n > 1 names its sequences <id>-prefill and <id>-<i> at the allocator: a request whose
    # sequence ids collide with a running one's is refused alone; the running one completes.
    prompt = next(prompts(1, 8, seed=31))
    max_tokens = 300  # still running through both checks below (two short calls), when slow
    first = clients.gateway.Generate(gpb.GenerateRequest(
        token_ids=gpb.TokenIds(ids=prompt),
        sampling=sampling(max_tokens, n=first_n, ignore_eos=True), request_id=first_id))
    stream = iter(first)
    responses = [next(stream)]

    def second(request_id: str = "") -> gpb.GenerateRequest:
        return gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=prompt),
                                   sampling=sampling(4, n=second_n), request_id=request_id)

    with pytest.raises(grpc.RpcError) as err:
        generate(clients.gateway, second(second_id))
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    details = err.value.details() or ""
    assert repr(taken) in details and repr(first_id) in details
    # The same id as the caller's x-request-id (no request_id): not used, a new id instead.
    response = next(iter(clients.gateway.Generate(
        second(), metadata=(("x-request-id", second_id),), timeout=60)))
    assert response.request_id not in ("", second_id)
    responses.extend(stream)  # raises if the first request failed
    lengths = {i: sum(len(r.token_ids) for r in responses if r.index == i) for i in range(first_n)}
    finishes = [r.finish_reason for r in responses if r.finish_reason]
    assert lengths == dict.fromkeys(range(first_n), max_tokens)
    assert finishes == [gpb.FINISH_REASON_LENGTH] * first_n
    clients.wait_all_blocks_back()
    # Once the first is gone, the id is free.
    done = generate(clients.gateway, second(second_id))
    assert sorted(done) == list(range(second_n))
    clients.wait_all_blocks_back()
