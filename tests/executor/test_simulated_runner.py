"""The simulated runner: deterministic tokens that follow the KV state (prefixes, forks,
swaps), the real executor's validation, and sleeping out the modelled step time."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from common.errors import InvalidArgument, NotFound
from executor_svc.simulated.profiles import PROFILES, StepShape
from executor_svc.simulated.runner import SimulatedRunner, build_simulated_runner
from executor_svc.simulated.settings import SimulatedSettings
from executor_svc.simulated.token_model import TokenModel, digest_of
from executor_svc.step import (
    BlockCopy,
    BlockTableDelta,
    SamplingParams,
    SequenceWork,
    StepRequest,
)

TINY = str(Path(__file__).resolve().parents[2] / "models" / "tiny-llama")  # vocab 512, EOS 2
PROMPT = (1, 17, 400, 23, 99, 5, 311, 42, 8, 77, 250, 3, 64, 128, 9, 500, 31, 2, 6)  # 19


def _runner(**overrides: object) -> SimulatedRunner:
    base: dict[str, object] = {"model": TINY, "time_scale": 0.0, "num_blocks": 64,
                               "num_cpu_blocks": 8}
    base.update(overrides)
    return build_simulated_runner(SimulatedSettings(**base))  # type: ignore[arg-type]


def _new(rid: str, tokens: tuple[int, ...], blocks: tuple[int, ...], start: int = 0,
         **sampling: object) -> SequenceWork:
    return SequenceWork(rid, tokens, start, BlockTableDelta(0, blocks),
                        SamplingParams(**sampling), sample=True)  # type: ignore[arg-type]


def _decode(runner: SimulatedRunner, rid: str, token: int, new_block: int | None = None,
            ) -> int:
    state = runner.requests[rid]
    delta = None if new_block is None else BlockTableDelta(len(state.block_table), (new_block,))
    work = SequenceWork(rid, (token,), state.num_tokens, delta, sample=True)
    return runner.execute(StepRequest(seqs=(work,))).tokens[0].token_id


def _generate(runner: SimulatedRunner, rid: str, first: int, num: int,
              spare: list[int]) -> list[int]:
    out = [first]
    for _ in range(num):
        held = runner.requests[rid].num_tokens
        block = spare.pop() if held % runner.limits.block_size == 0 else None
        out.append(_decode(runner, rid, out[-1], block))
    return out


def test_token_model_is_a_function_of_the_tokens_so_far() -> None:
    # The same prefix gives the same token; a different token anywhere gives another digest.
    model = TokenModel(512, frozenset({2}))
    assert model.generate(PROMPT, 8) == model.generate(list(PROMPT), 8)
    assert digest_of(PROMPT) != digest_of((PROMPT[0] + 1, *PROMPT[1:]))
    assert 2 not in model.generate(PROMPT, 200), "EOS is never sampled"


def test_token_model_logprobs_are_the_log_softmax_of_its_logits() -> None:
    # The reported logprob and top-k are exactly the row's log-softmax and its k best.
    model = TokenModel(512, frozenset({2}))
    digest = digest_of(PROMPT)
    row = model.logits(digest)
    norm = math.log(sum(math.exp(x) for x in row if x != -math.inf))
    top = model.top_logprobs(digest, 5)
    assert top[0][0] == model.next_token(digest) == row.index(max(row))
    for token_id, logprob in top:
        assert logprob == pytest.approx(row[token_id] - norm, abs=1e-9)
    assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)


def test_runner_prefill_and_decode_follow_the_token_model() -> None:
    # A 19-token prompt on scattered blocks, then 20 decodes: the token model's continuation.
    runner, spare = _runner(), [40, 7, 33, 12]
    first = runner.execute(StepRequest(seqs=(_new("a", PROMPT, (50, 3)),))).tokens[0]
    assert first.logprob == pytest.approx(runner.tokens.logprob(0))
    out = _generate(runner, "a", first.token_id, 20, spare)
    assert out == runner.tokens.generate(PROMPT, 21)


def test_runner_chunked_prefill_equals_one_prefill() -> None:
    # The prompt in chunks of 7 (only the last samples) continues as in one step.
    runner = _runner()
    for start in range(0, 14, 7):
        work = SequenceWork("c", PROMPT[start:start + 7], start,
                            BlockTableDelta(0, (9, 21)) if start == 0 else None,
                            SamplingParams() if start == 0 else None, sample=False)
        assert runner.execute(StepRequest(seqs=(work,))).tokens == ()
    last = SequenceWork("c", PROMPT[14:], 14, sample=True)
    first = runner.execute(StepRequest(seqs=(last,))).tokens[0].token_id
    assert first == runner.tokens.generate(PROMPT, 1)[0]


def test_forked_child_continues_like_the_parent() -> None:
    # n > 1: the child shares the parent's full block and copies its partial one.
    runner = _runner()
    first = runner.execute(StepRequest(seqs=(_new("parent", PROMPT, (10, 11)),))).tokens[0]
    child = _new("child", (first.token_id,), (10, 12), start=len(PROMPT))
    parent = SequenceWork("parent", (first.token_id,), len(PROMPT), sample=True)
    reply = runner.execute(StepRequest(seqs=(parent, child), copies=(BlockCopy(11, 12),)))
    assert reply.tokens[0].token_id == reply.tokens[1].token_id
    assert (_generate(runner, "parent", reply.tokens[0].token_id, 5, [20, 21])
            == _generate(runner, "child", reply.tokens[1].token_id, 5, [22, 23]))


def test_cached_prefix_continues_like_the_whole_prompt() -> None:
    # A second request starts past the first's full block (a prefix-cache hit) and samples
    # what the whole prompt gives; pointing its table at the wrong block changes the tokens.
    runner = _runner()
    runner.execute(StepRequest(seqs=(_new("owner", PROMPT, (30, 31)),)))
    hit = runner.execute(StepRequest(seqs=(_new("hit", PROMPT[16:], (30, 32), start=16),)))
    assert hit.tokens[0].token_id == runner.tokens.generate(PROMPT, 1)[0]
    miss = runner.execute(StepRequest(seqs=(_new("miss", PROMPT[16:], (31, 33), start=16),)))
    assert miss.tokens[0].token_id != hit.tokens[0].token_id


def test_swap_out_and_in_keeps_the_state_of_the_blocks() -> None:
    # Swapped out, overwritten on the device, swapped into other blocks: tokens unchanged.
    runner = _runner()
    first = runner.execute(StepRequest(seqs=(_new("s", PROMPT, (4, 5)),))).tokens[0].token_id
    runner.execute(StepRequest(swap_out=(BlockCopy(4, 0), BlockCopy(5, 1))))
    runner.execute(StepRequest(seqs=(_new("intruder", PROMPT[::-1], (4, 5)),)))
    resume = SequenceWork("s", (first,), len(PROMPT), BlockTableDelta(0, (6, 8)), sample=True)
    reply = runner.execute(StepRequest(seqs=(resume,), release_request_ids=("intruder",),
                                       swap_in=(BlockCopy(0, 6), BlockCopy(1, 8))))
    assert [first, reply.tokens[0].token_id] == runner.tokens.generate(PROMPT, 2)


def test_use_sampled_token_stands_for_the_last_sampled_token() -> None:
    # A decode sent before the last step's token came back, with 0 in its place.
    runner = _runner()
    first = runner.execute(StepRequest(seqs=(_new("u", PROMPT, (1, 2)),))).tokens[0].token_id
    ahead = SequenceWork("u", (0,), len(PROMPT), sample=True, use_sampled_token=True)
    second = runner.execute(StepRequest(seqs=(ahead,))).tokens[0].token_id
    assert [first, second] == runner.tokens.generate(PROMPT, 2)


def test_rejected_step_changes_nothing() -> None:
    # The real executor's plan: a bad sequence rejects the step before the good one runs.
    runner = _runner()
    runner.execute(StepRequest(seqs=(_new("w", PROMPT, (1, 2)),)))
    good = SequenceWork("w", (5,), len(PROMPT), sample=True)
    with pytest.raises(InvalidArgument, match="block id 64 is outside"):
        runner.execute(StepRequest(seqs=(good, _new("bad", (5,), (64,)))))
    with pytest.raises(NotFound):
        runner.execute(StepRequest(seqs=(good, SequenceWork("never", (5,), 0, sample=True))))
    assert set(runner.requests) == {"w"} and runner.requests["w"].num_tokens == len(PROMPT)


def test_top_logprobs_when_asked() -> None:
    # A request asking for 5 gets the token model's 5 best; one that does not, none.
    runner = _runner()
    reply = runner.execute(StepRequest(seqs=(_new("t", PROMPT, (1, 2), top_logprobs=5),
                                             _new("n", PROMPT, (3, 4)))))
    top, plain = reply.tokens
    assert top.top_logprobs == runner.tokens.top_logprobs(digest_of(PROMPT), 5)
    assert plain.top_logprobs == () and top.token_id == plain.token_id


def test_step_sleeps_out_the_modelled_time_scaled() -> None:
    # A 19-token prefill on llama3-8b-h100 at --time-scale 2: one sleep of about twice the
    # modelled time (less the step's own compute); a step with no work does not sleep.
    slept: list[float] = []
    runner = _runner(time_scale=2.0)
    runner.sleep = slept.append
    runner.execute(StepRequest(seqs=(_new("a", PROMPT, (1, 2)),)))
    modelled = PROFILES["llama3-8b-h100"].step_ms(StepShape(19, 19), 16) / 1e3
    assert len(slept) == 1 and 2 * modelled - 0.005 < slept[0] <= 2 * modelled
    runner.execute(StepRequest(release_request_ids=("a",)))
    assert len(slept) == 1


@pytest.mark.e2e  # (a Python subprocess)
def test_simulated_executor_imports_no_torch() -> None:
    # A fleet on a small machine: the package and the servicer stay clear of torch.
    import subprocess

    code = ("import sys, executor_svc.simulated.__main__, executor_svc.simulated.runner, "
            "executor_svc.service; print('torch' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.split() == ["False", "False"]
