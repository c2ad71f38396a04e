"""Penalties, logit_bias and min_tokens through the runner, step after step, against a
reference loop (transformers' forward + transformers' processors): plain requests, n > 1 fork
children, and requests recomputed after a preemption."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
from transformers import PreTrainedModel

from executor_svc.runner import ModelRunner
from executor_svc.step import (
    BlockCopy,
    BlockTableDelta,
    SamplingParams,
    SequenceWork,
    StepRequest,
)

from .oracle import Driver, random_prompts, reference_generate, reference_model, reference_sample

# Strong enough that a tiny random model's continuation changes (asserted below).
PENALISED = SamplingParams(
    repetition_penalty=1.5, presence_penalty=0.8, frequency_penalty=0.6,
    logit_bias=((7, 2.0), (8, -3.0)),
)


def _params(prompt: list[int], **fields: object) -> SamplingParams:
    return dataclasses.replace(PENALISED, num_prompt_tokens=len(prompt), **fields)  # type: ignore[arg-type]


@pytest.fixture
def runner(make_runner: Callable[..., ModelRunner]) -> ModelRunner:
    return make_runner("tiny-llama", block_size=4, num_blocks=256)


@pytest.fixture
def reference(runner: ModelRunner) -> PreTrainedModel:
    return reference_model(runner)


def _decode(runner: ModelRunner, driver: Driver, outputs: dict[str, list[int]], steps: int,
            chained: bool = False) -> None:
    """`steps` decode steps of every request in `outputs`; `chained`: every other step sends
    use_sampled_token rows (token 0) instead of the token."""
    for step in range(steps):
        stand_in = chained and step % 2 == 1
        seqs = [
            dataclasses.replace(driver.work(rid, [0 if stand_in else out[-1]], sample=True),
                                use_sampled_token=stand_in)
            for rid, out in outputs.items()
        ]
        for token in runner.execute(StepRequest(seqs=tuple(seqs))).tokens:
            outputs[token.request_id].append(token.token_id)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_runner_penalised_request_matches_reference_loop(
    runner: ModelRunner, reference: PreTrainedModel, temperature: float
) -> None:
    # A penalised request (chunked prefill, then decodes, some through use_sampled_token)
    # beside a plain greedy one: each samples exactly what the reference loop samples.
    prompt, plain = random_prompts(runner.info.vocab_size, [22, 9], seed=3)
    first = reference_generate(reference, prompt, 1)[0]
    params = _params(prompt, temperature=temperature, top_k=40, top_p=0.95, min_p=0.02,
                     min_tokens=5, stop_token_ids=(first, 2), seed=5)
    driver = Driver.scattered(runner)
    runner.execute(StepRequest(seqs=(driver.work("p", prompt[:10], False, params),)))
    step = StepRequest(seqs=(driver.work("p", prompt[10:], True),
                             driver.work("q", plain, True)))
    outputs = {t.request_id: [t.token_id] for t in runner.execute(step).tokens}
    _decode(runner, driver, outputs, 19, chained=True)
    expected = reference_sample(reference, prompt, params, len(prompt), 20)
    assert outputs["p"] == expected
    assert first not in expected[:5], "min_tokens masks the stop ids"
    assert outputs["q"] == reference_generate(reference, plain, 20)
    assert expected != reference_generate(reference, prompt, 20), "the penalties matter"


def test_runner_fork_children_count_the_parents_prompt(
    runner: ModelRunner, reference: PreTrainedModel
) -> None:
    # n = 2: a plain parent computes prompt[:-1]; each child starts at its last token on the
    # parent's blocks (the partial last block copied), with the prompt before it as
    # history_token_ids, and samples as the reference loop does from the whole prompt.
    prompt = random_prompts(runner.info.vocab_size, [18], seed=4)[0]
    driver = Driver.scattered(runner)
    runner.execute(StepRequest(seqs=(driver.work("parent", prompt[:-1], False),)))
    table = driver.tables["parent"]  # 5 blocks of 4: the last holds one token
    children = {f"c{i}": _params(prompt, temperature=0.8, seed=40 + i) for i in range(2)}
    seqs, copies = [], []
    for rid, params in children.items():
        own = driver.free_blocks.pop()
        copies.append(BlockCopy(table[-1], own))
        driver.tables[rid], driver.num_tokens[rid] = [*table[:-1], own], len(prompt)
        seqs.append(SequenceWork(rid, (prompt[-1],), len(prompt) - 1,
                                 BlockTableDelta(0, (*table[:-1], own)), params, True,
                                 history_token_ids=tuple(prompt[:-1])))
    step = StepRequest(seqs=tuple(seqs), copies=tuple(copies), release_request_ids=("parent",))
    outputs = {t.request_id: [t.token_id] for t in runner.execute(step).tokens}
    _decode(runner, driver, outputs, 11)
    for rid, params in children.items():
        assert outputs[rid] == reference_sample(reference, prompt, params, len(prompt), 12), rid
    assert outputs["c0"] != outputs["c1"]


@pytest.mark.parametrize("cached", [0, 16])
def test_runner_recomputed_request_continues_as_if_never_preempted(
    runner: ModelRunner, reference: PreTrainedModel, cached: int
) -> None:
    # A greedy penalised request generates 9 tokens, is released (a recompute preemption) and
    # comes back as a new request over prompt + generated tokens with num_prompt_tokens =
    # the prompt's length: from position 0, or past a 16-token cached prefix (its old first
    # blocks, history_token_ids = the 16 tokens, 6 of them generated). Its 9 next tokens
    # are the uninterrupted reference's.
    prompt = random_prompts(runner.info.vocab_size, [10], seed=6)[0]
    params = _params(prompt, min_tokens=12, stop_token_ids=(2, 3))
    expected = reference_sample(reference, prompt, params, len(prompt), 18)
    driver = Driver.scattered(runner)
    outputs = {t.request_id: [t.token_id]
               for t in runner.execute(StepRequest(seqs=(driver.work("r", prompt, True, params),)))
               .tokens}
    _decode(runner, driver, outputs, 8)
    assert outputs["r"] == expected[:9]
    tokens = prompt + outputs["r"]  # 19 held: the recompute computes all but the last again
    kept = driver.tables["r"][: cached // 4]
    runner.release(("r",))
    driver.tables["r"], driver.num_tokens["r"] = list(kept), cached
    work = driver.work("r", tokens[cached:], True, params)
    work = dataclasses.replace(work, delta=BlockTableDelta(0, tuple(driver.tables["r"])),
                               history_token_ids=tuple(tokens[:cached]))
    outputs = {t.request_id: [t.token_id] for t in runner.execute(StepRequest(seqs=(work,))).tokens}
    _decode(runner, driver, outputs, 8)
    assert outputs["r"] == expected[9:]
