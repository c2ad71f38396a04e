"""Speculative decoding in the executor contract (SequenceWork.num_draft_tokens): an executor
that reports max_draft_tokens verifies drafts greedily, returns how many it accepted and
the token after them, and then holds the known token and the accepted drafts only."""

from __future__ import annotations

import random

import grpc
import pytest

from pagedkv.executor.v1 import executor_pb2 as pb

from .conftest import Executor, Reference, reference_generate, require_optional

pytestmark = pytest.mark.conformance


def require_drafts(executor: Executor) -> None:
    require_optional(executor, "max_draft_tokens", "draft tokens")


def drafted(executor: Executor, rid: str, last: int, drafts: list[int]) -> pb.SequenceWork:
    """The verifying row: room for every draft; the caller then holds what was accepted."""
    work = executor.work(rid, [last, *drafts])
    work.num_draft_tokens = len(drafts)
    return work


def test_drafts_are_accepted_while_they_equal_the_greedy_tokens(
        executor: Executor, reference: Reference) -> None:
    require_drafts(executor)
    rng = random.Random(7)
    prompt = [rng.randrange(3, executor.info.vocab_size) for _ in range(12)]
    expected = reference_generate(reference, prompt, 24)
    reply = executor.execute(executor.work("draft-0", prompt))
    out = [reply.tokens[0].token_id]
    for wrong in (3, 0, 2, None):  # the first draft not the reference's (None: all right)
        drafts = expected[len(out):len(out) + 4]
        if wrong is not None:
            drafts[wrong] = (drafts[wrong] + 1) % executor.info.vocab_size
        (token,) = executor.execute(drafted(executor, "draft-0", out[-1], drafts)).tokens
        accepted = 4 if wrong is None else wrong
        assert token.num_accepted_draft_tokens == accepted
        out += [*drafts[:accepted], token.token_id]
        # It holds the known token and the accepted drafts: the next step starts after them.
        executor.held["draft-0"] -= 4 - accepted
    assert out == expected[:len(out)]
    executor.forget("draft-0")


def test_a_step_past_the_accepted_drafts_is_refused(executor: Executor,
                                                    reference: Reference) -> None:
    require_drafts(executor)
    prompt = [5, 6, 7, 8]
    expected = reference_generate(reference, prompt, 3)
    reply = executor.execute(executor.work("draft-1", prompt))
    wrong = (expected[2] + 1) % executor.info.vocab_size  # the second draft is rejected
    work = drafted(executor, "draft-1", reply.tokens[0].token_id, [expected[1], wrong, wrong])
    (token,) = executor.execute(work).tokens
    assert (token.num_accepted_draft_tokens, token.token_id) == (1, expected[2])
    # A caller that counted every draft held starts two positions too far.
    with pytest.raises(grpc.RpcError) as refused:
        executor.execute(executor.work("draft-1", [token.token_id]))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "send start_position=6" in refused.value.details()
    executor.forget("draft-1")


@pytest.mark.parametrize(("fields", "message"), [
    (dict(num_draft_tokens=17), "num_draft_tokens=17 is out of range"),
    (dict(num_draft_tokens=3), "one less than its 3 token_ids"),
    (dict(num_draft_tokens=2, sample=False), "need sample"),
])
def test_bad_drafts_are_invalid_argument(executor: Executor, fields: dict,
                                         message: str) -> None:
    require_drafts(executor)
    reply = executor.execute(executor.work("draft-2", [5, 6, 7]))
    work = executor.work("draft-2", [reply.tokens[0].token_id, 4, 4])
    for name, value in fields.items():
        setattr(work, name, value)
    with pytest.raises(grpc.RpcError) as refused:
        executor.execute(work)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in refused.value.details()
    executor.forget("draft-2")


def test_drafts_under_sampling_are_invalid_argument(executor: Executor) -> None:
    require_drafts(executor)
    reply = executor.execute(executor.work("draft-3", [5, 6, 7], temperature=0.8))
    with pytest.raises(grpc.RpcError) as refused:
        executor.execute(drafted(executor, "draft-3", reply.tokens[0].token_id, [4]))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "only under greedy sampling" in refused.value.details()
    executor.forget("draft-3")
