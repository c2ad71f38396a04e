"""Structured output's fields, before any server: both HTTP spellings give the same
constraint, the gRPC message round-trips, and each bad combination names what is wrong."""

from __future__ import annotations

import dataclasses
import json

import pytest

from common.errors import InvalidArgument, Unimplemented
from common.structured_output import StructuredOutput, from_oneof, to_oneof
from gateway.api.openai.protocol import ChatCompletionRequest, CompletionRequest
from gateway.api.sampling import ModelLimits, RawSampling, validate
from pagedkv.executor.v1 import executor_pb2 as epb
from pagedkv.gateway.v1 import gateway_pb2 as gpb

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
LIMITS = ModelLimits(max_model_len=512, vocab_size=512, max_n=8, pool_capacity_tokens=8192,
                     eos_token_ids=(2,), structured_output=True)


def _chat(**fields: object) -> StructuredOutput | None:
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], **fields}
    return ChatCompletionRequest.model_validate(body).sampling().structured_output


def test_both_spellings_give_the_same_constraint() -> None:
    schema = StructuredOutput("json_schema", json.dumps(SCHEMA))
    assert _chat(response_format={"type": "json_schema", "json_schema": {
        "name": "n", "schema": SCHEMA, "strict": True}}) == schema
    assert _chat(structured_outputs={"json": SCHEMA}) == schema
    assert _chat(structured_outputs={"json": json.dumps(SCHEMA)}) == schema
    assert _chat(response_format={"type": "json_object"}) == StructuredOutput("json_object")
    assert _chat(structured_outputs={"json_object": True}) == StructuredOutput("json_object")
    assert _chat(response_format={"type": "text"}) is None
    assert _chat(structured_outputs={"choice": ["a", "b"]}) == StructuredOutput(
        "choice", choices=("a", "b"))
    completion = CompletionRequest.model_validate(
        {"model": "m", "prompt": "x", "structured_outputs": {"regex": "[0-9]+"}})
    assert completion.sampling().structured_output == StructuredOutput("regex", "[0-9]+")


@pytest.mark.parametrize("fields, words", [
    ({"response_format": {"type": "json_schema"}}, "json_schema.schema is missing"),
    ({"response_format": {"type": "text", "json_schema": {"name": "n"}}}, "goes with type"),
    ({"structured_outputs": {}}, "got none"),
    ({"structured_outputs": {"regex": "a", "grammar": "b"}}, "got regex, grammar"),
    ({"structured_outputs": {"json_object": True}, "response_format": {"type": "json_object"}},
     "send one"),
])
def test_bad_combinations_name_the_problem(fields: dict[str, object], words: str) -> None:
    with pytest.raises(InvalidArgument, match=words):
        _chat(**fields)


@pytest.mark.parametrize("constraint", [
    StructuredOutput("json_schema", '{"type": "string"}'), StructuredOutput("json_object"),
    StructuredOutput("regex", "a+"), StructuredOutput("choice", choices=("x", "y z")),
    StructuredOutput("grammar", 'start: "a"'),
])
def test_the_protos_carry_each_kind_unchanged(constraint: StructuredOutput) -> None:
    for message in (gpb.StructuredOutput(), epb.StructuredOutput()):
        to_oneof(constraint, message)
        assert from_oneof(message, "f") == constraint


def test_validation_refuses_what_cannot_go_together() -> None:
    constraint = StructuredOutput("regex", "a")
    assert validate(RawSampling(structured_output=constraint), 4, LIMITS).structured_output \
        == constraint
    with pytest.raises(InvalidArgument, match="ignore_eos"):
        validate(RawSampling(structured_output=constraint, ignore_eos=True), 4, LIMITS)
    with pytest.raises(InvalidArgument, match="use_beam_search"):
        validate(RawSampling(structured_output=constraint, use_beam_search=True, n=2), 4,
                 LIMITS)
    with pytest.raises(InvalidArgument, match="unknown kind"):
        validate(RawSampling(structured_output=StructuredOutput("xml")), 4, LIMITS)
    without = dataclasses.replace(LIMITS, structured_output=False)
    with pytest.raises(Unimplemented, match="do not apply structured output"):
        validate(RawSampling(structured_output=constraint), 4, without)
