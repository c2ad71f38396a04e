"""Logits processors and warpers against transformers' own (OpenAI's formula for presence and
frequency, which transformers lacks), and what the sampler does with them."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from executor_svc.logits_processor import LogitsProcessor
from executor_svc.sampler import Sampler, new_generator, warp
from executor_svc.step import SamplingParams

from .oracle import reference_processors

CPU = torch.device("cpu")
VOCAB = 64


def _logits(seed: int, rows: int = 1) -> torch.Tensor:  # [rows, V], positive and negative
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


def _processor(
    params: SamplingParams, prompt: list[int], generated: list[int]
) -> LogitsProcessor:
    """A processor that has seen what the runner shows it: the prompt (which samples after
    it), then each generated token computed by a decode step."""
    processor = LogitsProcessor.create(params, VOCAB, CPU)
    assert processor is not None
    processor.append(prompt, 0, sample=True)
    for position, token in enumerate(generated, start=len(prompt)):
        processor.append([token], position, sample=True)
    return processor


def _applied(processor: LogitsProcessor, logits: torch.Tensor) -> torch.Tensor:
    out = logits.clone()  # [V]
    processor.apply(out)
    return out


@pytest.mark.parametrize("penalty", [0.5, 1.7])
def test_logits_processor_repetition_penalty_matches_transformers(penalty: float) -> None:
    # Every id of prompt and output is penalised once (divided when positive, multiplied when
    # negative), whatever its count; the others stay: as RepetitionPenaltyLogitsProcessor.
    prompt, generated = _ids(1, 20), _ids(2, 9)
    logits = _logits(3)  # [1, V]
    logits[0, prompt[0]] = 0.0  # zero stays zero either way
    processor = _processor(SamplingParams(repetition_penalty=penalty), prompt, generated)
    expected = RepetitionPenaltyLogitsProcessor(penalty)(
        torch.tensor([prompt + generated]), logits.clone()
    )[0]
    torch.testing.assert_close(_applied(processor, logits[0]), expected, rtol=0, atol=0)


@pytest.mark.parametrize("num_prompt_tokens", [20, 0])  # 0: where the request first samples
def test_logits_processor_presence_and_frequency_follow_openai_formula(
    num_prompt_tokens: int,
) -> None:
    # logit -= frequency * count + presence * (count > 0), counting generated tokens only:
    # an id only in the prompt is untouched.
    prompt, generated = _ids(4, 20), _ids(5, 15)
    params = SamplingParams(presence_penalty=0.7, frequency_penalty=-0.3,
                            num_prompt_tokens=num_prompt_tokens)
    logits = _logits(6)[0]  # [V]
    counts = Counter(generated)
    expected = logits.clone()
    for token, count in counts.items():
        expected[token] -= -0.3 * count + 0.7
    torch.testing.assert_close(_applied(_processor(params, prompt, generated), logits), expected)
    only_prompt = set(prompt) - set(generated)
    assert only_prompt and all(
        _applied(_processor(params, prompt, generated), logits)[t] == logits[t]
        for t in only_prompt
    )


def test_logits_processor_min_tokens_matches_min_new_tokens_processor() -> None:
    # Stop ids are -inf while fewer than min_tokens tokens are generated, then free: as
    # MinNewTokensLengthLogitsProcessor at every length around the boundary.
    prompt, stops, min_tokens = _ids(7, 12), [2, 9, 40], 4
    params = SamplingParams(min_tokens=min_tokens, stop_token_ids=(9, 2, 40, 9))
    logits = _logits(8)[0]
    reference = MinNewTokensLengthLogitsProcessor(len(prompt), min_tokens, stops)
    for num_generated in range(min_tokens + 2):
        generated = _ids(9, num_generated)
        expected = reference(torch.tensor([prompt + generated]), logits[None].clone())[0]
        got = _applied(_processor(params, prompt, generated), logits)
        assert torch.equal(got, expected), num_generated
        assert torch.isinf(got[stops]).all() == (num_generated < min_tokens)


def test_logits_processor_logit_bias_matches_sequence_bias_processor() -> None:
    # Each biased id gets its bias added; a -inf (masked) logit stays -inf.
    bias = ((3, 2.5), (17, -100.0), (63, 100.0))
    logits = _logits(10)[0]
    expected = SequenceBiasLogitsProcessor([[[t], b] for t, b in bias])(
        torch.tensor([[1, 2]]), logits[None].clone()
    )[0]
    processor = _processor(SamplingParams(logit_bias=bias), [1], [])
    torch.testing.assert_close(_applied(processor, logits), expected)


WARPERS = [
    SamplingParams(temperature=0.7, min_p=0.05),
    SamplingParams(temperature=1.3, top_k=7),
    SamplingParams(temperature=1.0, top_p=0.8),
    SamplingParams(temperature=0.6, min_p=0.02, top_k=20, top_p=0.9),
    SamplingParams(temperature=2.0, min_p=1.0),  # only the most likely token
]


@pytest.mark.parametrize("params", WARPERS)
def test_warp_matches_transformers_warpers(params: SamplingParams) -> None:
    # Temperature, min_p, top_k, top_p in that order keep exactly the tokens transformers'
    # warpers keep, with the same scaled logits.
    warpers = LogitsProcessorList([TemperatureLogitsWarper(params.temperature)])
    if params.min_p:
        warpers.append(MinPLogitsWarper(params.min_p))
    if params.top_k:
        warpers.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1:
        warpers.append(TopPLogitsWarper(params.top_p))
    for seed in range(20):
        logits = _logits(100 + seed)  # [1, V]
        expected = warpers(torch.tensor([[1]]), logits.clone())[0]
        got = warp(logits[0], params)
        assert torch.equal(torch.isinf(got), torch.isinf(expected)), seed
        kept = ~torch.isinf(got)
        torch.testing.assert_close(got[kept], expected[kept])


PIPELINES = [
    SamplingParams(temperature=0.8, min_p=0.03, top_k=30, top_p=0.95, repetition_penalty=1.4,
                   presence_penalty=0.5, frequency_penalty=0.4, logit_bias=((5, 4.0), (7, -2.0)),
                   min_tokens=3, stop_token_ids=(2,), num_prompt_tokens=16, seed=11),
    SamplingParams(temperature=1.5, top_p=0.7, repetition_penalty=0.8, frequency_penalty=1.5,
                   num_prompt_tokens=16, seed=12),
    SamplingParams(repetition_penalty=1.2, presence_penalty=2.0, logit_bias=((7, -2.0),),
                   min_tokens=10, stop_token_ids=(0, 1, 2), num_prompt_tokens=16),  # greedy
]


@pytest.mark.parametrize("params", PIPELINES)
def test_sampler_draws_as_transformers_processors_in_vllm_order(params: SamplingParams) -> None:
    # A row's tokens over 40 draws (each from its own history) equal a loop over
    # transformers' processors in vLLM's order drawing from the same seeded generator; the
    # reported logprob stays the raw log-softmax.
    prompt = [5, 7, *_ids(13, 14)]  # biased ids repeated: the bias comes before the penalty
    sampler = Sampler(0, CPU)
    ours, theirs = new_generator(params.seed or 0, CPU), new_generator(params.seed or 0, CPU)
    reference = reference_processors(params, len(prompt))
    generated: list[int] = []
    for step in range(40):
        logits = _logits(200 + step)  # [1, V]
        samples = sampler.sample(logits, [params], [ours], [_processor(params, prompt, generated)])
        scores = reference(torch.tensor([prompt + generated]), logits.clone())[0]  # [V]
        expected = (
            int(scores.argmax()) if params.greedy
            else int(torch.multinomial(torch.softmax(scores, -1), 1, generator=theirs)[0])
        )
        assert samples.token_ids == [expected], step
        raw = torch.log_softmax(logits[0], dim=-1)[expected].item()
        assert samples.logprobs == [pytest.approx(raw, abs=1e-6)]
        generated.append(expected)


def test_sampler_greedy_honours_bias_min_tokens_and_penalties() -> None:
    # Greedy rows take the argmax after the processor: a bias lifts id 5 over the max, a
    # min_tokens mask removes the max, a repetition penalty demotes a repeated max; a plain
    # row in the same batch keeps the raw argmax. Logprobs stay the raw ones.
    logits = torch.zeros(4, VOCAB)
    logits[:, 10], logits[:, 11] = 5.0, 4.0  # raw argmax 10, runner-up 11
    rows = [
        SamplingParams(logit_bias=((5, 6.0),)),
        SamplingParams(min_tokens=1, stop_token_ids=(10,)),
        SamplingParams(repetition_penalty=2.0),
        SamplingParams(),
    ]
    processors = [_processor(p, [10, 3], []) for p in rows[:3]] + [None]
    samples = Sampler(0, CPU).sample(logits, rows, [None] * 4, processors)
    assert samples.token_ids == [5, 11, 11, 10]
    raw = torch.log_softmax(logits, dim=-1)
    assert samples.logprobs == pytest.approx([raw[0, 5].item(), raw[1, 11].item(),
                                              raw[2, 11].item(), raw[3, 10].item()])


def test_sampler_top_logprobs_are_the_raw_most_likely() -> None:
    # top_logprobs k: the k most likely ids of the raw log-softmax (not of the penalised,
    # tempered distribution), most likely first; rows that ask none get ().
    logits = _logits(300, rows=3)
    params = [
        SamplingParams(temperature=0.5, top_logprobs=5, repetition_penalty=3.0),
        SamplingParams(),
        SamplingParams(top_logprobs=20, logit_bias=((0, 50.0),)),
    ]
    processors = [_processor(p, _ids(301, 30), []) if p.edits_logits else None for p in params]
    samples = Sampler(0, CPU).sample(logits, params, [None] * 3, processors)
    raw = torch.log_softmax(logits, dim=-1)
    for row, k in ((0, 5), (2, 20)):
        values, ids = torch.topk(raw[row], k)
        assert [t for t, _ in samples.top_logprobs[row]] == ids.tolist()
        assert [lp for _, lp in samples.top_logprobs[row]] == pytest.approx(values.tolist())
    assert samples.top_logprobs[1] == ()
    assert samples.token_ids[2] == 0  # the bias picked it; its rank in the raw top-20 is moot


def test_logits_processor_only_for_requests_that_use_one() -> None:
    # Plain requests (and min_tokens without stop ids) get none; each processor keeps only
    # the tensors its parameters read.
    assert LogitsProcessor.create(SamplingParams(temperature=1.0, top_k=5, min_p=0.1,
                                                 top_logprobs=3), VOCAB, CPU) is None
    assert LogitsProcessor.create(SamplingParams(min_tokens=5), VOCAB, CPU) is None
    processor = LogitsProcessor.create(SamplingParams(frequency_penalty=0.1), VOCAB, CPU)
    assert processor is not None
    assert processor.seen is None and processor.generated is not None
    processor = LogitsProcessor.create(SamplingParams(min_tokens=1, stop_token_ids=(2,)),
                                       VOCAB, CPU)
    assert processor is not None and processor.seen is None and processor.generated is None
