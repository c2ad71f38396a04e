"""The embedded real model (SmolLM2-135M-Instruct, real weights) through all three services.

The oracle is transformers' own `generate` on the same directory, loaded independently of the
executor (its own attention implementation, no paging).

The stack runs the launcher's defaults plus speculative decoding (prompt lookup): every greedy
parity case here is also one of drafting, whose output must be the one without it; the
copying prompts below are where its drafts are accepted. (Depth 2, which drafting turns off,
runs in the other stacks: tiny-llama's, preemption, hand-off.) Its executor also serves LoRA
adapters (one loaded at start, others at run time), whose oracle is PEFT's model of each.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from e2e_stack import Clients, generate, generate_many, http_base, sampling, start_stack
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.model_dirs import DEFAULT_MODEL, PRESETS_DIR
from pagedkv.gateway.v1 import gateway_pb2 as gpb
from tools.launch import Stack
from tools.make_lora_adapter import make_adapter

pytestmark = pytest.mark.real_model  # make real-model-e2e (CI), out of make test's budget

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
def adapter_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """PEFT adapters of seeded random weights: two of this model (ranks under and at the
    executor's 16, one adapting two projections only), one of rank 32, one of another model."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        "sql": make_adapter(DEFAULT_MODEL, root / "sql", rank=8, seed=1),
        "poem": make_adapter(DEFAULT_MODEL, root / "poem", rank=16, seed=2,
                             targets=("q_proj", "v_proj")),
        "wide": make_adapter(DEFAULT_MODEL, root / "wide", rank=32, seed=3),
        "tiny": make_adapter(PRESETS_DIR / "tiny-llama", root / "tiny", rank=8, seed=4),
    }


@pytest.fixture(scope="module")
def clients(tmp_path_factory: pytest.TempPathFactory,
            adapter_dirs: dict[str, Path]) -> Iterator[Clients]:
    # The launcher's defaults (the embedded model, weights loaded: auto), drafting, LoRA.
    log_dir = tmp_path_factory.mktemp("real-model")
    stack: Stack = start_stack(
        log_dir, model=str(DEFAULT_MODEL),
        gateway_args=("--speculative-config", json.dumps(SPEC),
                      "--allow-runtime-lora-updating"),
        executor_args=("--max-loras", "2", "--max-lora-rank", "16",
                       "--lora-modules", f"sql={adapter_dirs['sql']}"))
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


# LoRA: adapters through the whole stack against PEFT's own model of each.

@lru_cache(maxsize=4)
def peft_model(adapter: Path) -> Any:
    """PEFT's model of `adapter` on its own copy of the base weights (PEFT changes the model
    it wraps)."""
    from peft import PeftModel

    base = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter).eval()


def peft_greedy(adapter: Path | None, prompt_ids: list[int], max_tokens: int) -> list[int]:
    if adapter is None:
        return hf_greedy(prompt_ids, max_tokens)
    tokenizer, _ = hf()
    with torch.no_grad():
        out = peft_model(adapter).generate(
            input_ids=torch.tensor([prompt_ids]), max_new_tokens=max_tokens, do_sample=False,
            pad_token_id=tokenizer.pad_token_id)
    return [int(t) for t in out[0, len(prompt_ids):]]


def peft_text(adapter: Path | None, prompt: str, max_tokens: int) -> str:
    tokenizer, _ = hf()
    ids = peft_greedy(adapter, tokenizer.encode(prompt), max_tokens)
    return str(tokenizer.decode(ids, skip_special_tokens=True))


def completion(client: Any, model: str, prompt: str, max_tokens: int) -> tuple[str, Any]:
    """A greedy completion's text, and the response."""
    response = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                         temperature=0)
    return response.choices[0].text, response


def test_real_model_lora_adapters_and_base_in_one_batch_equal_peft(
        clients: Clients, adapter_dirs: dict[str, Path]) -> None:
    # One adapter from --lora-modules, one loaded at run time: the same prompt under each and
    # under the base model, all in flight at once, every output PEFT's (or generate's).
    import openai

    client = openai.OpenAI(base_url=f"{clients.http}/v1", api_key="unused", max_retries=0)
    served = "SmolLM2-135M-Instruct"
    loaded = httpx.post(f"{clients.http}/v1/load_lora_adapter", timeout=60,
                        json={"lora_name": "poem", "lora_path": str(adapter_dirs["poem"])})
    assert loaded.status_code == 200, loaded.text
    listed = {m.id: m for m in client.models.list().data}
    assert set(listed) == {served, "sql", "poem"}
    assert listed["poem"].model_extra["parent"] == served  # type: ignore[index]
    runs = [(served, PROMPTS[2]), ("sql", PROMPTS[2]), ("poem", PROMPTS[2]), ("sql", PROMPTS[3]),
            ("poem", PROMPTS[1])]
    with ThreadPoolExecutor(len(runs)) as pool:
        results = list(pool.map(lambda r: completion(client, r[0], r[1], MAX_TOKENS), runs))
    for (model, prompt), (text, response) in zip(runs, results, strict=True):
        adapter = None if model == served else adapter_dirs[model]
        assert text == peft_text(adapter, prompt, MAX_TOKENS), model
        assert response.model == model
    assert len({text for text, _ in results[:3]}) == 3  # the adapters change the output
    # The gRPC API names adapters the same way, and gets the same tokens.
    grpc_sql = generate(clients.gateway, gpb.GenerateRequest(
        text=PROMPTS[3], sampling=sampling(MAX_TOKENS), model="sql"))[0]
    tokenizer, _ = hf()
    assert grpc_sql.token_ids == peft_greedy(adapter_dirs["sql"], tokenizer.encode(PROMPTS[3]),
                                             MAX_TOKENS)
    # n = 2: the children, forked after the prompt, compute with the adapter too.
    both = generate(clients.gateway, gpb.GenerateRequest(
        text=PROMPTS[3], sampling=sampling(MAX_TOKENS, n=2), model="sql"))
    assert [both[i].token_ids for i in (0, 1)] == [grpc_sql.token_ids] * 2
    clients.wait_all_blocks_back()


def test_real_model_lora_prefix_cache_is_per_adapter(clients: Clients,
                                                     adapter_dirs: dict[str, Path]) -> None:
    # A long prompt under the base model, then under an adapter, then under the adapter
    # again: the adapter finds nothing of the base model's KV (its output is PEFT's), and
    # its second request finds its own.
    import openai

    client = openai.OpenAI(base_url=f"{clients.http}/v1", api_key="unused", max_retries=0)
    prompt = " ".join(PROMPTS) + " Tell me more about the sea and the village."
    _, base = completion(client, "SmolLM2-135M-Instruct", prompt, 4)
    text, first = completion(client, "sql", prompt, 8)
    _, again = completion(client, "sql", prompt, 8)
    assert text == peft_text(adapter_dirs["sql"], prompt, 8)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens >= 32
    assert base.usage.prompt_tokens == first.usage.prompt_tokens
    clients.wait_all_blocks_back()


def test_real_model_lora_refusals(clients: Clients, adapter_dirs: dict[str, Path],
                                  tmp_path: Path) -> None:
    # Each refusal: OpenAI's error shape and the status vLLM's clients expect; the gRPC API
    # the same statuses. Nothing refused is loaded.
    import grpc
    import openai

    client = openai.OpenAI(base_url=f"{clients.http}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError, match="`nope` does not exist"):
        client.completions.create(model="nope", prompt="hi", max_tokens=2)

    def load(name: str, path: Path | str) -> httpx.Response:
        return httpx.post(f"{clients.http}/v1/load_lora_adapter", timeout=60,
                          json={"lora_name": name, "lora_path": str(path)})

    cases = [
        (load("x", tmp_path / "missing"), 404, "no adapter directory at"),
        (load("x", adapter_dirs["wide"]), 400, "rank 32, over this executor's --max-lora-rank"),
        (load("x", adapter_dirs["tiny"]), 400, "trained for another base model"),
        (load("SmolLM2-135M-Instruct", adapter_dirs["sql"]), 400, "the base model's name"),
        (load("sql", adapter_dirs["poem"]), 409, "loaded with other weights"),
        (httpx.post(f"{clients.http}/v1/unload_lora_adapter", json={"lora_name": "zz"},
                    timeout=10), 404, "no LoRA adapter named 'zz'"),
        (httpx.post(f"{clients.http}/v1/load_lora_adapter", json={"lora_name": "x"},
                    timeout=10), 400, "lora_path"),
    ]
    for response, status, needle in cases:
        assert response.status_code == status, response.text
        assert needle in response.json()["error"]["message"]
    assert {m.id for m in client.models.list().data} <= {"SmolLM2-135M-Instruct", "sql", "poem"}
    with pytest.raises(grpc.RpcError) as info:
        clients.gateway.LoadLoraAdapter(gpb.LoadLoraAdapterRequest(
            lora_name="x", lora_path=str(adapter_dirs["tiny"])))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as info:
        generate(clients.gateway, gpb.GenerateRequest(text="hi", sampling=sampling(2),
                                                      model="nope"))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    clients.wait_all_blocks_back()


def test_real_model_lora_unload_waits_for_its_requests(clients: Clients,
                                                       adapter_dirs: dict[str, Path]) -> None:
    # An unload while the adapter's request streams: the unload waits, the request ends whole
    # (PEFT's tokens), then the adapter is gone and its name is refused; loaded again over
    # gRPC, it serves again.
    import openai

    client = openai.OpenAI(base_url=f"{clients.http}/v1", api_key="unused", max_retries=0)
    httpx.post(f"{clients.http}/v1/load_lora_adapter", timeout=60,
               json={"lora_name": "poem", "lora_path": str(adapter_dirs["poem"])})
    prompt = PROMPTS[4]
    stream = iter(client.completions.create(model="poem", prompt=prompt, max_tokens=64,
                                            temperature=0, stream=True))
    text = next(stream).choices[0].text  # running now
    with ThreadPoolExecutor(1) as pool:
        unloading = pool.submit(httpx.post, f"{clients.http}/v1/unload_lora_adapter",
                                json={"lora_name": "poem"}, timeout=60)
        text += "".join(chunk.choices[0].text for chunk in stream)
        unloaded = unloading.result()
    assert unloaded.status_code == 200, unloaded.text
    assert text == peft_text(adapter_dirs["poem"], prompt, 64)
    assert "poem" not in {m.id for m in client.models.list().data}
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="poem", prompt="hi", max_tokens=2)
    reloaded = clients.gateway.LoadLoraAdapter(gpb.LoadLoraAdapterRequest(
        lora_name="poem", lora_path=str(adapter_dirs["poem"])))
    assert (reloaded.name, reloaded.rank) == ("poem", 16)
    info = clients.gateway.GetModelInfo(gpb.GetModelInfoRequest())
    assert {a.name for a in info.lora_adapters} == {"sql", "poem"}
    assert completion(client, "poem", prompt, 64)[0] == text
    clients.wait_all_blocks_back()
