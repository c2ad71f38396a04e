"""Sampling: greedy, top-k, top-p, temperature, seeds and reported log-probabilities."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest
import torch

from executor_svc.runner import ModelRunner
from executor_svc.sampler import (
    ARGMAX_CHUNK,
    Sampler,
    argmax_and_lse,
    greedy_tokens,
    new_generator,
)
from executor_svc.step import SamplingParams, SequenceWork, StepRequest

from .oracle import Driver, random_prompts

CPU = torch.device("cpu")
PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
LOGITS = PROBS.log()[None]  # [1, 4]


def _draws(params: SamplingParams, num: int, seed: int = 0) -> list[int]:
    sampler = Sampler(seed=0, device=CPU)
    generator = new_generator(seed, CPU)
    return [sampler.sample(LOGITS, [params], [generator]).token_ids[0] for _ in range(num)]


def test_sampler_greedy_picks_argmax_and_raw_logprob() -> None:
    # Greedy takes the largest logit; the logprob is the raw log-softmax of that token.
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 3.0, 0.0]])  # ties pick the lowest id
    samples = Sampler(0, CPU).sample(logits, [SamplingParams()] * 2, [None, None])
    assert samples.token_ids == [1, 0]
    assert samples.top_logprobs == [(), ()]
    expected = torch.log_softmax(logits, dim=-1)[[0, 1], [1, 0]]
    torch.testing.assert_close(torch.tensor(samples.logprobs), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_argmax_and_lse_match_torch(kernel, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    # The CPU kernel's one pass against torch.argmax and torch.logsumexp in float32: the same
    # ids (ties, planted here and frequent in bf16, to the lowest), sums within float rounding.
    gen = torch.Generator().manual_seed(7)
    logits = (torch.randn(9, 49_153, generator=gen) * 4).to(dtype)  # odd width: a tail
    logits[3, [10, 400, 49_000]] = logits[3].max() + 1  # three ids share the row's max
    logits[4, -1] = logits[4].max() + 1  # the max in the last column
    ids, lse = argmax_and_lse(logits, kernel)
    assert ids.dtype == torch.long and lse.dtype == torch.float32
    assert ids.tolist() == logits.float().argmax(dim=-1).tolist()
    assert ids[3] == 10 and ids[4] == 49_152
    torch.testing.assert_close(lse, torch.logsumexp(logits.float(), dim=-1), rtol=1e-6, atol=1e-5)
    strided = logits[:, :100]  # rows 49,153 apart: read by stride
    ids, lse = argmax_and_lse(strided, kernel)
    assert ids.tolist() == strided.float().argmax(-1).tolist()
    torch.testing.assert_close(lse, torch.logsumexp(strided.float(), dim=-1))


def test_kernel_argmax_and_lse_refuses_what_it_cannot_read(kernel) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kernel.argmax_logsumexp(torch.zeros(2, 8, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="unit-strided"):
        kernel.argmax_logsumexp(torch.zeros(8, 2).t())
    with pytest.raises(RuntimeError, match="vocab > 0"):
        kernel.argmax_logsumexp(torch.zeros(2, 0))
    for shape in ((8,), (2, 3, 8)):
        with pytest.raises(RuntimeError, match=r"\[rows, vocab\]"):
            kernel.argmax_logsumexp(torch.zeros(shape))
    ids, lse = kernel.argmax_logsumexp(torch.zeros(0, 8))  # a step with nothing to sample
    assert ids.shape == lse.shape == (0,)


def test_sampler_with_the_kernel_reports_what_torch_reports(kernel) -> None:  # type: ignore[no-untyped-def]
    # The runner's sampler (with the kernel) and the torch path: same tokens, log-probabilities
    # within float rounding, the same top log-probabilities; greedy rows, seeded rows and rows
    # drawn together from the executor's generator (one of them with top_k).
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 1_000, generator=gen) * 3
    params = [SamplingParams(), SamplingParams(top_logprobs=3),
              SamplingParams(temperature=0.8, seed=1), SamplingParams(temperature=1.3, seed=2),
              SamplingParams(temperature=0.9), SamplingParams(temperature=1.0, top_k=5)]
    results = []
    for with_kernel in (kernel, None):
        generators = [None, None, new_generator(1, CPU), new_generator(2, CPU), None, None]
        results.append(Sampler(0, CPU, with_kernel).sample(logits, params, generators))
    fast, plain = results
    assert fast.token_ids == plain.token_ids and fast.top_logprobs == plain.top_logprobs
    assert fast.logprobs[1] == fast.top_logprobs[1][0][1]  # greedy: its own top entry, exactly
    torch.testing.assert_close(torch.tensor(fast.logprobs), torch.tensor(plain.logprobs))
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(fast.token_ids)[:, None])
    torch.testing.assert_close(torch.tensor(fast.logprobs), expected[:, 0])


def test_sampler_same_seed_reproduces_and_other_seed_differs() -> None:
    # 50 draws at temperature 1 from seed 42 twice are equal; seed 43 gives another sequence.
    params = SamplingParams(temperature=1.0, seed=42)
    assert _draws(params, 50, seed=42) == _draws(params, 50, seed=42)
    assert _draws(params, 50, seed=42) != _draws(params, 50, seed=43)


def test_sampler_top_k_keeps_only_k_tokens() -> None:
    # top_k 2 never draws tokens 2 or 3; top_k 1 is greedy.
    assert set(_draws(SamplingParams(temperature=1.0, top_k=2), 300)) == {0, 1}
    assert set(_draws(SamplingParams(temperature=5.0, top_k=1), 50)) == {0}


def test_sampler_top_p_keeps_smallest_nucleus() -> None:
    # top_p 0.7: {0, 1} reach 0.8 >= 0.7, so token 2 and 3 never appear; 0.5 keeps only 0.
    assert set(_draws(SamplingParams(temperature=1.0, top_p=0.7), 300)) == {0, 1}
    assert set(_draws(SamplingParams(temperature=1.0, top_p=0.5), 50)) == {0}


def test_sampler_temperature_one_follows_the_distribution() -> None:
    # 4,000 draws land within 3 percentage points of each token's probability.
    counts = Counter(_draws(SamplingParams(temperature=1.0), 4000, seed=5))
    for token, p in enumerate(PROBS.tolist()):
        assert abs(counts[token] / 4000 - p) < 0.03, (token, counts)


def test_sampler_seeded_requests_reproduce_through_the_runner(
    make_runner: Callable[..., ModelRunner],
) -> None:
    # Two executors, same seeded request (temperature 0.8, top-k 50, top-p 0.9): same tokens,
    # even when batched with other requests; a different seed diverges.
    def run(seed: int, with_neighbour: bool) -> list[int]:
        runner = make_runner()
        driver = Driver.scattered(runner, seed=seed)
        prompt, other = random_prompts(runner.info.vocab_size, [12, 9])
        params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=seed)
        seqs = [driver.work("s", prompt, sample=True, sampling=params)]
        if with_neighbour:
            seqs.append(driver.work("n", other, sample=True, sampling=SamplingParams(1.0)))
        out: list[int] = []
        tokens = runner.execute(StepRequest(seqs=tuple(seqs))).tokens
        for _ in range(15):
            out.append(tokens[0].token_id)
            next_seqs: list[SequenceWork] = [driver.work("s", [out[-1]], sample=True)]
            if with_neighbour:
                next_seqs.append(driver.work("n", [tokens[1].token_id], sample=True))
            tokens = runner.execute(StepRequest(seqs=tuple(next_seqs))).tokens
        return out

    assert run(42, with_neighbour=False) == run(42, with_neighbour=True)
    assert run(42, with_neighbour=False) != run(7, with_neighbour=False)


def test_sampler_greedy_tokens_equal_argmax_with_ties_across_chunks() -> None:
    # Rows whose max sits in two chunks, twice in one chunk, at the very ends, or once: the
    # chunked argmax returns torch.argmax's id (the lowest); an odd vocabulary falls back.
    logits = torch.randn(6, 4 * ARGMAX_CHUNK)
    logits[0, [5, ARGMAX_CHUNK + 3]] = 50.0  # max in chunks 0 and 1: id 5
    logits[1, [2 * ARGMAX_CHUNK + 7, 2 * ARGMAX_CHUNK + 1]] = 50.0  # twice in chunk 2: id +1
    logits[2, -1] = 50.0  # last id
    logits[3, 0] = 50.0  # first id
    logits[4] = 0.0  # all equal: id 0
    assert greedy_tokens(logits).tolist()[:5] == [
        5,
        2 * ARGMAX_CHUNK + 1,
        4 * ARGMAX_CHUNK - 1,
        0,
        0,
    ]
    assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1))
    odd = torch.randn(3, ARGMAX_CHUNK + 5)
    assert torch.equal(greedy_tokens(odd), odd.argmax(dim=-1))


def _shared_draws(params: SamplingParams, num: int, seed: int = 0) -> list[int]:
    """Draws of a request without a seed: the executor's own generator, drawn in batches."""
    sampler = Sampler(seed=seed, device=CPU)
    return [token for _ in range(num // 8)
            for token in sampler.sample(LOGITS.expand(8, -1), [params] * 8, [None] * 8).token_ids]


def test_unseeded_rows_follow_the_distribution_and_its_filters() -> None:
    # Rows without a seed are drawn together by inverse CDF from the executor's generator: 4,000
    # draws land within 3 points of each probability; top_k, top_p and min_p still cut.
    counts = Counter(_shared_draws(SamplingParams(temperature=1.0), 4000, seed=5))
    for token, p in enumerate(PROBS.tolist()):
        assert abs(counts[token] / 4000 - p) < 0.03, (token, counts)
    assert set(_shared_draws(SamplingParams(temperature=1.0, top_k=2), 400)) == {0, 1}
    assert set(_shared_draws(SamplingParams(temperature=1.0, top_p=0.5), 80)) == {0}
    assert set(_shared_draws(SamplingParams(temperature=1.0, min_p=0.5), 400)) == {0, 1}


def test_unseeded_rows_each_draw_from_their_own_row() -> None:
    # One batch: a row whose mass is on id 3 and a row whose mass is on id 1 (the rest -inf, so
    # never drawn) each get their own; the same executor seed gives the same draws.
    logits = torch.full((2, 5), float("-inf"))
    logits[0, 3], logits[1, [1, 2]] = 0.0, torch.tensor([5.0, -30.0])
    params, none = [SamplingParams(temperature=0.7)] * 2, [None, None]
    draws = [Sampler(3, CPU).sample(logits, params, none).token_ids for _ in range(2)]
    assert draws[0] == draws[1] == [3, 1]
    sampler = Sampler(4, CPU)
    many = [sampler.sample(logits, params, none).token_ids for _ in range(200)]
    assert {tuple(d) for d in many} == {(3, 1)}  # id 2's probability is e-35: never


def test_an_unseeded_row_without_any_probability_is_refused() -> None:
    # Every id banned (a processor's doing): no token can be drawn, and the step fails as
    # torch.multinomial's did, instead of returning an id the row banned.
    logits = torch.full((2, 6), float("-inf"))
    logits[0, 2] = 1.0
    params = [SamplingParams(temperature=1.0)] * 2
    with pytest.raises(RuntimeError, match="no token of positive, finite probability"):
        Sampler(0, CPU).sample(logits, params, [None, None])
