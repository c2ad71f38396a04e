"""Structured output through the whole stack (the tiny stack: random weights, so every
choice the constraint leaves open is a real choice): every output parses and validates
(jsonschema, re) over many schemas, seeds and n > 1, on both APIs and both spellings of the
HTTP one, with the default JSON whitespace; greedy output under a constraint that allows what
the model says anyway equals the unconstrained output (on the real model, whose output is text:
tests/e2e/test_real_model.py); bad constraints are a 400 /
INVALID_ARGUMENT naming the problem, and a client that leaves mid-output, with nothing left
held."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import httpx
import jsonschema
import openai
import pytest
from e2e_stack import Clients, sampling

from pagedkv.gateway.v1 import gateway_pb2 as gpb

SERVED = "tiny-llama"
SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 130}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                      "country": {"enum": ["France", "Italy", "Spain"]}},
     "required": ["city", "country"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100},
     "minItems": 2, "maxItems": 5},
    {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 40},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                 "maxItems": 3},
        "done": {"type": "boolean"}},
     "required": ["title", "tags", "done"], "additionalProperties": False},
    {"type": "object", "properties": {
        "answer": {"anyOf": [{"type": "integer", "minimum": -99, "maximum": 99},
                             {"type": "null"}]},
        "unit": {"type": "string", "pattern": "^[a-z]{1,8}$"}},
     "required": ["answer", "unit"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": 0, "maximum": 9},
        "y": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["x", "y"], "additionalProperties": False}},
     "required": ["point"], "additionalProperties": False},
]
QUESTION = "Describe a person, a place or a task as JSON."
MAX_TOKENS = 200


@pytest.fixture(scope="module")
def client(tiny_stack: Clients) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tiny_stack.http}/v1", api_key="unused", max_retries=0,
                         timeout=120)


def _chat(client: openai.OpenAI, schema: dict[str, Any], seed: int) -> list[Any]:
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema,
                                                  "strict": True}}
    greedy = seed == 0
    response = client.chat.completions.create(
        model=SERVED, messages=[{"role": "user", "content": QUESTION}],
        response_format=fmt, max_tokens=MAX_TOKENS, temperature=0.0 if greedy else 0.8,
        seed=seed, n=1 if greedy else 2)
    return list(response.choices)


def test_response_format_outputs_validate_over_schemas_seeds_and_n(
        client: openai.OpenAI, tiny_stack: Clients) -> None:
    jobs = [(schema, seed) for schema in SCHEMAS for seed in (0, 1)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(lambda job: _chat(client, *job), jobs))
    for (schema, _), choices in zip(jobs, answers, strict=True):
        for choice in choices:
            assert choice.finish_reason == "stop", choice.message.content
            jsonschema.validate(json.loads(choice.message.content), schema)
    tiny_stack.wait_all_blocks_back()


def test_vllm_structured_outputs_and_json_object_on_both_endpoints(
        client: openai.OpenAI, tiny_stack: Clients) -> None:
    prompt = "Q: Name a primary color and a number.\nA:"
    cases: list[tuple[dict[str, Any], Any]] = [
        ({"regex": r"[A-Z][a-z]{2,8}, [0-9]{1,3}"},
         lambda t: re.fullmatch(r"[A-Z][a-z]{2,8}, [0-9]{1,3}", t)),
        ({"choice": ["red", "blue", "yellow"]}, lambda t: t in ("red", "blue", "yellow")),
        ({"grammar": 'root ::= "color=" ("red" | "blue") ";"'},
         lambda t: t in ("color=red;", "color=blue;")),
        ({"json": {"type": "object", "properties": {"color": {"type": "string",
                                                              "maxLength": 10}},
                   "required": ["color"], "additionalProperties": False}},
         lambda t: jsonschema.validate(json.loads(t), {"required": ["color"]}) or True),
    ]
    def ask(job: tuple[dict[str, Any], int]) -> list[tuple[str, str]]:
        params, seed = job
        temperature = 0.0 if seed == 0 else 1.0
        completion = client.completions.create(
            model=SERVED, prompt=prompt, max_tokens=MAX_TOKENS, seed=seed,
            temperature=temperature, extra_body={"structured_outputs": params})
        chat = client.chat.completions.create(
            model=SERVED, messages=[{"role": "user", "content": prompt}], seed=seed,
            max_tokens=MAX_TOKENS, temperature=temperature,
            extra_body={"structured_outputs": params})
        return [(completion.choices[0].text, completion.choices[0].finish_reason),
                (chat.choices[0].message.content, chat.choices[0].finish_reason)]

    jobs = [(params, seed) for params, _ in cases for seed in (0, 3)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(ask, jobs))
    for (params, seed), answer in zip(jobs, answers, strict=True):
        check = next(c for p, c in cases if p is params)
        for text, reason in answer:
            assert reason == "stop" and check(text), (params, seed, text)
    tiny_stack.wait_all_blocks_back()


def test_min_tokens_yields_to_a_complete_output(client: openai.OpenAI,
                                                tiny_stack: Clients) -> None:
    # min_tokens would hide the EOS a complete choice ends with: the output ends there all
    # the same, with nothing after it.
    response = client.completions.create(
        model=SERVED, prompt="Pick one:", max_tokens=40, temperature=0.0,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}, "min_tokens": 30})
    choice = response.choices[0]
    assert choice.text in ("yes", "no") and choice.finish_reason == "stop"
    assert response.usage.completion_tokens < 30
    tiny_stack.wait_all_blocks_back()


def test_grpc_structured_output_with_n_and_streaming(tiny_stack: Clients) -> None:
    schema = SCHEMAS[1]
    constraint = gpb.StructuredOutput(json_schema=json.dumps(schema))
    chat = gpb.ChatMessages(messages=[gpb.ChatMessage(role="user", content=QUESTION)])
    reply = tiny_stack.gateway.Complete(gpb.CompleteRequest(chat=chat, sampling=sampling(
        MAX_TOKENS, temperature=0.9, seed=5, n=3, structured_output=constraint)))
    assert len(reply.completions) == 3
    for completion in reply.completions:
        assert completion.finish_reason == gpb.FINISH_REASON_STOP
        jsonschema.validate(json.loads(completion.text), schema)
    text = "".join(r.text for r in tiny_stack.gateway.Generate(gpb.GenerateRequest(
        chat=chat, sampling=sampling(MAX_TOKENS, structured_output=gpb.StructuredOutput(
            choice=gpb.Choices(values=["Paris", "Rome"]))))))
    assert text in ("Paris", "Rome")
    tiny_stack.wait_all_blocks_back()


def _error(response: httpx.Response) -> str:
    assert response.status_code == 400, response.text
    return str(response.json()["error"]["message"])


@pytest.mark.parametrize("extra, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objekt"}}}}, "Invalid type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "json_schema.schema is missing"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "unclosed group"),
    ({"structured_outputs": {"grammar": "start: nothing_here"}}, "unknown name"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one"),
    ({"structured_outputs": {"choice": []}}, "at least one"),
    ({"structured_outputs": {"json": "{not json"}}, "not JSON"),
    ({"structured_outputs": {"regex": "a" * 70_000}}, "at most 65536"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
     "send one"),
    ({"structured_outputs": {"regex": "a"}, "ignore_eos": True}, "ignore_eos"),
    ({"structured_outputs": {"regex": "a"}, "use_beam_search": True, "n": 2},
     "structured_output"),
    ({"structured_outputs": {"whitespace_pattern": "x"}}, "whitespace_pattern"),
])
def test_bad_constraints_are_400_and_hold_nothing(tiny_stack: Clients, extra: dict[str, Any],
                                                  words: str) -> None:
    body = {"model": SERVED, "prompt": "x", "max_tokens": 4, **extra}
    assert words in _error(httpx.post(f"{tiny_stack.http}/v1/completions", json=body,
                                      timeout=30))
    chat = {"model": SERVED, "messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
            **extra}
    assert words in _error(httpx.post(f"{tiny_stack.http}/v1/chat/completions", json=chat,
                                      timeout=30))
    tiny_stack.wait_all_blocks_back()


def test_grpc_bad_constraints_name_the_field(tiny_stack: Clients) -> None:
    for constraint, words in [
        (gpb.StructuredOutput(), "set one of"),
        (gpb.StructuredOutput(json_object=False), "must be true"),
        (gpb.StructuredOutput(json_schema='{"type": 3}'), "sampling.structured_output"),
        (gpb.StructuredOutput(regex="[z-a]"), "sampling.structured_output"),
    ]:
        with pytest.raises(grpc.RpcError) as refused:
            tiny_stack.gateway.Complete(gpb.CompleteRequest(
                text="x", sampling=sampling(4, structured_output=constraint)))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert words in refused.value.details(), refused.value.details()
    tiny_stack.wait_all_blocks_back()


def test_a_client_that_leaves_mid_output_leaves_nothing_behind(client: openai.OpenAI,
                                                               tiny_stack: Clients) -> None:
    schema = {"type": "array", "items": {"type": "string"}, "minItems": 50}
    stream = client.chat.completions.create(
        model=SERVED, messages=[{"role": "user", "content": QUESTION}], max_tokens=400,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
        stream=True)
    received = [chunk for _, chunk in zip(range(5), stream, strict=False)]
    stream.close()
    assert received
    tiny_stack.wait_all_blocks_back()
