"""Tool calling's parts before any server: the Hermes-format parser (whole and streamed in
any split), the grammar that forces a call (llguidance accepts the calls it should and
refuses others), the checks on tools and tool_choice, and the shipped chat template."""

from __future__ import annotations

import functools
import json
from typing import Any

import llguidance
import pytest

from common.errors import InvalidArgument
from common.model_dirs import DEFAULT_MODEL, PRESETS_DIR
from common.structured_output import grammar_text, load_tokenizer
from gateway.api.openai.protocol import ChatCompletionRequest
from gateway.api.openai.tools import (
    NamedToolChoice,
    StreamedToolCalls,
    ToolDef,
    forced_constraint,
    parse_tool_calls,
    tools_in_use,
)
from gateway.text.tokenizer import ChatTurn, Tokenizer

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
HERMES_TEMPLATE = PRESETS_DIR / "chat_templates" / "hermes_tools.jinja"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_calls_are_parsed_out_of_the_reply() -> None:
    content, calls = parse_tool_calls("Let me look.\n" + CALL + "\n" + CALL.replace(
        "Paris", "Rome"))
    assert content == "Let me look.\n"  # as it was written (a stream sends it so)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    assert parse_tool_calls(CALL)[0] is None
    for text in ("no calls here", "<tool_call>not json</tool_call>",
                 '<tool_call>{"arguments": {}}</tool_call>', "<tool_call>{\"name\": 1}"):
        assert parse_tool_calls(text) == (text, [])


@pytest.mark.parametrize("size", [1, 2, 3, 5, 11, 1000])
def test_a_streamed_reply_gives_the_same_content_and_calls_in_any_split(size: int) -> None:
    text = "Sure <tool thing> then " + CALL
    stream, sent = StreamedToolCalls(), ""
    for start in range(0, len(text), size):
        sent += stream.feed(text[start:start + size])
    rest, calls = stream.finish()
    assert sent + rest == "Sure <tool thing> then "
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather",
                                                                   {"city": "Paris"})]
    plain = StreamedToolCalls()
    assert plain.feed("ends with <tool_ca") == "ends with "
    assert plain.finish() == ("<tool_ca", [])


@functools.lru_cache(maxsize=1)
def _lltok() -> Any:
    return load_tokenizer(str(DEFAULT_MODEL), 49152, (2,))


def _matcher(tools: list[dict[str, Any]], choice: Any, parallel: bool) -> Any:
    defs = [ToolDef.model_validate(t) for t in tools]
    constraint = forced_constraint(defs, choice, parallel)
    assert constraint is not None
    lltok = _lltok()
    return lltok, llguidance.LLMatcher(lltok, grammar_text(constraint, "test"))


def _accepts(lltok: Any, matcher: Any, text: str) -> bool:
    tokens = lltok.tokenize_str(text)
    return bool(matcher.validate_tokens(tokens) == len(tokens) and (
        matcher.consume_tokens(tokens) and matcher.is_accepting()))


def test_forced_calls_follow_the_named_function_and_its_parameters() -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    choice = NamedToolChoice.model_validate(named)
    lltok, matcher = _matcher([WEATHER, TIME], choice, True)
    assert _accepts(lltok, matcher.deep_copy(),
                    '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')
    assert not _accepts(lltok, matcher.deep_copy(), CALL)  # another function
    assert not _accepts(lltok, matcher.deep_copy(), CALL.replace(
        "get_weather", "get_time").replace('"city": "Paris"', '"zone": "EST"'))
    lltok, required = _matcher([WEATHER, TIME], "required", False)
    assert _accepts(lltok, required.deep_copy(), CALL)
    assert not _accepts(lltok, required.deep_copy(), CALL + "\n" + CALL)  # one only
    assert not _accepts(lltok, required.deep_copy(), "I will not call anything.")
    lltok, parallel = _matcher([WEATHER, TIME], "required", True)
    assert _accepts(lltok, parallel.deep_copy(), CALL + "\n" + CALL)
    # JSON whitespace inside the arguments is bounded as a json_schema constraint's is.
    assert not _accepts(lltok, required.deep_copy(), CALL.replace('{"city"', "{" + " " * 60 +
                                                                  '"city"'))
    assert _accepts(lltok, required.deep_copy(), CALL.replace('{"city"', '{\n  "city"'))


@pytest.mark.parametrize("fields, words", [
    ({"tool_choice": "required"}, "tool_choice needs tools"),
    ({"tools": []}, "tools is empty"),
    ({"tools": [WEATHER, WEATHER]}, "same name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "not one of tools"),
    ({"tools": [WEATHER], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "constrains the output already"),
    ({"messages": [{"role": "tool", "content": "18C"}]}, "tool_call_id"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                         "function": {"name": "f",
                                                                      "arguments": "{x"}}]}]},
     "not JSON"),
    ({"messages": [{"role": "user"}]}, "content is missing"),
])
def test_bad_tool_fields_name_the_problem(fields: dict[str, Any], words: str) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], **fields}
    with pytest.raises(InvalidArgument, match=words):
        request = ChatCompletionRequest.model_validate(body)
        request.prompt_input()
        request.sampling()


def test_tool_choice_none_shows_no_tools() -> None:
    tools = [ToolDef.model_validate(WEATHER)]
    assert tools_in_use(tools, "none") == []
    assert tools_in_use(tools, None) == tools


def test_the_shipped_template_shows_tools_and_a_plain_one_refuses_them() -> None:
    tools = [WEATHER]
    shipped = Tokenizer.load(str(DEFAULT_MODEL), str(HERMES_TEMPLATE))
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    text = shipped.chat_text([ChatTurn("user", "Weather in Paris?"),
                              ChatTurn("assistant", "", tool_calls=(call,)),
                              ChatTurn("tool", "18C", tool_call_id="c1")], tools=tools)
    assert json.dumps(WEATHER) in text
    assert CALL in text and "<tool_response>\n18C\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")
    with pytest.raises(InvalidArgument, match="--chat-template"):
        Tokenizer.load(str(DEFAULT_MODEL)).chat_text([ChatTurn("user", "x")], tools=tools)
