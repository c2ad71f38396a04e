"""The OpenAI-compatible HTTP API through the whole stack (real subprocesses), called with the
official `openai` client (sync, async, streaming) and with raw HTTP for SSE framing and error
bodies. Outputs are checked against transformers' own forward and generate."""

from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch
from e2e_stack import (
    MODEL,
    Clients,
    prompts,
    reference_greedy,
    reference_model,
    sampling,
    tokenizer,
)
from prometheus_client.parser import text_string_to_metric_families
from transformers import GenerationConfig

from pagedkv.gateway.v1 import gateway_pb2 as gpb

SERVED = "tiny-llama"
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def stack_clients(tiny_stack: Clients) -> tuple[Clients, str]:
    """The shared tiny stack (e2e_stack.start_tiny_stack), whose allocator and executor log
    at debug level: their per-request lines name each request."""
    return tiny_stack, tiny_stack.http


@pytest.fixture(scope="module")
def base(stack_clients: tuple[Clients, str]) -> str:
    return stack_clients[1]


@pytest.fixture(scope="module")
def clients(stack_clients: tuple[Clients, str]) -> Clients:
    return stack_clients[0]


@pytest.fixture(scope="module")
def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_lists_the_served_model(client: openai.OpenAI):
    models = client.models.list()
    assert [m.id for m in models.data] == [SERVED]
    assert client.models.retrieve(SERVED).id == SERVED


def test_completion_equals_transformers_generate(client: openai.OpenAI, clients: Clients):
    prompt = next(prompts(1, 21, seed=501))
    expected = reference_greedy(tuple(prompt), 12, ignore_eos=True)
    response = client.completions.create(model=SERVED, prompt=prompt, max_tokens=12,
                                         temperature=0, extra_body={"ignore_eos": True})
    choice = response.choices[0]
    assert choice.text == tokenizer().decode(list(expected), skip_special_tokens=True)
    assert choice.finish_reason == "length"
    assert response.usage.prompt_tokens == len(prompt)
    assert response.usage.completion_tokens == 12
    assert response.id.startswith("cmpl-")
    clients.wait_all_blocks_back()


def test_streamed_completion_equals_the_whole_one(client: openai.OpenAI):
    prompt = next(prompts(1, 18, seed=502))
    whole = client.completions.create(model=SERVED, prompt=prompt, max_tokens=10, temperature=0,
                                      extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(
        model=SERVED, prompt=prompt, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert all(c.usage is None for c in chunks[:-1])


def test_streamed_completion_with_a_stop_string_equals_the_whole_one(
    client: openai.OpenAI, clients: Clients
):
    # The stop string is found on the API's side: streamed or not, the text ends before it,
    # the finish is "stop", the usage counts the tokens through the one that completed it,
    # and the blocks come back (the engine was told to stop).
    prompt = next(prompts(1, 18, seed=507))
    full = client.completions.create(model=SERVED, prompt=prompt, max_tokens=40, temperature=0,
                                     extra_body={"ignore_eos": True})
    text = full.choices[0].text
    stop = next(text[i : i + 3] for i in range(6, len(text) - 3)
                if text[i : i + 3].strip() and text.find(text[i : i + 3]) == i)
    whole = client.completions.create(model=SERVED, prompt=prompt, max_tokens=40, temperature=0,
                                      stop=[stop], extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(
        model=SERVED, prompt=prompt, max_tokens=40, temperature=0, stream=True, stop=[stop],
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert whole.choices[0].text == text[: text.find(stop)]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert whole.choices[0].finish_reason == "stop"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens < 40
    clients.wait_all_blocks_back()


def test_logprobs_are_the_models_own(client: openai.OpenAI, clients: Clients):
    # Each token's logprob and the top alternatives equal log_softmax of transformers' forward
    # pass over the same tokens (the raw distribution, as vLLM reports by default): exactly,
    # by token id, on gRPC; in OpenAI's text-keyed format on HTTP (where two tokens that
    # decode to the same text share a key, as on OpenAI's and vLLM's servers).
    prompt = next(prompts(1, 12, seed=503))
    generated = list(reference_greedy(tuple(prompt), 6, ignore_eos=True))
    with torch.no_grad():
        logits = reference_model()(torch.tensor([prompt + generated])).logits[0]
    expected = torch.log_softmax(logits.float(), dim=-1)[len(prompt) - 1:-1]
    top = torch.topk(expected, 3)

    done = clients.gateway.Complete(gpb.CompleteRequest(
        token_ids=gpb.TokenIds(ids=prompt), sampling=sampling(6, ignore_eos=True, logprobs=3)),
        timeout=60).completions[0]
    assert list(done.token_ids) == generated
    assert [lp.token_id for lp in done.logprobs] == generated
    for i, lp in enumerate(done.logprobs):
        assert lp.logprob == pytest.approx(expected[i, generated[i]].item(), abs=1e-3)
        assert [t.token_id for t in lp.top_logprobs] == top.indices[i].tolist()
        assert [t.logprob for t in lp.top_logprobs] == pytest.approx(top.values[i].tolist(),
                                                                    abs=1e-3)

    response = client.completions.create(model=SERVED, prompt=prompt, max_tokens=6,
                                         temperature=0, logprobs=3,
                                         extra_body={"ignore_eos": True})
    logprobs = response.choices[0].logprobs
    assert logprobs is not None
    tok = tokenizer()
    offset = 0
    for i, token_id in enumerate(generated):
        assert logprobs.tokens[i] == tok.decode([token_id])
        assert logprobs.text_offset[i] == offset
        offset += len(logprobs.tokens[i])
        assert logprobs.token_logprobs[i] == pytest.approx(expected[i, token_id].item(), abs=1e-3)
        for value in logprobs.top_logprobs[i].values():
            assert any(value == pytest.approx(v, abs=1e-3) for v in top.values[i].tolist())


def test_repetition_penalty_equals_transformers(client: openai.OpenAI):
    # transformers' RepetitionPenaltyLogitsProcessor is the reference: over prompt and output.
    prompt = next(prompts(1, 10, seed=504))
    config = GenerationConfig(max_new_tokens=10, do_sample=False, repetition_penalty=1.5,
                              pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        out = reference_model().generate(torch.tensor([prompt]), generation_config=config)
    expected = out[0, len(prompt):].tolist()
    response = client.completions.create(
        model=SERVED, prompt=prompt, max_tokens=10, temperature=0,
        extra_body={"ignore_eos": True, "repetition_penalty": 1.5})
    assert response.choices[0].text == tokenizer().decode(expected, skip_special_tokens=True)


def test_logit_bias_forces_a_token(client: openai.OpenAI):
    prompt = next(prompts(1, 8, seed=505))
    response = client.completions.create(model=SERVED, prompt=prompt, max_tokens=5,
                                         temperature=0, logit_bias={"42": 100},
                                         extra_body={"ignore_eos": True})
    assert response.choices[0].text == tokenizer().decode([42] * 5)


def test_sse_framing_is_openais(base: str):
    # Raw bytes, as OpenAI and vLLM send them: every event `data: <compact json>\n\n` and
    # nothing else (no `\r`, no comment), the last `data: [DONE]\n\n`; the usage chunk
    # before it.
    with httpx.stream("POST", f"{base}/v1/completions",
                      json={"model": SERVED, "prompt": [1, 5, 9], "max_tokens": 3,
                            "temperature": 0, "ignore_eos": True, "stream": True,
                            "stream_options": {"include_usage": True}}) as s:
        assert s.headers["content-type"].startswith("text/event-stream")
        raw = s.read()
    assert raw.endswith(b"data: [DONE]\n\n") and b"\r" not in raw
    events = raw.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]"
    chunks = [json.loads(e.removeprefix(b"data: ")) for e in events[:-2]]
    assert raw == b"".join(b"data: " + json.dumps(c, separators=(",", ":")).encode() + b"\n\n"
                           for c in chunks) + b"data: [DONE]\n\n"
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None, None, "length"]
    assert all(c["object"] == "text_completion" and c["model"] == SERVED for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3


def test_request_id_header_names_the_request(base: str):
    response = httpx.post(f"{base}/v1/completions", headers={"x-request-id": "trace-me-42"},
                          json={"model": SERVED, "prompt": [1, 5, 9], "max_tokens": 2})
    assert response.status_code == 200
    assert response.headers["x-request-id"] == "trace-me-42"
    assert response.json()["id"] == "cmpl-trace-me-42"


def test_one_request_id_names_the_request_in_all_three_logs(base: str, clients: Clients):
    # The client's x-request-id: in the response, and in every service's log lines about the
    # request (the allocator's admission and free, the executor's start and release).
    rid = "trace-all-three-7f3a"
    response = httpx.post(f"{base}/v1/completions", headers={"x-request-id": rid},
                          json={"model": SERVED, "prompt": [1, 5, 9, 13], "max_tokens": 3})
    assert response.headers["x-request-id"] == rid
    clients.wait_all_blocks_back()
    stack = clients.stack
    deadline = time.monotonic() + 10
    wanted = {"gateway": ("request_queued", "request_finished"),
              "allocator": ("request_admitted", "request_freed"),
              "executor-0": ("request_started", "request_released")}
    while True:
        missing = [(name, event) for name, events in wanted.items() for event in events
                   if not any(event in line and rid in line for line in
                              Path(stack.by_name(name).log_path or "").read_text().splitlines())]
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.1)  # (the executor's release rides on a later step or an idle Release)
    assert not missing, f"lines without the request id: {missing}"


def _error(response: httpx.Response, status: int) -> dict[str, object]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    return error


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"model": SERVED, "prompt": "x", "tools": []}, "tools", "unsupported parameter"),
    ({"model": SERVED, "prompt": "x", "temperature": -1}, None, "temperature"),
    ({"model": SERVED, "prompt": "x", "top_p": 0}, None, "top_p"),
    ({"model": SERVED, "prompt": "x", "n": 0}, None, "n is 0"),
    ({"model": SERVED, "prompt": "x", "priority": 1 << 40}, None, "priority is 1099511627776"),
    ({"model": SERVED, "prompt": "x", "max_tokens": 0}, None, "max_tokens"),
    ({"model": SERVED, "prompt": "x", "logprobs": 21}, None, "logprobs"),
    ({"model": SERVED, "prompt": "x", "presence_penalty": 3}, None, "presence_penalty"),
    ({"model": SERVED, "prompt": "x", "logit_bias": {"abc": 1}}, None, "logit_bias"),
    ({"model": SERVED, "prompt": "x", "logit_bias": {"5": 500}}, None, "logit_bias"),
    ({"model": SERVED, "prompt": "x", "echo": 3}, "echo", "echo"),
    ({"model": SERVED, "prompt": ["a", "b"]}, None, "one prompt per request"),
    ({"model": SERVED, "prompt": "x", "stream_options": {"include_usage": True}}, None,
     "stream_options"),
    ({"model": SERVED, "prompt": "x", "stream": True,
      "stream_options": {"continuous_usage_stats": "often"}}, None, "continuous_usage_stats"),
    ({"model": SERVED, "prompt": "x", "stream": True,
      "stream_options": {"every_chunk": True}}, None, "every_chunk"),
    ({"model": SERVED, "prompt": "x", "min_tokens": 5, "max_tokens": 2}, None, "min_tokens"),
    ({"prompt": "x"}, "model", "model is required"),
])
def test_bad_completion_bodies_are_400_naming_the_field(base: str, clients: Clients,
                                                        body: dict[str, object],
                                                        param: str | None, words: str):
    error = _error(httpx.post(f"{base}/v1/completions", json=body), 400)
    assert words in str(error["message"])
    if param is not None:
        assert error["param"] == param
    assert clients.pools()[0].num_requests == 0


def test_bad_chat_bodies_are_400(base: str):
    for body, words in [
        ({"model": SERVED, "messages": [{"role": "tool", "content": "x"}]}, "tool_call_id"),
        ({"model": SERVED, "messages": [{"role": "robot", "content": "x"}]}, "role"),
        ({"model": SERVED, "messages": []}, "messages is empty"),
        ({"model": SERVED, "messages": [{"role": "user", "content": "x"}],
          "top_logprobs": 2}, "top_logprobs needs logprobs"),
        ({"model": SERVED, "messages": [{"role": "user", "content": "x"}],
          "response_format": {"type": "json_schema"}}, "response_format.json_schema.schema"),
    ]:
        assert words in str(_error(httpx.post(f"{base}/v1/chat/completions", json=body),
                                   400)["message"])


def test_malformed_json_wrong_type_and_unknown_model(base: str, client: openai.OpenAI):
    _error(httpx.post(f"{base}/v1/completions", content=b"{not json",
                      headers={"content-type": "application/json"}), 400)
    error = _error(httpx.post(f"{base}/v1/completions", content=b"{}",
                              headers={"content-type": "text/plain"}), 400)
    assert "application/json" in str(error["message"])
    error = _error(httpx.post(f"{base}/v1/completions",
                              json={"model": "gpt-4", "prompt": "x"}), 404)
    assert error["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=SERVED, prompt="x", temperature=-2)


def test_tokenize_a_text_as_the_tokenizer_does_and_detokenize_it_back(base: str):
    # vLLM's /tokenize and /detokenize: transformers' own tokenizer is the reference; special
    # tokens by default (add_special_tokens: false leaves them out); a text longer than
    # max_model_len tokens is counted, not refused.
    tok = tokenizer()
    text = "The paged cache holds 16 tokens a block, and blocks are shared."
    got = httpx.post(f"{base}/tokenize", json={"model": SERVED, "prompt": text}).json()
    assert got == {"count": len(tok.encode(text)), "max_model_len": 1024,
                   "tokens": tok.encode(text), "token_strs": None}
    bare = httpx.post(f"{base}/tokenize", json={"prompt": text, "add_special_tokens": False,
                                               "return_token_strs": True}).json()
    assert bare["tokens"] == tok.encode(text, add_special_tokens=False) != got["tokens"]
    assert bare["token_strs"] == tok.convert_ids_to_tokens(bare["tokens"])
    back = httpx.post(f"{base}/detokenize", json={"model": SERVED, "tokens": got["tokens"]})
    assert back.json() == {"prompt": tok.decode(got["tokens"])}  # the BOS token included
    long = httpx.post(f"{base}/tokenize", json={"prompt": "block " * 1500}).json()
    assert long["count"] == len(tok.encode("block " * 1500)) > long["max_model_len"]
    # 32 callers at once: each gets its own text's ids, and the gateway serves a completion
    # afterwards.
    texts = [f"caller {i} asks about block {i * 7}" for i in range(32)]
    with ThreadPoolExecutor(max_workers=32) as pool:
        replies = list(pool.map(
            lambda t: httpx.post(f"{base}/tokenize", json={"prompt": t}, timeout=60).json(),
            texts))
    assert [r["tokens"] for r in replies] == [tok.encode(t) for t in texts]
    done = httpx.post(f"{base}/v1/completions", timeout=60,
                      json={"model": SERVED, "prompt": "x", "max_tokens": 2, "n": 4})
    assert done.status_code == 200 and len(done.json()["choices"]) == 4


def test_tokenize_a_chat_gives_what_a_chat_completion_is_given(
        base: str, client: openai.OpenAI, clients: Clients):
    from transformers import AutoTokenizer

    chat_tok = AutoTokenizer.from_pretrained(clients.stack.spec.model)  # the template's copy
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    got = httpx.post(f"{base}/tokenize", json={"model": SERVED, "messages": messages}).json()
    rendered = chat_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert got["tokens"] == chat_tok.encode(rendered, add_special_tokens=False)
    completion = client.chat.completions.create(model=SERVED, messages=messages, max_tokens=1)
    assert completion.usage.prompt_tokens == got["count"]
    open_turn = httpx.post(f"{base}/tokenize", json={"messages": messages,
                                                     "add_generation_prompt": False}).json()
    without = chat_tok.apply_chat_template(messages, add_generation_prompt=False,
                                           tokenize=False)
    assert open_turn["tokens"] == chat_tok.encode(without, add_special_tokens=False)
    assert open_turn["count"] < got["count"]


def test_tokenize_and_detokenize_refuse_bad_bodies_by_name(base: str):
    text, chat = {"prompt": "x"}, {"messages": [{"role": "user", "content": "x"}]}
    for path, body, status, words in [
        ("/tokenize", {}, 400, "prompt (a text) or messages"),
        ("/tokenize", {**text, **chat}, 400, "one of the two"),
        ("/tokenize", {**chat, "add_special_tokens": True}, 400, "add_special_tokens"),
        ("/tokenize", {**text, "model": "gpt-4"}, 404, "does not exist"),
        ("/tokenize", {**text, "truncate": 3}, 400, "unsupported parameter: truncate"),
        ("/detokenize", {"tokens": [1, 512]}, 400, "token id 512 is outside the vocabulary"),
        ("/detokenize", {"tokens": [-1]}, 400, "token id -1"),
        ("/detokenize", {"tokens": "12"}, 400, "tokens"),
        ("/detokenize", {"model": "gpt-4", "tokens": [1]}, 404, "does not exist"),
    ]:
        assert words in str(_error(httpx.post(f"{base}{path}", json=body), status)["message"])
    assert httpx.get(f"{base}/health").status_code == 200


def test_oversized_body_is_413_before_it_is_read(base: str):
    big = b"x" * (3 * (1 << 20) + 10)  # over 2 x --max-prompt-bytes (1 MiB) + 1 MiB
    _error(httpx.post(f"{base}/v1/completions", content=big,
                      headers={"content-type": "application/json"}), 413)


def test_client_gone_mid_stream_frees_its_blocks(base: str, clients: Clients):
    prompt = next(prompts(1, 40, seed=506))
    with httpx.stream("POST", f"{base}/v1/completions",
                      json={"model": SERVED, "prompt": prompt, "max_tokens": 2000,
                            "temperature": 0, "ignore_eos": True, "stream": True}) as s:
        lines = s.iter_lines()
        assert next(lines).startswith("data: ")
        assert clients.pools()[0].num_requests == 1
    clients.wait_all_blocks_back()


def test_client_gone_while_waiting_for_a_whole_completion_frees_it(base: str, clients: Clients):
    body = json.dumps({"model": SERVED, "prompt": [1, 7, 8], "max_tokens": 2000,
                       "temperature": 0, "ignore_eos": True}).encode()
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                     b"application/json\r\ncontent-length: " + str(len(body)).encode()
                     + b"\r\n\r\n" + body)
        deadline = time.monotonic() + 10
        while clients.pools()[0].num_requests == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert clients.pools()[0].num_requests == 1
    clients.wait_all_blocks_back()


def test_a_client_that_stops_reading_does_not_stall_the_others(base: str, clients: Clients):
    # A stream whose client never reads (a tiny receive buffer): a normal stream beside it
    # completes, identical to the reference, and once the stalled one ends nothing is held.
    # (Cutting a slow stream past --max-sse-buffer queued events is tested in
    # tests/gateway/test_openai_stream.py: here the kernel's socket buffers absorb the whole
    # stream of this small model before the server ever waits.)
    body = json.dumps({"model": SERVED, "prompt": [1, 11, 12], "max_tokens": 1000,
                       "temperature": 0, "ignore_eos": True, "stream": True}).encode()
    host, port = base.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    sock.connect((host, int(port)))
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                     b"application/json\r\ncontent-length: " + str(len(body)).encode()
                     + b"\r\n\r\n" + body)
        prompt = next(prompts(1, 20, seed=507))
        expected = reference_greedy(tuple(prompt), 16, ignore_eos=True)
        other = httpx.post(f"{base}/v1/completions", timeout=60,
                           json={"model": SERVED, "prompt": prompt, "max_tokens": 16,
                                 "temperature": 0, "ignore_eos": True})
        assert other.json()["choices"][0]["text"] == tokenizer().decode(
            list(expected), skip_special_tokens=True)
        clients.wait_all_blocks_back(timeout_s=60)
    finally:
        sock.close()


def test_health(base: str):
    assert httpx.get(f"{base}/health").json() == {"status": "ok"}


def _samples(base: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"{base}/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted({"model_name": SERVED, **labels}.items()))), 0.0)


def test_metrics_count_a_known_workload_exactly(base: str, clients: Clients,
                                                client: openai.OpenAI):
    # Two identical 40-token prompts, one after the other: the second finds the first's two
    # full blocks cached (32 tokens), as the allocator reports.
    clients.wait_all_blocks_back()
    before = _samples(base)
    prompt = next(prompts(1, 40, seed=508))
    for _ in range(2):
        client.completions.create(model=SERVED, prompt=prompt, max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    after = _samples(base)

    def grew(name: str, **labels: str) -> float:
        return _value(after, name, **labels) - _value(before, name, **labels)

    assert grew("vllm:prompt_tokens_total") == 80
    assert grew("vllm:generation_tokens_total") == 10
    assert grew("vllm:request_success_total", finished_reason="length") == 2
    assert grew("vllm:prefix_cache_queries_total") == 80
    assert grew("vllm:prefix_cache_hits_total") == 32
    assert grew("vllm:time_to_first_token_seconds_count") == 2
    assert grew("vllm:inter_token_latency_seconds_count") == 8
    assert grew("vllm:e2e_request_latency_seconds_count") == 2
    assert grew("vllm:request_queue_time_seconds_count") == 2
    assert grew("vllm:request_generation_tokens_sum") == 10
    assert grew("vllm:request_prompt_tokens_sum") == 80
    assert _value(after, "vllm:num_requests_running") == 0
    assert _value(after, "vllm:num_requests_waiting") == 0
    assert _value(after, "pagedkv_executors_healthy") == 1
    assert grew("pagedkv_step_phase_seconds_count", phase="execute") > 0
    assert MODEL.endswith(SERVED)


def test_fuzzed_bodies_never_get_a_server_error(base: str, clients: Clients):
    # Random values of random types in every field both endpoints know (and some they do
    # not): each answer is a success or a 4xx in OpenAI's shape, never a 5xx; nothing leaks.
    import random

    from gateway.api.openai.protocol import ChatCompletionRequest, CompletionRequest

    rng = random.Random(int(__import__("os").environ.get("PAGEDKV_FUZZ_SEED", "17")))
    values = [None, True, False, 0, -1, 1, 2, 7, 2**31, -(2**63), 0.5, -0.5, 1e309 - 1e309,
              "", "x", "tiny-llama", SERVED, "\ud7ff", [], [1, 2], ["a"], [[1]], {}, {"5": 1},
              {"a": "b"}, {"type": "text"}, [{"role": "user", "content": "hi"}],
              [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
              # well-formed values of the constraint and tool fields, to get past their shape
              "auto", "required", {"type": "json_object"}, {"json": {"type": "object"}},
              {"regex": "[a-z]+"}, {"choice": ["a", "b"]}, {"grammar": "start: \"a\""},
              {"type": "json_schema", "json_schema": {"name": "s", "schema": {}}},
              [{"type": "function", "function": {"name": "f", "parameters": {}}}],
              {"type": "function", "function": {"name": "f"}}]
    for path, model in (("completions", CompletionRequest), ("chat/completions",
                                                             ChatCompletionRequest)):
        names = [*model.model_fields, "tools", "bogus"]
        for _ in range(60):
            body = {name: rng.choice(values) for name in rng.sample(names, rng.randint(0, 8))}
            body.setdefault("model", SERVED)
            body["max_tokens"] = rng.choice([1, 2, None])
            body.pop("max_completion_tokens", None)
            try:
                content = json.dumps(body, allow_nan=True)
            except (TypeError, ValueError):
                continue
            response = httpx.post(f"{base}/v1/{path}", content=content, timeout=60,
                                  headers={"content-type": "application/json"})
            assert response.status_code < 500, (body, response.text)
            if response.status_code >= 400:
                assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    clients.wait_all_blocks_back()
