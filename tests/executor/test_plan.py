"""Step validation: every caller mistake gets its precise error and changes nothing."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch

from common.errors import InvalidArgument, NotFound, ServiceError
from executor_svc.runner import ModelRunner
from executor_svc.step import (
    BlockCopy,
    BlockTableDelta,
    SamplingParams,
    SequenceWork,
    StepRequest,
)

from .oracle import Driver, random_prompts

NUM_BLOCKS = 64  # block_size 16; max_model_len 128 -> at most 8 blocks per sequence


@pytest.fixture
def held(make_runner: Callable[..., ModelRunner]) -> tuple[ModelRunner, Driver]:
    """A runner holding 'a' (20 tokens, blocks [a0, a1]) and 'b' (5 tokens)."""
    runner = make_runner(
        num_blocks=NUM_BLOCKS, max_num_batched_tokens=64, max_num_seqs=3, max_model_len=128
    )
    driver = Driver.scattered(runner)
    prompt_a, prompt_b = random_prompts(runner.info.vocab_size, [20, 5])
    seqs = (driver.work("a", prompt_a, sample=True), driver.work("b", prompt_b, sample=True))
    runner.execute(StepRequest(seqs=seqs))
    return runner, driver


def _decode_a(driver: Driver, **changes: object) -> SequenceWork:
    work = SequenceWork(request_id="a", token_ids=(7,), start_position=20, sample=True)
    return dataclasses.replace(work, **changes)  # type: ignore[arg-type]


def _bad_steps(driver: Driver) -> dict[str, tuple[StepRequest, type[ServiceError]]]:
    free = driver.free_blocks
    new = SequenceWork("c", (5, 6), 0, BlockTableDelta(0, (free[0],)), SamplingParams(), True)
    too_many = tuple(dataclasses.replace(new, request_id=f"n{i}") for i in range(4))
    return {
        "delta_block_out_of_range": (
            StepRequest(seqs=(dataclasses.replace(new, delta=BlockTableDelta(0, (NUM_BLOCKS,))),)),
            InvalidArgument,
        ),
        "copy_block_out_of_range": (
            StepRequest(copies=(BlockCopy(0, NUM_BLOCKS),)),
            InvalidArgument,
        ),
        "swap_out_cpu_block_out_of_range": (
            StepRequest(swap_out=(BlockCopy(0, 10**6),)),
            InvalidArgument,
        ),
        "swap_in_cpu_block_out_of_range": (
            StepRequest(swap_in=(BlockCopy(10**6, 0),)),
            InvalidArgument,
        ),
        "start_position_mismatch": (
            StepRequest(seqs=(_decode_a(driver, start_position=19),)),
            InvalidArgument,
        ),
        "unknown_request": (
            StepRequest(seqs=(_decode_a(driver, request_id="ghost"),)),
            NotFound,
        ),
        "released_then_continued": (
            StepRequest(release_request_ids=("a",), seqs=(_decode_a(driver),)),
            NotFound,
        ),
        "sampling_for_held_request": (
            StepRequest(seqs=(_decode_a(driver, sampling=SamplingParams()),)),
            InvalidArgument,
        ),
        "over_token_budget": (
            StepRequest(seqs=(dataclasses.replace(new, token_ids=(5,) * 65),)),
            InvalidArgument,
        ),
        "over_sequence_budget": (StepRequest(seqs=too_many), InvalidArgument),
        "empty_tokens": (StepRequest(seqs=(_decode_a(driver, token_ids=()),)), InvalidArgument),
        "negative_temperature": (
            StepRequest(seqs=(dataclasses.replace(new, sampling=SamplingParams(-0.5)),)),
            InvalidArgument,
        ),
        "top_p_above_one": (
            StepRequest(seqs=(dataclasses.replace(new, sampling=SamplingParams(top_p=1.5)),)),
            InvalidArgument,
        ),
        "top_p_nan": (
            StepRequest(
                seqs=(dataclasses.replace(new, sampling=SamplingParams(top_p=float("nan"))),)
            ),
            InvalidArgument,
        ),
        "table_longer_than_max_model_len": (
            StepRequest(seqs=(_decode_a(driver, delta=BlockTableDelta(2, tuple(free[:7]))),)),
            InvalidArgument,
        ),
        "position_past_max_model_len": (
            StepRequest(
                seqs=(
                    dataclasses.replace(
                        new, start_position=127, delta=BlockTableDelta(0, tuple(free[:8]))
                    ),
                )
            ),
            InvalidArgument,
        ),
        "token_id_outside_vocab": (
            StepRequest(seqs=(_decode_a(driver, token_ids=(512,)),)),
            InvalidArgument,
        ),
        "duplicate_request_ids": (StepRequest(seqs=(new, new)), InvalidArgument),
        "delta_start_past_table_end": (
            StepRequest(seqs=(_decode_a(driver, delta=BlockTableDelta(3, (free[0],))),)),
            InvalidArgument,
        ),
        "blocks_do_not_cover_positions": (
            StepRequest(seqs=(dataclasses.replace(new, token_ids=(5,) * 17),)),
            InvalidArgument,
        ),
        **{name: (_new_with(new, **fields), InvalidArgument)
           for name, (fields, _) in BAD_SAMPLING.items()},
        "history_of_the_wrong_length": (
            StepRequest(seqs=(_past_prefix(new, free, history_token_ids=(5,) * 3),)),
            InvalidArgument,
        ),
        "history_token_outside_vocab": (
            StepRequest(seqs=(_past_prefix(new, free, history_token_ids=(5,) * 15 + (512,)),)),
            InvalidArgument,
        ),
        "history_for_a_held_request": (
            StepRequest(seqs=(_decode_a(driver, history_token_ids=(5,) * 20),)),
            InvalidArgument,
        ),
        "penalties_past_position_0_without_history": (
            StepRequest(seqs=(_past_prefix(new, free, sampling=SamplingParams(
                repetition_penalty=1.2)),)),
            InvalidArgument,
        ),
    }


# A new request's bad sampling field -> (SamplingParams fields, the message's words).
BAD_SAMPLING: dict[str, tuple[dict[str, object], str]] = {
    "min_p_above_one": ({"min_p": 1.5}, "min_p 1.5 is out of range"),
    "min_p_negative": ({"min_p": -0.1}, "min_p -0.1 is out of range"),
    "presence_penalty_above_two": ({"presence_penalty": 2.5}, "presence_penalty 2.5"),
    "presence_penalty_nan": ({"presence_penalty": float("nan")}, "presence_penalty nan"),
    "frequency_penalty_below_minus_two": ({"frequency_penalty": -3.0}, "frequency_penalty -3.0"),
    "repetition_penalty_negative": ({"repetition_penalty": -1.0}, "repetition_penalty -1.0"),
    "repetition_penalty_zero": ({"repetition_penalty": 0.0}, "repetition_penalty 0.0"),
    "repetition_penalty_too_large": ({"repetition_penalty": 1e6}, r"\(0, 65536\]"),
    "repetition_penalty_inf": ({"repetition_penalty": float("inf")}, "repetition_penalty inf"),
    "logit_bias_token_outside_vocab": ({"logit_bias": ((512, 1.0),)}, "logit_bias: token id 512"),
    "logit_bias_out_of_range": ({"logit_bias": ((5, 150.0),)}, "bias 150.0 of token 5"),
    "logit_bias_nan": ({"logit_bias": ((5, float("nan")),)}, "bias nan of token 5"),
    "stop_token_id_outside_vocab": (
        {"min_tokens": 2, "stop_token_ids": (2, 512)}, "stop_token_ids: token id 512"
    ),
    "stop_token_ids_naming_every_token": (
        {"min_tokens": 2, "stop_token_ids": tuple(range(512))}, "names all 512 tokens"
    ),
    "num_prompt_tokens_past_max_model_len": (
        {"num_prompt_tokens": 129}, "num_prompt_tokens 129 exceeds max_model_len=128"
    ),
    "top_logprobs_above_20": ({"top_logprobs": 21}, r"top_logprobs 21 .* \[0, 20\]"),
}


def _new_with(new: SequenceWork, **fields: object) -> StepRequest:
    return StepRequest(seqs=(dataclasses.replace(new, sampling=SamplingParams(**fields)),))  # type: ignore[arg-type]


def _past_prefix(new: SequenceWork, free: list[int], **changes: object) -> SequenceWork:
    """`new` starting at position 16 (a cached prefix, a fork child), with `changes`."""
    sampling = SamplingParams(frequency_penalty=0.5)
    work = dataclasses.replace(new, start_position=16, delta=BlockTableDelta(0, tuple(free[:2])),
                               sampling=sampling)
    return dataclasses.replace(work, **changes)  # type: ignore[arg-type]


# What each rejection's message must say (it names the mistake, so the test pins the reason).
MESSAGES = {
    "delta_block_out_of_range": "block id 64 is outside",
    "copy_block_out_of_range": "copies: destination block 64",
    "swap_out_cpu_block_out_of_range": "swap_out: destination block",
    "swap_in_cpu_block_out_of_range": "swap_in: source block",
    "start_position_mismatch": "send start_position=20",
    "unknown_request": "'ghost' is not held",
    "released_then_continued": "'a' is not held",
    "sampling_for_held_request": "already held",
    "over_token_budget": "max_num_batched_tokens=64",
    "over_sequence_budget": "max_num_seqs=3",
    "empty_tokens": "token_ids is empty",
    "negative_temperature": "temperature -0.5",
    "top_p_above_one": "top_p 1.5",
    "top_p_nan": "top_p nan",
    "table_longer_than_max_model_len": "9-block table exceeds max_model_len=128",
    "position_past_max_model_len": "129 tokens exceed max_model_len=128",
    "token_id_outside_vocab": "token id 512 is outside",
    "duplicate_request_ids": "appears twice",
    "delta_start_past_table_end": "start_index 3 is past the end",
    "blocks_do_not_cover_positions": "reaches position 17",
    **{name: words for name, (_, words) in BAD_SAMPLING.items()},
    "history_of_the_wrong_length": "history_token_ids has 3 ids for start_position 16",
    "history_token_outside_vocab": "history_token_ids: token id 512 is outside",
    "history_for_a_held_request": "history_token_ids on a request already held",
    "penalties_past_position_0_without_history": "send history_token_ids",
}
CASES = list(_bad_steps(Driver(runner=None, free_blocks=list(range(8)))))  # type: ignore[arg-type]
assert sorted(CASES) == sorted(MESSAGES)


@pytest.mark.parametrize("case", CASES)
def test_plan_rejects_bad_step_and_changes_nothing(
    held: tuple[ModelRunner, Driver], case: str
) -> None:
    # The bad part rides with valid releases and copies; none of them may be applied.
    runner, driver = held
    bad, error = _bad_steps(driver)[case]
    a0, a1 = driver.tables["a"]
    step = dataclasses.replace(
        bad,
        release_request_ids=("b", *bad.release_request_ids),
        copies=(BlockCopy(a0, a1), *bad.copies),
    )
    before_kv = runner.cache.kv.clone()
    before = {rid: (list(s.block_table), s.num_tokens) for rid, s in runner.requests.items()}
    with pytest.raises(error, match=MESSAGES[case]):
        runner.execute(step)
    assert {
        rid: (list(s.block_table), s.num_tokens) for rid, s in runner.requests.items()
    } == before
    assert torch.equal(runner.cache.kv, before_kv)
    # The runner keeps serving: 'a' continues from where it was.
    assert runner.execute(StepRequest(seqs=(_decode_a(driver),))).tokens[0].request_id == "a"


def test_plan_release_of_unknown_id_is_ignored(held: tuple[ModelRunner, Driver]) -> None:
    # Releasing twice or releasing an id never seen is not an error (idempotent frees).
    runner, _ = held
    assert runner.release(("a", "ghost")) == 1
    assert runner.release(("a",)) == 0
    assert sorted(runner.requests) == ["b"]


def test_plan_new_request_may_start_after_a_cached_prefix(held: tuple[ModelRunner, Driver]) -> None:
    # A new request whose first 16 tokens are cached in 'a''s first block starts at 16.
    runner, driver = held
    shared = driver.tables["a"][0]
    work = SequenceWork(
        "c",
        (9, 9),
        16,
        BlockTableDelta(0, (shared, driver.free_blocks.pop())),
        SamplingParams(),
        True,
    )
    result = runner.execute(StepRequest(seqs=(work,)))
    assert [t.request_id for t in result.tokens] == ["c"]
    assert runner.requests["c"].num_tokens == 18
