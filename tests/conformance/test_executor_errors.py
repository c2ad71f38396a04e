"""Bad input gets a precise status, changes nothing, and the executor keeps serving."""

from __future__ import annotations

import random
from collections.abc import Callable

import grpc
import pytest

from pagedkv.executor.v1 import executor_pb2 as pb

from .conftest import Executor, Reference, reference_generate, require_uses_sampled_tokens

pytestmark = pytest.mark.conformance
INVALID, NOT_FOUND = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND
PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION

# Each case builds a bad ExecuteRequest from (executor, the witness's next decode work).
Case = Callable[[Executor, pb.SequenceWork], pb.ExecuteRequest]


def _new(executor: Executor, rid: str = "bad-new", **fields: object) -> pb.SequenceWork:
    work = pb.SequenceWork(
        request_id=rid,
        sampling=pb.SamplingParams(),
        token_ids=[5, 6],
        delta=pb.BlockTableDelta(start_index=0, block_ids=[0]),
        sample=True,
    )
    for name, value in fields.items():
        if isinstance(value, pb.BlockTableDelta | pb.SamplingParams):
            getattr(work, name).CopyFrom(value)
        elif isinstance(value, list):
            del getattr(work, name)[:]
            getattr(work, name).extend(value)
        else:
            setattr(work, name, value)
    return work


def _with(witness: pb.SequenceWork, **fields: object) -> pb.SequenceWork:
    work = pb.SequenceWork()
    work.CopyFrom(witness)
    for name, value in fields.items():
        if isinstance(value, list):
            del getattr(work, name)[:]
            getattr(work, name).extend(value)
        elif isinstance(value, pb.SamplingParams | pb.BlockTableDelta):
            getattr(work, name).CopyFrom(value)
        else:
            setattr(work, name, value)
    return work


def _compact(work: pb.SequenceWork, **fields: object) -> pb.ExecuteRequest:
    """`work` (one decode token) in the compact decode columns."""
    return pb.ExecuteRequest(
        decode_request_ids=[work.request_id],
        decode_token_ids=list(work.token_ids),
        decode_positions=[work.start_position],
        **fields,  # type: ignore[arg-type]
    )


def _past_prefix(executor: Executor, **fields: object) -> pb.SequenceWork:
    """A new penalised request starting after a one-block cached prefix, with its history."""
    block_size = executor.info.block_size
    return _new(
        executor,
        start_position=block_size,
        delta=pb.BlockTableDelta(start_index=0, block_ids=[0, 1]),
        sampling=pb.SamplingParams(frequency_penalty=0.5),
        **{"history_token_ids": [5] * block_size, **fields},
    )


# A new request's bad SamplingParams fields (from the executor's Describe).
BAD_SAMPLING: dict[str, Callable[[Executor], dict[str, object]]] = {
    "min_p_above_one": lambda e: {"min_p": 1.5},
    "min_p_negative": lambda e: {"min_p": -0.25},
    "min_p_nan": lambda e: {"min_p": float("nan")},
    "presence_penalty_above_two": lambda e: {"presence_penalty": 2.5},
    "frequency_penalty_below_minus_two": lambda e: {"frequency_penalty": -2.5},
    "frequency_penalty_inf": lambda e: {"frequency_penalty": float("inf")},
    "repetition_penalty_negative": lambda e: {"repetition_penalty": -1.0},
    "repetition_penalty_above_65536": lambda e: {"repetition_penalty": 1e6},
    "logit_bias_token_outside_vocab": lambda e: {"logit_bias": {e.info.vocab_size: 1.0}},
    "logit_bias_above_100": lambda e: {"logit_bias": {5: 150.0}},
    "logit_bias_below_minus_100": lambda e: {"logit_bias": {5: -101.0}},
    "stop_token_id_outside_vocab": lambda e: {
        "min_tokens": 2, "stop_token_ids": [2, e.info.vocab_size]},
    "stop_token_ids_naming_every_token": lambda e: {
        "min_tokens": 2, "stop_token_ids": list(range(e.info.vocab_size))},
    "num_prompt_tokens_past_max_model_len": lambda e: {
        "num_prompt_tokens": e.info.max_model_len + 1},
    "top_logprobs_above_20": lambda e: {"top_logprobs": 21},
}


def _with_new_sampling(fields: Callable[[Executor], dict[str, object]]) -> Case:
    """The witness's decode beside a new request with these sampling fields."""
    return lambda e, w: pb.ExecuteRequest(
        seqs=[w, _new(e, sampling=pb.SamplingParams(**fields(e)))]  # type: ignore[arg-type]
    )


def _copy(src: int, dst: int) -> pb.BlockCopy:
    return pb.BlockCopy(src_block_id=src, dst_block_id=dst)


CASES: dict[str, tuple[Case, grpc.StatusCode]] = {
    "block_id_out_of_range": (
        lambda e, w: pb.ExecuteRequest(
            seqs=[_new(e, delta=pb.BlockTableDelta(block_ids=[e.info.num_blocks]))]
        ),
        INVALID,
    ),
    "copy_block_out_of_range": (
        lambda e, w: pb.ExecuteRequest(seqs=[w], copies=[_copy(0, e.info.num_blocks)]),
        INVALID,
    ),
    "swap_out_cpu_block_out_of_range": (
        lambda e, w: pb.ExecuteRequest(seqs=[w], swap_out=[_copy(0, e.info.num_cpu_blocks)]),
        INVALID,
    ),
    "swap_in_cpu_block_out_of_range": (
        lambda e, w: pb.ExecuteRequest(seqs=[w], swap_in=[_copy(e.info.num_cpu_blocks, 0)]),
        INVALID,
    ),
    "start_position_behind": (
        lambda e, w: pb.ExecuteRequest(seqs=[_with(w, start_position=w.start_position - 1)]),
        INVALID,
    ),
    "start_position_ahead": (
        lambda e, w: pb.ExecuteRequest(seqs=[_with(w, start_position=w.start_position + 1)]),
        INVALID,
    ),
    "unknown_request_id": (
        lambda e, w: pb.ExecuteRequest(seqs=[_with(w, request_id="never-seen")]),
        NOT_FOUND,
    ),
    "sampling_for_active_request": (
        lambda e, w: pb.ExecuteRequest(seqs=[_with(w, sampling=pb.SamplingParams())]),
        INVALID,
    ),
    "over_max_num_batched_tokens": (
        lambda e, w: pb.ExecuteRequest(
            seqs=[w, _new(e, token_ids=[5] * e.info.max_num_batched_tokens)]
        ),
        INVALID,
    ),
    "over_max_num_seqs": (
        lambda e, w: pb.ExecuteRequest(
            seqs=[w, *(_new(e, f"bad-{i}", token_ids=[5]) for i in range(e.info.max_num_seqs))]
        ),
        INVALID,
    ),
    "empty_token_ids": (lambda e, w: pb.ExecuteRequest(seqs=[_with(w, token_ids=[])]), INVALID),
    "negative_temperature": (
        lambda e, w: pb.ExecuteRequest(
            seqs=[w, _new(e, sampling=pb.SamplingParams(temperature=-1.0))]
        ),
        INVALID,
    ),
    "top_p_above_one": (
        lambda e, w: pb.ExecuteRequest(seqs=[w, _new(e, sampling=pb.SamplingParams(top_p=1.5))]),
        INVALID,
    ),
    "top_p_negative": (
        lambda e, w: pb.ExecuteRequest(seqs=[w, _new(e, sampling=pb.SamplingParams(top_p=-0.1))]),
        INVALID,
    ),
    **{
        f"sampling_{name}": (_with_new_sampling(fields), INVALID)
        for name, fields in BAD_SAMPLING.items()
    },
    "history_token_ids_of_the_wrong_length": (
        lambda e, w: pb.ExecuteRequest(seqs=[w, _past_prefix(e, history_token_ids=[5, 6])]),
        INVALID,
    ),
    "history_token_id_outside_vocab": (
        lambda e, w: pb.ExecuteRequest(seqs=[w, _past_prefix(
            e, history_token_ids=[5] * (e.info.block_size - 1) + [e.info.vocab_size])]),
        INVALID,
    ),
    "history_token_ids_for_a_held_request": (
        lambda e, w: pb.ExecuteRequest(
            seqs=[_with(w, history_token_ids=[5] * w.start_position)]
        ),
        INVALID,
    ),
    "penalties_past_position_0_without_history_token_ids": (
        lambda e, w: pb.ExecuteRequest(seqs=[w, _past_prefix(e, history_token_ids=[])]),
        INVALID,
    ),
    "table_longer_than_max_model_len": (
        lambda e, w: pb.ExecuteRequest(
            seqs=[
                _new(
                    e,
                    delta=pb.BlockTableDelta(
                        block_ids=[0] * (-(-e.info.max_model_len // e.info.block_size) + 1)
                    ),
                )
            ]
        ),
        INVALID,
    ),
    "token_id_outside_vocab": (
        lambda e, w: pb.ExecuteRequest(seqs=[_with(w, token_ids=[e.info.vocab_size])]),
        INVALID,
    ),
    "duplicate_request_in_step": (lambda e, w: pb.ExecuteRequest(seqs=[w, w]), INVALID),
    "compact_decode_columns_of_unequal_length": (
        lambda e, w: pb.ExecuteRequest(
            decode_request_ids=[w.request_id], decode_token_ids=list(w.token_ids)
        ),
        INVALID,
    ),
    "compact_decode_positions_without_ids": (
        lambda e, w: pb.ExecuteRequest(seqs=[w], decode_positions=[w.start_position]),
        INVALID,
    ),
    "compact_decode_unknown_request_id": (
        lambda e, w: _compact(_with(w, request_id="never-seen")),
        NOT_FOUND,
    ),
    "compact_decode_position_ahead": (
        lambda e, w: _compact(_with(w, start_position=w.start_position + 1)),
        INVALID,
    ),
    "compact_decode_token_outside_vocab": (
        lambda e, w: _compact(_with(w, token_ids=[e.info.vocab_size])),
        INVALID,
    ),
    "compact_decode_also_in_seqs": (lambda e, w: _compact(w, seqs=[w]), INVALID),
    # use_sampled_token (only sent to executors whose Describe reports uses_sampled_tokens)
    "use_sampled_token_on_a_new_request": (
        lambda e, w: pb.ExecuteRequest(seqs=[w, _new(e, use_sampled_token=True)]),
        PRECONDITION,
    ),
    "compact_decode_use_sampled_token_of_another_length": (
        lambda e, w: _compact(w, decode_use_sampled_token=[True, True]),
        INVALID,
    ),
    "decode_use_sampled_token_without_compact_decodes": (
        lambda e, w: pb.ExecuteRequest(seqs=[w], decode_use_sampled_token=[True]),
        INVALID,
    ),
    "use_sampled_token_for_a_request_not_held": (
        lambda e, w: _compact(_with(w, request_id="never-seen", token_ids=[0]),
                              decode_use_sampled_token=[True]),
        NOT_FOUND,
    ),
    "use_sampled_token_at_the_wrong_position": (
        lambda e, w: pb.ExecuteRequest(seqs=[_with(w, token_ids=[0], use_sampled_token=True,
                                                   start_position=w.start_position + 1)]),
        INVALID,
    ),
    "prompt_logprobs_without_prompt_token_ids": (
        lambda e, w: pb.ExecuteRequest(seqs=[w, _new(e, sampling=pb.SamplingParams(
            prompt_logprobs=1, num_prompt_tokens=2))]),
        INVALID,
    ),
    "prompt_token_ids_without_prompt_logprobs": (
        lambda e, w: pb.ExecuteRequest(seqs=[w, _new(e, prompt_token_ids=[5, 6])]),
        INVALID,
    ),
    "prompt_token_ids_other_than_the_tokens_sent": (
        lambda e, w: pb.ExecuteRequest(seqs=[w, _new(e, prompt_token_ids=[5, 7], sampling=(
            pb.SamplingParams(prompt_logprobs=0, num_prompt_tokens=2)))]),
        INVALID,
    ),
    "prompt_logprobs_without_num_prompt_tokens": (
        lambda e, w: pb.ExecuteRequest(seqs=[w, _new(e, prompt_token_ids=[5, 6], sampling=(
            pb.SamplingParams(prompt_logprobs=0)))]),
        INVALID,
    ),
    "previous_step_id_naming_the_call_itself": (
        lambda e, w: pb.ExecuteRequest(seqs=[w], step_id=7, previous_step_id=7),
        INVALID,
    ),
}
# Cases of the optional part of the contract (Describe's uses_sampled_tokens).
SAMPLED_TOKEN_CASES = {c for c in CASES if "use_sampled_token" in c or "step_id" in c}


@pytest.fixture
def witness(executor: Executor, reference: Reference) -> tuple[list[int], list[int]]:
    """A held request (prompt + its first sampled token) that every bad step must not disturb."""
    prompt = [random.Random(11).randrange(3, executor.info.vocab_size) for _ in range(21)]
    executor.forget("witness")
    reply = executor.execute(executor.work("witness", prompt))
    return prompt, [reply.tokens[0].token_id]


@pytest.mark.parametrize("case", list(CASES))
def test_bad_execute_is_rejected_without_effect(
    executor: Executor,
    reference: Reference,
    witness: tuple[list[int], list[int]],
    case: str,
) -> None:
    # The bad step (which carries the witness's valid decode) fails with its status; then the
    # witness continues exactly like the reference, and no other state appeared.
    prompt, output = witness
    if case in SAMPLED_TOKEN_CASES:
        require_uses_sampled_tokens(executor)
    build, code = CASES[case]
    next_work = pb.SequenceWork(
        request_id="witness",
        token_ids=[output[-1]],
        start_position=len(prompt),
        sample=True,
    )
    assert executor.execute().num_tokens == 0  # an empty step is valid
    with pytest.raises(grpc.RpcError) as err:
        executor.stub.Execute(build(executor, next_work))
    assert err.value.code() == code, err.value.details()
    assert err.value.details(), "the status carries a message saying what was wrong"
    reply = executor.execute(next_work)
    output.append(reply.tokens[0].token_id)
    executor.held["witness"] += 1
    for _ in range(2):
        output.append(executor.execute(executor.work("witness", [output[-1]])).tokens[0].token_id)
    assert output == reference_generate(reference, prompt, 4)
    with pytest.raises(grpc.RpcError) as err:  # the bad step's new request was not created
        executor.execute(_with(next_work, request_id="bad-new", start_position=2))
    assert err.value.code() == NOT_FOUND
    executor.forget("witness")
