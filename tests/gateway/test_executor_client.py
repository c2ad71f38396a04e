"""The executor client's conversions: a sequence's sampling to SamplingParams, the logprobs of
an Execute answer back; and what exec_sampling sends for new, forked and recomputed sequences.

Against a recording executor servicer on loopback (a real gRPC server on port 0)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from common.server import start_server
from gateway.api.sampling import SamplingOptions
from gateway.clients.call_failures import Rejected
from gateway.clients.executor_client import ExecutorClient
from gateway.core.request_state import Request, Sequence
from gateway.core.step import ExecSampling, ExecuteCall, ExecuteResult, SeqWork, TableDelta
from pagedkv.executor.v1 import executor_pb2 as epb
from pagedkv.executor.v1 import executor_pb2_grpc as epb_grpc

pytestmark = pytest.mark.service


class _Recording(epb_grpc.ExecutorServiceServicer):
    """Records each Execute and answers with a canned response; Describe names EOS 2."""

    def __init__(self, response: epb.ExecuteResponse) -> None:
        self.response = response
        self.requests: list[epb.ExecuteRequest] = []

    async def Describe(self, request: Any, context: Any) -> epb.DescribeResponse:  # noqa: N802
        return epb.DescribeResponse(eos_token_ids=[2], vocab_size=100)

    async def Execute(self, request: Any, context: Any) -> epb.ExecuteResponse:  # noqa: N802
        self.requests.append(request)
        return self.response


def _call(sampling: ExecSampling | None) -> ExecuteCall:
    """A new sequence 'a' starting at 3 (after a cached prefix) and two compact decodes."""
    return ExecuteCall(
        release_request_ids=(), swap_out=(), swap_in=(), copies=(),
        seqs=(SeqWork("a", (7, 8), 3, TableDelta(0, (0,)), sample=True, sampling=sampling),),
        decode_request_ids=("b", "c"), decode_token_ids=(3, 4), decode_positions=(9, 5),
    )


def _execute(response: epb.ExecuteResponse, call: ExecuteCall
             ) -> tuple[ExecuteResult, epb.ExecuteRequest]:
    async def scenario() -> tuple[ExecuteResult, epb.ExecuteRequest]:
        servicer = _Recording(response)
        server = await start_server([(servicer, "pagedkv.executor.v1.ExecutorService")],
                                    "127.0.0.1", 0)
        client = ExecutorClient(f"127.0.0.1:{server.port}")
        try:
            await client.describe(timeout=5)
            return await client.execute(call, timeout=5), servicer.requests[0]
        finally:
            await client.close()
            await server.server.stop(0)

    return asyncio.run(scenario())


ANSWER = epb.ExecuteResponse(
    tokens=[epb.SampledToken(request_id="a", token_id=9, logprob=-0.5, top_logprobs=[
        epb.TopLogprob(token_id=9, logprob=-0.5), epb.TopLogprob(token_id=4, logprob=-1.5)])],
    decode_sampled_token_ids=[11, 12], decode_logprobs=[-0.25, -2.0],
    decode_num_top_logprobs=[0, 2], decode_top_token_ids=[12, 1],
    decode_top_logprobs=[-2.0, -2.5],
)


def test_executor_client_sends_sampling_and_returns_logprobs() -> None:
    # Every field reaches SamplingParams; min_tokens masks the request's stop ids plus the
    # executor's EOS (2); the history goes in SequenceWork. Back: each token's logprob and top
    # logprobs, the compact decodes' row by row.
    sampling = ExecSampling(
        temperature=0.5, top_p=0.75, top_k=4, seed=9, min_p=0.25, presence_penalty=0.5,
        frequency_penalty=-1.0, repetition_penalty=1.5, logit_bias=((5, 2.0), (6, -1.0)),
        min_tokens=3, stop_token_ids=(7,), num_prompt_tokens=4, top_logprobs=2,
        history_token_ids=(1, 2, 3),
    )
    result, sent = _execute(ANSWER, _call(sampling))
    seq = sent.seqs[0]
    assert (seq.sampling.temperature, seq.sampling.top_p, seq.sampling.top_k, seq.sampling.seed,
            seq.sampling.min_p) == (0.5, 0.75, 4, 9, 0.25)
    assert (seq.sampling.presence_penalty, seq.sampling.frequency_penalty,
            seq.sampling.repetition_penalty) == (0.5, -1.0, 1.5)
    assert dict(seq.sampling.logit_bias) == {5: 2.0, 6: -1.0}
    assert (seq.sampling.min_tokens, list(seq.sampling.stop_token_ids)) == (3, [2, 7])
    assert (seq.sampling.num_prompt_tokens, seq.sampling.top_logprobs) == (4, 2)
    assert list(seq.history_token_ids) == [1, 2, 3]
    assert [(t.token_id, t.logprob, t.top_logprobs) for t in result.tokens] == [
        (9, -0.5, ((9, -0.5), (4, -1.5)))
    ]
    assert result.decode_logprobs == (-0.25, -2.0)
    assert result.decode_top_logprobs == ((), ((12, -2.0), (1, -2.5)))


def test_executor_client_min_tokens_leaves_eos_alone_with_ignore_eos() -> None:
    # ignore_eos: only the request's own stop ids are masked; without min_tokens, none.
    masked = ExecSampling(0.0, 1.0, 0, None, min_tokens=2, stop_token_ids=(7,), ignore_eos=True)
    _, sent = _execute(ANSWER, _call(masked))
    assert list(sent.seqs[0].sampling.stop_token_ids) == [7]
    _, sent = _execute(ANSWER, _call(ExecSampling(0.0, 1.0, 0, None, stop_token_ids=(7,))))
    assert list(sent.seqs[0].sampling.stop_token_ids) == []


@pytest.mark.parametrize(
    ("response", "message"),
    [
        (epb.ExecuteResponse(tokens=ANSWER.tokens, decode_sampled_token_ids=[1, 2]),
         "returned 0 logprobs for 2 compact decodes"),
        (epb.ExecuteResponse(tokens=ANSWER.tokens, decode_sampled_token_ids=[1, 2],
                             decode_logprobs=[0.0, 0.0], decode_num_top_logprobs=[1, 1],
                             decode_top_token_ids=[3], decode_top_logprobs=[0.0]),
         "2 top-logprob counts"),
    ],
)
def test_executor_client_rejects_logprob_columns_that_break_the_contract(
    response: epb.ExecuteResponse, message: str
) -> None:
    # A logprob per compact decode; top-logprob counts one per row, summing to the entries.
    with pytest.raises(Rejected, match=message):
        _execute(response, _call(None))


def _sequence(options: SamplingOptions, num_computed: int, outputs: list[int]) -> Sequence:
    request = Request(request_id="r", prompt_token_ids=[5, 6, 7, 8], sampling=options,
                      cache_salt="")
    seq = Sequence(seq_id="r-0", request=request, index=0, output_token_ids=list(outputs))
    seq.num_computed_tokens = num_computed
    return seq


def test_exec_sampling_sends_history_only_for_penalties_past_position_0() -> None:
    # A penalised n > 1 child starting at the prompt's last token sends the prompt before it;
    # a recomputed one starting at 0 sends none, a plain one none; num_prompt_tokens is the
    # prompt's length whatever the sequence has generated; logprobs None asks for no top ones.
    penalised = SamplingOptions(max_tokens=8, repetition_penalty=1.2, logprobs=3,
                                min_tokens=2, stop_token_ids=frozenset({9, 4}))
    child = _sequence(penalised, 3, []).exec_sampling()
    assert (child.history_token_ids, child.num_prompt_tokens) == ((5, 6, 7), 4)
    assert (child.top_logprobs, child.min_tokens, child.stop_token_ids) == (3, 2, (4, 9))
    recomputed = _sequence(penalised, 0, [10, 11]).exec_sampling()
    assert (recomputed.history_token_ids, recomputed.num_prompt_tokens) == ((), 4)
    past_outputs = _sequence(penalised, 5, [10, 11]).exec_sampling()
    assert past_outputs.history_token_ids == (5, 6, 7, 8, 10)
    plain = _sequence(SamplingOptions(max_tokens=8), 3, []).exec_sampling()
    assert (plain.history_token_ids, plain.top_logprobs, plain.stop_token_ids) == ((), 0, ())
