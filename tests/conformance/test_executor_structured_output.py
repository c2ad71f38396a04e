"""SamplingParams.structured_output: an executor whose Describe says structured_output
applies the constraint (greedy output equals the reference model's argmax under llguidance's
mask, generated tokens sent as history are replayed, a bad constraint or a forbidden token is
INVALID_ARGUMENT); one that says false refuses it with UNIMPLEMENTED, holding nothing."""

from __future__ import annotations

import json

import grpc
import pytest

from common.structured_output import StructuredOutput
from pagedkv.executor.v1 import executor_pb2 as pb
from tests.executor.oracle import reference_constrained

from .conftest import (
    ROOT,
    SIMULATED_SKIP,
    Executor,
    Reference,
    is_simulated,
    reference_logprobs,
)

pytestmark = pytest.mark.conformance
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0,
                                                 "maximum": 99}, "b": {"enum": ["x", "y"]}},
          "required": ["a", "b"], "additionalProperties": False,
          "x-guidance": {"whitespace_flexible": False, "whitespace_pattern": None}}
CONSTRAINT = pb.StructuredOutput(json_schema=json.dumps(SCHEMA))
PROMPT = [5, 17, 41, 99, 23, 8]
MAX_NEW = 32


def _require_structured_output(executor: Executor) -> None:
    if not executor.info.structured_output:
        simulated = f"{SIMULATED_SKIP}: " if is_simulated(executor) else ""
        pytest.skip(
            f"{simulated}the executor under test reports structured_output = false "
            "(Describe), so the gateway never sends it a constraint "
            "(test_applied_or_refused_as_describe_says checks that it refuses one); these "
            "cases run against an executor that applies them, e.g. this project's: "
            ".venv/bin/python -m pytest -q tests/conformance")


def _model_dir(pytestconfig: pytest.Config, executor: Executor) -> str:
    return pytestconfig.getoption("reference_model") or str(
        ROOT / "models" / executor.info.model_name)


def _reference(reference: Reference, model_dir: str, executor: Executor) -> list[int]:
    return reference_constrained(
        lambda tokens: reference_logprobs(reference, tokens)[-1], PROMPT, model_dir,
        executor.info.vocab_size, tuple(executor.info.eos_token_ids),
        StructuredOutput("json_schema", CONSTRAINT.json_schema), MAX_NEW)


def _run(executor: Executor, rid: str, first: pb.SequenceWork) -> list[int]:
    out = [executor.execute(first).tokens[0].token_id]
    while len(out) < MAX_NEW and out[-1] not in executor.info.eos_token_ids:
        out.append(executor.execute(executor.work(rid, [out[-1]])).tokens[0].token_id)
    return out


def test_applied_or_refused_as_describe_says(
    executor: Executor, reference: Reference, pytestconfig: pytest.Config
) -> None:
    # Describe's structured_output true: greedy output is the reference model's argmax under
    # the constraint's mask, to EOS. False: UNIMPLEMENTED, and nothing is held.
    if executor.info.structured_output:
        out = _run(executor, "constrained", executor.work(
            "constrained", PROMPT, num_prompt_tokens=len(PROMPT),
            structured_output=CONSTRAINT))
        executor.forget("constrained")
        assert out == _reference(reference, _model_dir(pytestconfig, executor), executor)
        assert out[-1] in executor.info.eos_token_ids, "the object completes"
        return
    work = executor.work("unconstrained-only", PROMPT, num_prompt_tokens=len(PROMPT),
                         structured_output=CONSTRAINT)
    with pytest.raises(grpc.RpcError) as refused:
        executor.execute(work)
    assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "structured_output" in refused.value.details()
    executor.held.pop("unconstrained-only")  # nothing is held: the same id starts afresh
    executor.blocks.free.extend(executor.tables.pop("unconstrained-only"))
    executor.execute(executor.work("unconstrained-only", PROMPT))
    executor.forget("unconstrained-only")


def test_generated_tokens_sent_as_history_are_replayed(executor: Executor) -> None:
    # A request arriving with generated tokens already computed (moved from another
    # executor: its blocks and history_token_ids) goes on exactly as the straight run did.
    _require_structured_output(executor)
    straight = _run(executor, "straight", executor.work(
        "straight", PROMPT, num_prompt_tokens=len(PROMPT), structured_output=CONSTRAINT))
    executor.forget("straight")
    cut = 4
    assert len(straight) > cut + 1
    head = executor.work("moved-from", PROMPT + straight[:cut], sample=False)
    executor.execute(head)
    table = executor.tables.pop("moved-from")
    executor.held.pop("moved-from")
    executor.stub.Release(pb.ReleaseRequest(request_ids=["moved-from"]))  # its blocks stay
    start = len(PROMPT) + cut
    moved = pb.SequenceWork(
        request_id="moved", token_ids=[straight[cut]], start_position=start, sample=True,
        history_token_ids=PROMPT + straight[:cut],
        sampling=pb.SamplingParams(num_prompt_tokens=len(PROMPT), structured_output=CONSTRAINT),
        delta=pb.BlockTableDelta(block_ids=table + executor.blocks.take(1)))
    executor.tables["moved"] = list(moved.delta.block_ids)
    executor.held["moved"] = start + 1
    rest = _run(executor, "moved", moved)
    executor.forget("moved")
    assert straight[: cut + 1] + rest == straight


@pytest.mark.parametrize("constraint, words", [
    (pb.StructuredOutput(json_schema='{"type": "objekt"}'), "Invalid type"),
    (pb.StructuredOutput(regex="(unclosed"), "unclosed group"),
    (pb.StructuredOutput(choice=pb.Choices()), "at least one"),
    (pb.StructuredOutput(), "set one of"),
])
def test_a_bad_constraint_is_invalid_argument(executor: Executor, constraint: pb.StructuredOutput,
                                              words: str) -> None:
    _require_structured_output(executor)
    work = executor.work("bad-constraint", PROMPT, num_prompt_tokens=len(PROMPT),
                         structured_output=constraint)
    with pytest.raises(grpc.RpcError) as refused:
        executor.execute(work)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in refused.value.details()
    executor.held.pop("bad-constraint")
    executor.blocks.free.extend(executor.tables.pop("bad-constraint"))


def test_a_generated_token_the_constraint_forbids_is_invalid_argument(
        executor: Executor) -> None:
    _require_structured_output(executor)
    first = _run(executor, "forbidden", executor.work(
        "forbidden", PROMPT, num_prompt_tokens=len(PROMPT),
        structured_output=pb.StructuredOutput(regex="[0-9]{8}")))[0]
    executor.forget("forbidden")
    executor.execute(executor.work("forbidden-2", PROMPT, num_prompt_tokens=len(PROMPT),
                                   structured_output=pb.StructuredOutput(regex="[0-9]{8}")))
    eos = executor.info.eos_token_ids[0]
    with pytest.raises(grpc.RpcError) as refused:
        executor.execute(executor.work("forbidden-2", [eos]))  # an EOS after no digit
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not allowed by sampling.structured_output" in refused.value.details()
    executor.held["forbidden-2"] -= 1
    assert executor.execute(executor.work("forbidden-2", [first])).tokens
    executor.forget("forbidden-2")
