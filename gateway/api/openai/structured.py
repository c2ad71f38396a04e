"""Structured output on the HTTP API: OpenAI's `response_format` and vLLM's
`structured_outputs`, as one constraint (common/structured_output.py).

OpenAI: {"type": "text"} (none), {"type": "json_object"}, {"type": "json_schema",
"json_schema": {"name", "schema", "strict", "description"}}. The schema is enforced whether or
not `strict` is set. vLLM: exactly one of `json` (a schema, as an object or as JSON text),
`regex`, `choice`, `grammar` (Lark or GBNF), `json_object`. A request sends at most one
constraint in all.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from common.errors import InvalidArgument
from common.structured_output import StructuredOutput


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's structured_outputs: one of its fields."""

    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] | bool | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


def constraint(response_format: ResponseFormat | None,
               structured_outputs: StructuredOutputs | None) -> StructuredOutput | None:
    """The request's one constraint, or None; InvalidArgument naming what is wrong."""
    found = [c for c in (_from_response_format(response_format),
                         _from_structured_outputs(structured_outputs)) if c is not None]
    if len(found) > 1:
        raise InvalidArgument(
            "response_format and structured_outputs both constrain the output: send one")
    return found[0] if found else None


def _from_response_format(fmt: ResponseFormat | None) -> StructuredOutput | None:
    if fmt is None or fmt.type == "text":
        if fmt is not None and fmt.json_schema is not None:
            raise InvalidArgument("response_format.json_schema goes with type json_schema")
        return None
    if fmt.type == "json_object":
        if fmt.json_schema is not None:
            raise InvalidArgument("response_format.json_schema goes with type json_schema")
        return StructuredOutput("json_object")
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise InvalidArgument(
            "response_format.json_schema.schema is missing: type json_schema needs a schema")
    return StructuredOutput("json_schema", json.dumps(fmt.json_schema.schema_))


def _from_structured_outputs(params: StructuredOutputs | None) -> StructuredOutput | None:
    if params is None:
        return None
    found: list[StructuredOutput] = []
    if params.json_ is not None:
        schema = params.json_
        found.append(StructuredOutput(
            "json_schema", schema if isinstance(schema, str) else json.dumps(schema)))
    if params.regex is not None:
        found.append(StructuredOutput("regex", params.regex))
    if params.choice is not None:
        found.append(StructuredOutput("choice", choices=tuple(params.choice)))
    if params.grammar is not None:
        found.append(StructuredOutput("grammar", params.grammar))
    if params.json_object:
        found.append(StructuredOutput("json_object"))
    if len(found) != 1:
        names = ", ".join(c.kind for c in found) or "none"
        raise InvalidArgument(
            "structured_outputs: set exactly one of json, regex, choice, grammar, "
            f"json_object (got {names})")
    return found[0]
