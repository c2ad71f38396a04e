"""Prompt log-probabilities (SamplingParams.prompt_logprobs) against transformers' forward."""

from __future__ import annotations

import pytest
import torch

from common.errors import InvalidArgument
from executor_svc.runner import ModelRunner
from executor_svc.step import SamplingParams, SequenceWork, StepRequest, StepResult

from .oracle import Driver, random_prompts, reference_logits, reference_model


def _expected(runner: ModelRunner, prompt: list[int]
              ) -> tuple[list[float], list[int], torch.Tensor]:
    """Each token's log-probability given the tokens before it, its rank, the log-softmax."""
    logprobs = torch.log_softmax(reference_logits(reference_model(runner), prompt).float(), -1)
    rows = logprobs[:-1]  # [L - 1, V]: row p predicts the token at p + 1
    targets = torch.tensor(prompt[1:])
    chosen = rows.gather(1, targets[:, None])[:, 0]
    ranks = (rows > chosen[:, None]).sum(-1) + 1
    return chosen.tolist(), ranks.tolist(), rows


def _run(runner: ModelRunner, prompts: dict[str, list[int]], chunk: int, k: int | None,
         asking: str | None = None) -> dict[str, list[StepResult]]:
    """Every prompt prefilled in shared steps of `chunk` tokens each, each asking for its
    logprobs (or only the one named `asking`)."""
    driver, offsets = Driver.scattered(runner), dict.fromkeys(prompts, 0)
    results: dict[str, list[StepResult]] = {rid: [] for rid in prompts}
    while any(offsets[rid] < len(p) for rid, p in prompts.items()):
        seqs = []
        for rid, prompt in prompts.items():
            start = offsets[rid]
            if start >= len(prompt):
                continue
            piece = prompt[start : start + chunk]
            offsets[rid] += len(piece)
            asks = asking in (None, rid)
            sampling = None
            if start == 0:
                sampling = (SamplingParams(prompt_logprobs=k, num_prompt_tokens=len(prompt))
                            if asks else SamplingParams())
            work = driver.work(rid, piece, sample=offsets[rid] == len(prompt), sampling=sampling)
            if start == 0 and asks:
                work.prompt_token_ids = tuple(prompt)
            seqs.append(work)
        result = runner.execute(StepRequest(seqs=tuple(seqs)))
        for rid in prompts:
            results[rid].append(result)
    return results


def _collected(results: list[StepResult], rid: str) -> list:
    runs = [p for r in results for p in r.prompt_logprobs if p.request_id == rid]
    positions = [pos for run in runs for pos in range(run.first_position,
                                                      run.first_position + len(run.logprobs))]
    return [runs, positions]


@pytest.mark.parametrize("by_hidden", [True, False])
@pytest.mark.parametrize("chunk", [5, 64])
def test_prompt_logprobs_equal_the_dense_forward_in_chunks(tiny_runner: ModelRunner,
                                                           chunk: int, by_hidden: bool) -> None:
    # By the decoder's hidden state and the head a slice at a time, and (a head that scales
    # its logits) through the model's own logits.
    tiny_runner.prompt_rows.enabled = by_hidden
    prompts = dict(zip("ab", random_prompts(tiny_runner.info.vocab_size, [23, 9]), strict=True))
    results = _run(tiny_runner, prompts, chunk, k=3)
    for rid, prompt in prompts.items():
        runs, positions = _collected(results[rid], rid)
        assert positions == list(range(1, len(prompt)))  # each prompt token once, in order
        want, want_ranks, rows = _expected(tiny_runner, prompt)
        got = [lp for run in runs for lp in run.logprobs]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-4, rtol=0)
        assert [r for run in runs for r in run.ranks] == want_ranks
        tops = [top for run in runs for top in run.top_logprobs]
        values, ids = torch.topk(rows, 3, dim=-1)
        assert [[t for t, _ in top] for top in tops] == ids.tolist()
        torch.testing.assert_close(torch.tensor([[v for _, v in top] for top in tops]), values,
                                   atol=1e-4, rtol=0)


@pytest.mark.parametrize("by_hidden", [True, False])
def test_prompt_logprobs_leave_sampling_and_other_requests_alone(
        tiny_runner: ModelRunner, make_runner, by_hidden: bool) -> None:
    """One request asks, one beside it does not, in the same steps: both sample what they
    sample without prompt logprobs; only the one that asked gets them."""
    tiny_runner.prompt_rows.enabled = by_hidden
    prompts = dict(zip("ab", random_prompts(tiny_runner.info.vocab_size, [12, 7]), strict=True))
    with_them = _run(tiny_runner, prompts, 5, k=0, asking="a")
    plain = Driver.scattered(make_runner("tiny-llama")).generate(prompts, 1)
    sampled = {t.request_id: t.token_id for r in with_them["a"] for t in r.tokens}
    assert sampled == {rid: out[0] for rid, out in plain.items()}
    runs = [run for r in with_them["a"] for run in r.prompt_logprobs]
    assert {run.request_id for run in runs} == {"a"}
    assert sum(len(run.logprobs) for run in runs) == 11
    assert all(run.top_logprobs == ((),) * len(run.logprobs) for run in runs)


def test_a_prompt_of_one_token_has_no_prompt_logprobs(tiny_runner: ModelRunner) -> None:
    results = _run(tiny_runner, {"a": [5]}, 8, k=2)
    assert [r.prompt_logprobs for r in results["a"]] == [()]


def test_prompt_logprobs_need_the_prompt_and_agree_with_its_tokens(tiny_runner: ModelRunner
                                                                   ) -> None:
    driver = Driver.scattered(tiny_runner)
    asking = SamplingParams(prompt_logprobs=1, num_prompt_tokens=2)
    cases = [
        (SequenceWork("a", (5, 6), 0, sampling=asking), "needs prompt_token_ids"),
        (SequenceWork("a", (5, 6), 0, sampling=SamplingParams(), prompt_token_ids=(5, 6)),
         "without sampling.prompt_logprobs"),
        (SequenceWork("a", (5, 6), 0, sampling=asking, prompt_token_ids=(5, 7)),
         "are not its prompt_token_ids"),
        (SequenceWork("a", (5, 6), 0, sampling=SamplingParams(prompt_logprobs=1,
                                                              num_prompt_tokens=3),
                      prompt_token_ids=(5, 6)), "2 ids for num_prompt_tokens 3"),
        (SequenceWork("a", (5, 6), 0, sampling=SamplingParams(prompt_logprobs=1),
                      prompt_token_ids=(5, 6)), "2 ids for num_prompt_tokens 0"),
        (SequenceWork("a", (5, 6), 0, sampling=SamplingParams(prompt_logprobs=21,
                                                              num_prompt_tokens=2),
                      prompt_token_ids=(5, 6)), "prompt_logprobs 21 is out of range"),
    ]
    for work, message in cases:
        work.delta = driver.work("probe", [1], sample=False).delta
        with pytest.raises(InvalidArgument, match=message):
            tiny_runner.execute(StepRequest(seqs=(work,)))
        assert not tiny_runner.requests  # nothing held


def test_a_sampled_token_inside_the_prompt_is_refused(tiny_runner: ModelRunner) -> None:
    # A chunk that samples before the prompt ends, then a row standing for that token at a
    # prompt position: its logprob would be conditioned on a token that is not the prompt's.
    driver = Driver.scattered(tiny_runner)
    first = driver.work("a", [5, 6], sample=True,
                        sampling=SamplingParams(prompt_logprobs=0, num_prompt_tokens=4))
    first.prompt_token_ids = (5, 6, 7, 8)
    tiny_runner.execute(StepRequest(seqs=(first,)))
    chained = driver.work("a", [0, 8], sample=True)
    chained.use_sampled_token = True
    with pytest.raises(InvalidArgument, match="use_sampled_token at position 2, inside its"):
        tiny_runner.execute(StepRequest(seqs=(chained,)))
