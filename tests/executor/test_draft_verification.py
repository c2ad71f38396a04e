"""Speculative decoding at the executor: drafts verified in the step that decodes, against
transformers' greedy `generate` (real runner, random weights) and the simulated token model;
the position held after a verdict; the refusals (executor.v1 SequenceWork.num_draft_tokens)."""

from __future__ import annotations

import random

import pytest
import torch

from common.errors import InvalidArgument, Unimplemented
from executor_svc.runner import ModelRunner
from executor_svc.simulated.runner import SimulatedRunner, build_simulated_runner
from executor_svc.simulated.settings import SimulatedSettings
from executor_svc.step import BlockTableDelta, SamplingParams, SequenceWork, StepRequest
from tests.executor.oracle import reference_generate, reference_logits, reference_model

BS = 16


def start(runner: ModelRunner | SimulatedRunner, rid: str, prompt: list[int], first_block: int,
          sampling: SamplingParams | None = None) -> int:
    """Prefill `prompt` (room for 64 more tokens); its first sampled token."""
    blocks = tuple(range(first_block, first_block + (len(prompt) + 64) // BS + 1))
    step = StepRequest(seqs=(SequenceWork(rid, tuple(prompt), 0, BlockTableDelta(0, blocks),
                                          sampling or SamplingParams(), True),))
    return runner.execute(step).tokens[0].token_id


def verify(runner: ModelRunner | SimulatedRunner, rid: str, last: int, position: int,
           drafts: list[int]) -> tuple[int, int]:
    """One verifying step; (drafts accepted, the token after them)."""
    step = StepRequest(seqs=(SequenceWork(rid, (last, *drafts), position, None, None, True,
                                          num_draft_tokens=len(drafts)),))
    (token,) = runner.execute(step).tokens
    return token.num_accepted_draft_tokens, token.token_id


def test_drafts_are_verified_like_greedy_generate(tiny_runner: ModelRunner) -> None:
    """Each step drafts the reference's next tokens with one wrong at a random place (or none):
    the executor accepts exactly the right ones, its token is the reference's next, and the
    output equals generate's whatever was drafted."""
    model = reference_model(tiny_runner)
    rng = random.Random(5)
    vocab = tiny_runner.info.vocab_size
    for rid, prompt in (("a", [rng.randrange(3, vocab) for _ in range(21)]),
                        ("b", [rng.randrange(3, vocab) for _ in range(7)])):
        expected = reference_generate(model, prompt, 40)
        out = [start(tiny_runner, rid, prompt, 0 if rid == "a" else 20)]
        while len(out) < 30:
            k = rng.randint(1, 4)  # (--max-draft-tokens' default)
            drafts = expected[len(out):len(out) + k]
            wrong = rng.randrange(len(drafts) + 1)  # == len: all right
            if wrong < len(drafts):
                drafts[wrong] = (drafts[wrong] + 1) % vocab
            accepted, token = verify(tiny_runner, rid, out[-1], len(prompt) + len(out) - 1, drafts)
            assert accepted == wrong
            out += [*drafts[:accepted], token]
        assert out == expected[:len(out)]
        # It holds the prompt and every output but the last: the next step starts there.
        assert tiny_runner.requests[rid].num_tokens == len(prompt) + len(out) - 1


def test_a_batch_mixes_drafted_plain_and_prefill_rows(tiny_runner: ModelRunner) -> None:
    model = reference_model(tiny_runner)
    p1, p2, p3 = [5, 6, 7, 8, 9] * 3, [11, 12, 13] * 5, [21, 22, 23, 24]
    e1, e2, e3 = (reference_generate(model, p, 8) for p in (p1, p2, p3))
    t1, t2 = start(tiny_runner, "x", p1, 0), start(tiny_runner, "y", p2, 10)
    step = StepRequest(seqs=(
        SequenceWork("x", (t1, *e1[1:4]), len(p1), None, None, True, num_draft_tokens=3),
        SequenceWork("y", (t2,), len(p2), None, None, True),
        SequenceWork("z", tuple(p3), 0, BlockTableDelta(0, (30, 31)), SamplingParams(), True),
    ))
    x, y, z = runner_tokens = tiny_runner.execute(step).tokens
    assert [t.request_id for t in runner_tokens] == ["x", "y", "z"]
    assert (x.num_accepted_draft_tokens, x.token_id) == (3, e1[4])
    assert (y.num_accepted_draft_tokens, y.token_id) == (0, e2[1])
    assert z.token_id == e3[0]


def test_simulated_executor_verifies_by_its_token_model() -> None:
    runner = build_simulated_runner(SimulatedSettings(time_scale=0.0, num_blocks=64,
                                                      num_cpu_blocks=0))
    prompt = [3, 4, 5, 6, 7]
    expected = runner.tokens.generate(prompt, 12)
    first = start(runner, "s", prompt, 0)
    assert first == expected[0]
    accepted, token = verify(runner, "s", first, 5, [*expected[1:3], 1, 2])
    assert (accepted, token) == (2, expected[3])
    assert runner.requests["s"].num_tokens == 5 + 3


@pytest.mark.parametrize(("work", "message"), [
    (dict(num_draft_tokens=17), "num_draft_tokens=17 is out of range"),
    (dict(num_draft_tokens=2, token_ids=(1, 2)), "one less than its 2 token_ids"),
    (dict(num_draft_tokens=1, token_ids=(1, 2, 3)), "one less than its 3 token_ids"),
    (dict(num_draft_tokens=1, token_ids=(1, 2), sample=False), "need sample"),
    (dict(num_draft_tokens=1, token_ids=(1, 2), use_sampled_token=True), "need sample"),
])
def test_bad_drafts_are_refused_and_change_nothing(tiny_runner: ModelRunner, work: dict,
                                                   message: str) -> None:
    first = start(tiny_runner, "r", [4, 5, 6], 0)
    fields = dict(request_id="r", token_ids=(first, *range(20, 37)), start_position=3,
                  sample=True) | work
    with pytest.raises(InvalidArgument, match=message):
        tiny_runner.execute(StepRequest(seqs=(SequenceWork(**fields),)))
    assert tiny_runner.requests["r"].num_tokens == 3


@pytest.mark.parametrize("sampling", [
    SamplingParams(temperature=0.7, seed=1),
    SamplingParams(top_logprobs=2),
    SamplingParams(repetition_penalty=1.2),
])
def test_drafts_need_greedy_sampling_with_nothing_per_row(tiny_runner: ModelRunner,
                                                          sampling: SamplingParams) -> None:
    first = start(tiny_runner, "r", [4, 5, 6], 0, sampling)
    with pytest.raises(InvalidArgument, match="only under greedy sampling"):
        verify(tiny_runner, "r", first, 3, [7, 8])


@pytest.mark.parametrize("by_hidden", [True, False])
def test_drafts_beside_a_prompt_asking_for_its_logprobs(tiny_runner: ModelRunner,
                                                       by_hidden: bool) -> None:
    """The draft rows' logits and the prompt rows' share the step's kept rows: each gets its
    own (against transformers' forward), by the decoder's hidden state or the model's logits."""
    tiny_runner.prompt_rows.enabled = by_hidden
    model = reference_model(tiny_runner)
    drafted, asking = [7, 8, 9, 10, 11, 12], [20, 21, 22, 23, 24]
    expected = reference_generate(model, drafted, 5)
    first = start(tiny_runner, "d", drafted, 0)
    with_logprobs = SequenceWork(
        "p", tuple(asking), 0, BlockTableDelta(0, (40,)),
        SamplingParams(prompt_logprobs=0, num_prompt_tokens=len(asking)), True,
        prompt_token_ids=tuple(asking))
    verifying = SequenceWork("d", (first, *expected[1:3], 0), len(drafted), None, None, True,
                             num_draft_tokens=3)
    result = tiny_runner.execute(StepRequest(seqs=(verifying, with_logprobs)))
    d, _ = result.tokens
    assert (d.num_accepted_draft_tokens, d.token_id) == (2, expected[3])
    (run,) = result.prompt_logprobs
    logprobs = torch.log_softmax(reference_logits(model, asking).float(), -1)[:-1]
    want = logprobs.gather(1, torch.tensor(asking[1:])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(run.logprobs), want, atol=1e-4, rtol=0)


def test_an_executor_verifies_at_most_its_max_draft_tokens(make_runner) -> None:
    """--max-draft-tokens bounds a step's drafts per sequence, and 0 turns them off: Describe
    says so, and drafts are then UNIMPLEMENTED, not computed as tokens."""
    two = make_runner("tiny-llama", max_draft_tokens=2)
    assert two.info.max_draft_tokens == 2
    first = start(two, "r", [4, 5, 6], 0)
    with pytest.raises(InvalidArgument, match=r"num_draft_tokens=3 is out of range: 1\.\.2"):
        verify(two, "r", first, 3, [7, 8, 9])
    none = make_runner("tiny-llama", max_draft_tokens=0)
    assert none.info.max_draft_tokens == 0
    first = start(none, "r", [4, 5, 6], 0)
    with pytest.raises(Unimplemented, match="verifies no draft tokens"):
        verify(none, "r", first, 3, [7])
    assert none.requests["r"].num_tokens == 3
