"""Tool calling on chat completions: OpenAI's `tools` and `tool_choice`, in the Hermes format.

The model sees the tools through its chat template (`tools=`), and calls one by writing
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (whitespace around the JSON
allowed): the format of Qwen2.5's and Hermes' templates, and of the template shipped for
models whose own has no tools (models/chat_templates/hermes_tools.jinja, --chat-template).
`auto` leaves the choice to the model and parses what it wrote; `required` and a named
function are enforced with structured output (a Lark grammar that embeds each function's
parameters as a JSON Schema); `none` renders no tools and parses nothing.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from common.errors import InvalidArgument
from common.structured_output import JSON_WHITESPACE, StructuredOutput

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)
MAX_TOOLS = 128


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    arguments: str  # JSON text, as the response gave it


class AssistantToolCall(BaseModel):
    """A tool call the assistant made, sent back in the conversation."""

    model_config = ConfigDict(extra="forbid")
    id: str
    type: Literal["function"]
    function: ToolCallFunction


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {"id": self.id, "type": "function",
                                "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def tools_in_use(tools: list[ToolDef] | None, choice: ToolChoice | None) -> list[ToolDef]:
    """The tools the model is shown (none with tool_choice none); checks the choice."""
    if choice is not None and tools is None:
        raise InvalidArgument("tool_choice needs tools")
    if not tools:
        if tools is not None:
            raise InvalidArgument("tools is empty: send at least one, or leave it out")
        return []
    if len(tools) > MAX_TOOLS:
        raise InvalidArgument(f"tools has {len(tools)} functions; at most {MAX_TOOLS}")
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise InvalidArgument("tools: two functions have the same name")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise InvalidArgument(
            f"tool_choice names {choice.function.name!r}, which is not one of tools")
    return [] if choice == "none" else tools


def forced_constraint(tools: list[ToolDef], choice: ToolChoice | None,
                      parallel: bool) -> StructuredOutput | None:
    """`required` (one call or more, of any tool; one with parallel_tool_calls false) or a
    named function (one call of it): the grammar the output must follow; else None."""
    if isinstance(choice, NamedToolChoice):
        chosen = [t for t in tools if t.function.name == choice.function.name]
        return StructuredOutput("grammar", _grammar(chosen, many=False))
    if choice == "required":
        return StructuredOutput("grammar", _grammar(tools, many=parallel))
    return None


def _grammar(tools: list[ToolDef], many: bool) -> str:
    """Lark (llguidance's dialect): each call's arguments are its parameters' JSON Schema."""
    rules = []
    for i, tool in enumerate(tools):
        schema = dict(tool.function.parameters or {"type": "object"})
        # The same bound on JSON whitespace as a json_schema constraint's (a schema's own
        # "x-guidance" options win).
        schema["x-guidance"] = {"whitespace_pattern": JSON_WHITESPACE,
                                **schema.get("x-guidance", {})}
        head = json.dumps(f'{OPEN}\n{{"name": {json.dumps(tool.function.name)}, "arguments": ')
        tail = json.dumps(f"}}\n{CLOSE}")
        rules.append(f"call{i}: {head} args{i} {tail}\nargs{i}: %json {json.dumps(schema)}")
    calls = " | ".join(f"call{i}" for i in range(len(tools)))
    start = 'start: call ("\\n" call)*' if many else "start: call"
    return "\n".join([start, f"call: {calls}", *rules]) + "\n"


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """The content before the first call (None when empty) and the calls the text holds.
    A block that is not a JSON object with a string name stays in the content."""
    calls: list[ToolCall] = []
    for match in _CALL.finditer(text):
        call = _call(match.group(1))
        if call is None:
            return text or None, []  # not a call after all: all of it is content
        calls.append(call)
    if not calls:
        return text or None, []
    content = text[: text.index(OPEN)]
    return (content if content.strip() else None), calls


def _call(body: str) -> ToolCall | None:
    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
        return None
    arguments = parsed.get("arguments", parsed.get("parameters", {}))
    return ToolCall(id=f"call_{secrets.token_hex(12)}", name=parsed["name"],
                    arguments=json.dumps(arguments))


class StreamedToolCalls:
    """One streamed choice: text that cannot start a call goes out as content at once; from
    the first `<tool_call>` on it is held, and parsed into calls when the choice ends."""

    def __init__(self) -> None:
        self.held = ""
        self.calling = False

    def feed(self, text: str) -> str:
        """The content to send now."""
        if self.calling:
            self.held += text
            return ""
        pending = self.held + text
        at = pending.find(OPEN)
        if at >= 0:
            self.calling, self.held = True, pending[at:]
            return pending[:at]
        keep = _partial_open(pending)
        self.held = pending[len(pending) - keep:] if keep else ""
        return pending[: len(pending) - keep]

    def finish(self) -> tuple[str, list[ToolCall]]:
        """What is left: content to send, and the calls."""
        held, self.held = self.held, ""
        if not self.calling:
            return held, []
        content, calls = parse_tool_calls(held)
        return ("", calls) if calls else (content or "", [])


def _partial_open(text: str) -> int:
    """How many characters at the end of `text` could begin `<tool_call>`."""
    for size in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-size:]):
            return size
    return 0
