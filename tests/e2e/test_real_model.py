"""The embedded real model (SmolLM2-135M-Instruct, real weights) through all three services.

The oracle is transformers' own `generate` on the same directory, loaded independently of the
executor (its own attention implementation, no paging).

The stack runs the launcher's defaults plus speculative decoding (prompt lookup): every greedy
parity case here is also one of drafting, whose output must be the one without it; the
copying prompts below are where its drafts are accepted. (Depth 2, which drafting turns off,
runs in the other stacks: tiny-llama's, preemption, hand-off.)
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from typing import Any

import httpx
import pytest
import torch
from e2e_stack import Clients, generate, generate_many, http_base, sampling, start_stack
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.model_dirs import DEFAULT_MODEL
from pagedkv.gateway.v1 import gateway_pb2 as gpb
from tools.launch import Stack

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "Photosynthesis is the process by which",
]
MAX_TOKENS = 24
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
        "prompt_lookup_min": 2}
# Outputs that copy their prompt: most of their tokens come as accepted drafts.
COPYING = [
    "Repeat this list exactly: apple, banana, cherry, date, elderberry, fig, grape. "
    "List: apple, banana,",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):",
]


@lru_cache(maxsize=1)
def hf() -> tuple[Any, Any]:
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    model = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32)
    return tokenizer, model.eval()


def hf_greedy(prompt_ids: list[int], max_tokens: int) -> list[int]:
    """transformers' generate, greedy, stopping at the model's EOS like the gateway."""
    tokenizer, model = hf()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_tokens,
                             do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return [int(t) for t in out[0, len(prompt_ids):]]


@pytest.fixture(scope="module")
def clients(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Clients]:
    # The launcher's defaults (the embedded model, weights loaded: auto), and drafting.
    log_dir = tmp_path_factory.mktemp("real-model")
    stack: Stack = start_stack(log_dir, model=str(DEFAULT_MODEL),
                               gateway_args=("--speculative-config", json.dumps(SPEC)))
    c = Clients(stack, http=http_base(stack))
    try:
        yield c
    finally:
        c.close()
        stack.stop()


def test_real_model_greedy_equals_transformers_generate(clients: Clients) -> None:
    # Five prompts at once (one batch, mixed lengths): token-identical to generate, EOS included.
    tokenizer, _ = hf()
    requests = [gpb.GenerateRequest(text=p, sampling=sampling(MAX_TOKENS)) for p in PROMPTS]
    results = generate_many(clients.gateway, requests)
    for prompt, result in zip(PROMPTS, results, strict=True):
        ids = tokenizer.encode(prompt)
        assert result[0].usage is not None and result[0].usage.prompt_tokens == len(ids)
        assert result[0].token_ids == hf_greedy(ids, MAX_TOKENS), prompt
    clients.wait_all_blocks_back()


def accepted_tokens(c: Clients) -> float:
    text = httpx.get(f"{c.http}/metrics", timeout=10).text
    match = re.search(r"^vllm:spec_decode_num_accepted_tokens_total\{[^}]*\} (\S+)$", text, re.M)
    assert match, "the gateway exports vllm:spec_decode_num_accepted_tokens"
    return float(match.group(1))


def test_real_model_drafted_outputs_equal_generate(clients: Clients) -> None:
    # Outputs that copy their prompts, beside requests it cannot draft for (logprobs,
    # seeded sampling) in the same batches: greedy ones equal generate, drafted or not.
    tokenizer, _ = hf()
    ids = [tokenizer.encode(p) for p in COPYING]
    requests = [gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=i), sampling=sampling(MAX_TOKENS))
                for i in ids]
    requests += [
        gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=ids[0]),
                            sampling=sampling(MAX_TOKENS, logprobs=2)),
        *[gpb.GenerateRequest(token_ids=gpb.TokenIds(ids=ids[0]),
                              sampling=sampling(MAX_TOKENS, temperature=0.8, seed=3))] * 2,
    ]
    before = accepted_tokens(clients)
    with ThreadPoolExecutor(len(requests)) as pool:
        first, second, with_logprobs, sampled, again = (
            r[0] for r in pool.map(lambda r: generate(clients.gateway, r), requests))
    expected = [hf_greedy(i, MAX_TOKENS) for i in ids]
    assert [first.token_ids, second.token_ids] == expected
    assert with_logprobs.token_ids == expected[0]
    assert sampled.token_ids == again.token_ids and len(sampled.token_ids) == MAX_TOKENS
    assert accepted_tokens(clients) - before >= 10  # the copies came largely as drafts
    clients.wait_all_blocks_back()


def test_real_model_chat_template_answers_paris(clients: Clients) -> None:
    # The model's own chat template: asked for France's capital, it says Paris and stops at
    # its end-of-turn token (EOS), token-identical to generate on the same rendered prompt.
    question = gpb.ChatMessage(role="user", content="What is the capital of France?")
    request = gpb.GenerateRequest(chat=gpb.ChatMessages(messages=[question]),
                                  sampling=sampling(32))
    result = generate(clients.gateway, request)[0]
    assert "Paris" in result.text
    assert result.finish_reason == gpb.FINISH_REASON_STOP
    tokenizer, _ = hf()
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, tokenize=False,
    )
    ids = tokenizer.encode(rendered, add_special_tokens=False)
    assert result.token_ids == hf_greedy(ids, 32)[: len(result.token_ids)]
    assert result.token_ids[-1] in {tokenizer.eos_token_id}


def test_real_model_info_names_the_model_and_its_eos(clients: Clients) -> None:
    # GetModelInfo reports the model's own name (its config's, which set-up writes) and the
    # EOS of config + generation config.
    info = clients.gateway.GetModelInfo(gpb.GetModelInfoRequest())
    assert info.model_name == "SmolLM2-135M-Instruct"
    tokenizer, _ = hf()
    assert list(info.eos_token_ids) == [tokenizer.eos_token_id]


def test_real_model_chat_rejects_unknown_role_and_empty_messages(clients: Clients) -> None:
    # A role the template does not know, or no message at all: INVALID_ARGUMENT, nothing held.
    import grpc

    bad = gpb.ChatMessages(messages=[gpb.ChatMessage(role="wizard", content="hi")])
    for chat, needle in ((bad, "role 'wizard'"), (gpb.ChatMessages(), "messages is empty")):
        with pytest.raises(grpc.RpcError) as info:
            generate(clients.gateway, gpb.GenerateRequest(chat=chat, sampling=sampling(4)))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert needle in (info.value.details() or "")
    clients.wait_all_blocks_back()


QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def _chat_reference(messages: list[dict[str, str]], max_tokens: int) -> str:
    tokenizer, _ = hf()
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                             tokenize=False)
    ids = hf_greedy(tokenizer.encode(rendered, add_special_tokens=False), max_tokens)
    return str(tokenizer.decode(ids, skip_special_tokens=True))


def test_real_model_openai_chat(clients: Clients) -> None:
    # The official client, the model's own template: the answer is transformers' generate's.
    import openai

    client = openai.OpenAI(base_url=f"{clients.http}/v1", api_key="unused", max_retries=0)
    response = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=QUESTION,  # type: ignore[arg-type]
        temperature=0, max_completion_tokens=32, logprobs=True, top_logprobs=2)
    choice = response.choices[0]
    assert choice.message.content == _chat_reference(QUESTION, 32)
    assert "Paris" in (choice.message.content or "")
    assert choice.finish_reason == "stop"
    content = choice.logprobs.content  # type: ignore[union-attr]
    assert len(content) == response.usage.completion_tokens  # type: ignore[union-attr]
    assert all(len(c.top_logprobs) == 2 for c in content)
    # Greedy: the chosen token is the most likely one.
    assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob) for c in content)


def test_real_model_openai_async_streaming_chat(clients: Clients) -> None:
    import asyncio

    import openai

    async def stream() -> tuple[list[str], str, str | None]:
        client = openai.AsyncOpenAI(base_url=f"{clients.http}/v1", api_key="unused",
                                    max_retries=0)
        chunks = await client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=QUESTION,  # type: ignore[arg-type]
            temperature=0, max_tokens=32, stream=True)
        roles, text, reason = [], "", None
        async for chunk in chunks:
            for choice in chunk.choices:
                if choice.delta.role:
                    roles.append(choice.delta.role)
                text += choice.delta.content or ""
                reason = choice.finish_reason or reason
        await client.close()
        return roles, text, reason

    roles, text, reason = asyncio.run(stream())
    assert roles == ["assistant"]
    assert text == _chat_reference(QUESTION, 32)
    assert reason == "stop"


def test_real_model_answers_in_the_schema_it_is_given(clients: Clients) -> None:
    # OpenAI's response_format on the real model: the answer parses, validates, and says Paris.
    import jsonschema
    import openai

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
              "required": ["city"], "additionalProperties": False}
    client = openai.OpenAI(base_url=f"{clients.http}/v1", api_key="unused", max_retries=0)
    response = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=QUESTION,  # type: ignore[arg-type]
        temperature=0, max_completion_tokens=48, response_format={
            "type": "json_schema", "json_schema": {"name": "capital", "schema": schema,
                                                   "strict": True}})
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    answer = json.loads(choice.message.content or "")
    jsonschema.validate(answer, schema)
    assert "Paris" in answer["city"]


def test_real_model_constraint_that_allows_what_it_says_changes_nothing(
        clients: Clients) -> None:
    # Greedy under a constraint the model's own output satisfies: the same tokens, the
    # same logprobs (the mask leaves the model's choice alone).
    import openai

    client = openai.OpenAI(base_url=f"{clients.http}/v1", api_key="unused", max_retries=0)
    prompt, served = PROMPTS[0], "SmolLM2-135M-Instruct"
    plain = client.completions.create(model=served, prompt=prompt, max_tokens=16,
                                      temperature=0.0, logprobs=0)
    text = plain.choices[0].text
    for params in ({"regex": r"[\s\S]*"}, {"choice": [text, text + " and more"]}):
        constrained = client.completions.create(
            model=served, prompt=prompt, max_tokens=16, temperature=0.0, logprobs=0,
            extra_body={"structured_outputs": params})
        assert constrained.choices[0].text == text
        got, want = constrained.choices[0].logprobs, plain.choices[0].logprobs
        assert got is not None and want is not None
        assert got.tokens == want.tokens
        assert got.token_logprobs == pytest.approx(want.token_logprobs, abs=1e-4)
