"""Tool calling through the whole stack with the official client, on a second model family
(the tiny-qwen2 preset, random weights) with the shipped Hermes template (--chat-template):
forced calls (a named function, required) come back as tool_calls whose arguments validate
against the function's parameters, whole and streamed; the round trip (the call and the
tool's answer sent back) renders and answers; bad tool fields are 400s holding nothing."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from e2e_stack import Clients, http_base, start_stack

from common.model_dirs import PRESETS_DIR

SERVED = "tiny-qwen2"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"enum": ["UTC", "CET", "JST"]}}, "required": ["zone"],
        "additionalProperties": False}}}
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Clients]:
    log_dir: Path = tmp_path_factory.mktemp("tools")
    template = PRESETS_DIR / "chat_templates" / "hermes_tools.jinja"
    started = start_stack(log_dir, model=str(PRESETS_DIR / SERVED),
                          executor_args=("--load-format", "dummy", "--num-blocks", "256"),
                          gateway_args=("--chat-template", str(template)))
    clients = Clients(started, http=http_base(started))
    yield clients
    clients.close()
    started.stop()


@pytest.fixture(scope="module")
def client(stack: Clients) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.http}/v1", api_key="unused", max_retries=0,
                         timeout=60)


def _check_call(call: Any, names: set[str]) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in names
    jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def test_a_named_function_and_required_come_back_as_tool_calls(client: openai.OpenAI,
                                                               stack: Clients) -> None:
    def ask(seed: int) -> tuple[Any, Any]:
        named = client.chat.completions.create(
            model=SERVED, messages=ASK, tools=[WEATHER, TIME], max_tokens=300, seed=seed,
            temperature=1.0,
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
        required = client.chat.completions.create(
            model=SERVED, messages=ASK, tools=[WEATHER, TIME], max_tokens=300, seed=seed,
            temperature=1.0, tool_choice="required", parallel_tool_calls=False, n=2)
        return named, required

    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(ask, range(2)))
    for named, required in answers:
        choice = named.choices[0]  # a named function: finish_reason stop, as OpenAI's
        assert choice.finish_reason == "stop" and choice.message.content is None
        assert len(choice.message.tool_calls) == 1
        _check_call(choice.message.tool_calls[0], {"get_weather"})
        for choice in required.choices:
            assert choice.finish_reason == "tool_calls"
            assert len(choice.message.tool_calls) == 1
            _check_call(choice.message.tool_calls[0], {"get_weather", "get_time"})
    stack.wait_all_blocks_back()


def test_the_round_trip_renders_the_call_and_the_answer(client: openai.OpenAI,
                                                        stack: Clients) -> None:
    first = client.chat.completions.create(
        model=SERVED, messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=300)
    call = first.choices[0].message.tool_calls[0]
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function",
         "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 18}'}]
    answer = client.chat.completions.create(model=SERVED, messages=history, tools=[WEATHER],
                                            tool_choice="none", max_tokens=8, temperature=0)
    assert answer.choices[0].message.tool_calls is None
    assert answer.choices[0].message.content
    # The prompt holds the call and the answer, as the template renders them (/tokenize
    # renders a chat completion's prompt, tools and all).
    rendered = httpx.post(f"{stack.http}/tokenize", json={
        "model": SERVED, "messages": history, "return_token_strs": False}, timeout=30).json()
    assert rendered["count"] == answer.usage.prompt_tokens
    text = httpx.post(f"{stack.http}/detokenize", json={
        "model": SERVED, "tokens": rendered["tokens"]}, timeout=30).json()["prompt"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": ' in text
    assert '<tool_response>\n{"celsius": 18}\n</tool_response>' in text
    stack.wait_all_blocks_back()


def test_streamed_calls_arrive_as_tool_call_deltas(client: openai.OpenAI,
                                                   stack: Clients) -> None:
    stream = client.chat.completions.create(
        model=SERVED, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
        max_tokens=300, temperature=1.0, seed=7, stream=True)
    calls: dict[int, dict[str, str]] = {}
    reasons = []
    for chunk in stream:
        for choice in chunk.choices:
            reasons.append(choice.finish_reason)
            for delta in choice.delta.tool_calls or ():
                got = calls.setdefault(delta.index, {"name": "", "arguments": "", "id": ""})
                got["id"] += delta.id or ""
                got["name"] += delta.function.name or ""
                got["arguments"] += delta.function.arguments or ""
            assert not choice.delta.content, "a forced call has no content"
    assert reasons[-1] == "tool_calls" and calls
    for got in calls.values():
        assert got["id"].startswith("call_")
        jsonschema.validate(json.loads(got["arguments"]), PARAMETERS[got["name"]])
    stack.wait_all_blocks_back()


@pytest.mark.parametrize("fields, words", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not one of tools"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}},
     "constrains the output already"),
    ({"tools": [WEATHER, WEATHER]}, "same name"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "objekt"}}}], "tool_choice": "required"}, "Invalid type"),
])
def test_bad_tool_fields_are_400(stack: Clients, fields: dict[str, Any], words: str) -> None:
    body = {"model": SERVED, "messages": ASK, "tools": [WEATHER], "max_tokens": 4, **fields}
    response = httpx.post(f"{stack.http}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert words in response.json()["error"]["message"]
    stack.wait_all_blocks_back()
