"""pagedkv_client.Client against a real stack: streaming and unary calls equal transformers'
greedy generate, chat, tokenize, model info, typed errors, retries, cancellation."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from client_stack import chat_prompt_ids
from tcp_relay import Relay, free_port

from pagedkv_client import Client, Delta, PagedkvError, RetryPolicy
from tests.e2e.e2e_stack import (
    TINY_STACK_BLOCKS,
    Clients,
    prompts,
    reference_greedy,
    tokenizer,
)

FAST_RETRY = RetryPolicy(max_attempts=12, initial_backoff_s=0.05, max_backoff_s=0.4)


@pytest.fixture(scope="module")
def client(clients: Clients) -> Iterator[Client]:
    with Client(clients.stack.gateway_addr, timeout=60) as c:
        yield c


def collect(deltas: list[Delta]) -> tuple[list[int], str]:
    return [t for d in deltas for t in d.token_ids], "".join(d.text for d in deltas)


def test_client_generate_streams_greedy_equal_to_transformers(client: Client):
    # Text and token-id prompts: the streamed tokens are transformers' greedy ones.
    text = "The quick brown fox jumps over the lazy dog."
    ids = next(prompts(1, 20, seed=3))
    for prompt, prompt_ids in ((text, tokenizer().encode(text)), (ids, ids)):
        deltas = list(client.generate(prompt, max_tokens=12, temperature=0))
        token_ids, streamed = collect(deltas)
        expected = reference_greedy(tuple(prompt_ids), 12)
        assert tuple(token_ids) == expected
        assert streamed == tokenizer().decode(list(expected), skip_special_tokens=True)
        last = deltas[-1]
        assert last.finish_reason in ("stop", "length") and last.usage is not None
        assert last.usage.prompt_tokens == len(prompt_ids)
        assert all(d.finish_reason is None for d in deltas[:-1])


def test_client_complete_returns_the_greedy_completion_and_request_id(client: Client):
    # The unary call, with n=2 greedy children and the caller's request id.
    prompt = next(prompts(1, 12, seed=5))
    result = client.complete(prompt, max_tokens=8, temperature=0, n=2, request_id="unary-1")
    assert result.request_id == "unary-1"
    expected = reference_greedy(tuple(prompt), 8)
    assert [c.index for c in result.completions] == [0, 1]
    assert all(c.token_ids == expected for c in result.completions)
    assert result.token_ids == expected and result.finish_reason in ("stop", "length")


def test_client_chat_renders_the_template_streaming_and_not(client: Client, clients: Clients):
    # chat() sends the messages; the gateway renders the model's template: the same tokens
    # as transformers on the rendered prompt, streamed or in one response.
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    prompt_ids = chat_prompt_ids(Path(clients.stack.spec.model), messages)
    expected = reference_greedy(tuple(prompt_ids), 10)
    result = client.chat(messages, max_tokens=10, temperature=0)
    assert result.token_ids == expected
    assert result.completions[0].usage is not None
    assert result.completions[0].usage.prompt_tokens == len(prompt_ids)
    as_tuples = [("system", "Be brief."), ("user", "Hi")]
    token_ids, _ = collect(list(client.chat(as_tuples, stream=True, max_tokens=10,
                                            temperature=0)))
    assert tuple(token_ids) == expected


def test_client_tokenize_and_model_info(client: Client):
    assert client.tokenize("Hello wörld") == tokenizer().encode("Hello wörld")
    info = client.model_info()
    assert info.model_name and info.vocab_size == 512 and info.eos_token_ids == (2,)
    (executor,) = info.executors
    assert executor.block_size == 16 and executor.num_blocks == TINY_STACK_BLOCKS
    assert executor.healthy
    assert executor.role == "both"  # (the executor's --role default)
    assert info.lora_adapters == ()


def test_client_lora_calls_reach_the_gateway(client: Client):
    # This stack's gateway does not allow run-time loads, and serves no adapter: the client
    # gets the gateway's statuses (the stack with adapters is tests/e2e/test_real_model.py).
    with pytest.raises(PagedkvError) as err:
        client.load_lora_adapter("a", "/adapters/a")
    assert err.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert "--allow-runtime-lora-updating" in err.value.details
    with pytest.raises(PagedkvError) as err:
        client.complete("hello", max_tokens=2, model="a")
    assert err.value.code == grpc.StatusCode.NOT_FOUND and "`a` does not exist" in err.value.details


def test_client_errors_are_typed_and_sampling_fields_pass_through(client: Client):
    # A bad value is INVALID_ARGUMENT from the gateway; an unknown keyword a TypeError here;
    # a field the client has no keyword of its own for (here: stop_token_ids) still works.
    with pytest.raises(PagedkvError) as err:
        client.complete("hello", max_tokens=4, top_p=2.0)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "top_p" in err.value.details
    with pytest.raises(TypeError, match="no_such_field"):
        client.complete("hello", no_such_field=1)
    prompt = next(prompts(1, 10, seed=7))
    first = reference_greedy(tuple(prompt), 8)[0]
    result = client.complete(prompt, max_tokens=8, temperature=0, stop_token_ids=[first])
    assert result.token_ids == (first,) and result.finish_reason == "stop"


def test_client_deadline_exceeded_is_typed_and_frees_the_request(client: Client,
                                                                clients: Clients):
    # A deadline that expires mid-stream and one that expires in a unary call.
    prompt = next(prompts(1, 30, seed=19))
    with pytest.raises(PagedkvError) as err:
        for _ in client.generate(prompt, max_tokens=1500, ignore_eos=True, timeout=0.5):
            pass
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    with pytest.raises(PagedkvError) as err:
        client.complete(prompt, max_tokens=1500, ignore_eos=True, timeout=0.5)
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and err.value.attempts == 1
    clients.wait_all_blocks_back()


def test_client_leaving_a_stream_cancels_it_at_the_gateway(client: Client, clients: Clients):
    # Breaking out of the loop (and closing a held stream) cancels the request: its blocks
    # come back and its request id is free again.
    prompt = next(prompts(1, 40, seed=23))
    for _ in client.generate(prompt, max_tokens=1500, ignore_eos=True, request_id="cancel-1"):
        break
    with contextlib.closing(client.generate(prompt, max_tokens=1500, ignore_eos=True,
                                            request_id="cancel-2")) as stream:
        next(stream)
    clients.wait_all_blocks_back()
    for request_id in ("cancel-1", "cancel-2"):
        result = client.complete(prompt, max_tokens=2, request_id=request_id)
        assert result.request_id == request_id


def test_client_retries_until_the_port_comes_up(clients: Clients):
    # The gateway's port opens 0.5 s after the calls start: unary and streaming calls retry
    # (UNAVAILABLE, backoff) and succeed within the policy's budget.
    for call in ("unary", "stream"):
        relay = Relay(clients.stack.gateway_addr)
        opener = threading.Timer(0.5, relay.open)
        opener.start()
        try:
            with Client(relay.address, retry=FAST_RETRY, timeout=30) as late:
                started = time.monotonic()
                if call == "unary":
                    assert late.tokenize("hello") == tokenizer().encode("hello")
                else:
                    assert list(late.generate("hello", max_tokens=3, temperature=0))
                assert time.monotonic() - started >= 0.4
        finally:
            opener.join()
            relay.cut()


def test_client_gives_up_with_unavailable_after_its_retries():
    # Nothing ever listens: UNAVAILABLE after exactly max_attempts tries, for both kinds.
    policy = RetryPolicy(max_attempts=3, initial_backoff_s=0.05, max_backoff_s=0.1)
    with Client(f"127.0.0.1:{free_port()}", retry=policy) as nowhere:
        with pytest.raises(PagedkvError) as err:
            nowhere.model_info()
        assert err.value.code == grpc.StatusCode.UNAVAILABLE and err.value.attempts == 3
        with pytest.raises(PagedkvError) as err:
            list(nowhere.generate("hello"))
        assert err.value.code == grpc.StatusCode.UNAVAILABLE and err.value.attempts == 3


def test_client_never_retries_a_stream_that_has_yielded(clients: Clients):
    # The connection is lost after the first delta: the error is raised, not retried (one
    # attempt), and the gateway frees the request.
    relay = Relay(clients.stack.gateway_addr)
    relay.open()
    prompt = next(prompts(1, 30, seed=29))
    with Client(relay.address, retry=FAST_RETRY, timeout=30) as client:
        stream = client.generate(prompt, max_tokens=1500, ignore_eos=True)
        next(stream)
        relay.cut()
        with pytest.raises(PagedkvError) as err:
            for _ in stream:
                pass
    assert err.value.code == grpc.StatusCode.UNAVAILABLE and err.value.attempts == 1
    clients.wait_all_blocks_back()
