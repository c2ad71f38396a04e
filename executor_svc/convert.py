"""Proto <-> step records. With the servicer, the only module that imports generated code."""

from __future__ import annotations

from common.errors import InvalidArgument
from common.structured_output import from_oneof
from executor_svc.step import (
    BlockCopy,
    BlockTableDelta,
    PromptLogprobs,
    SampledToken,
    SamplingParams,
    SequenceWork,
    StepRequest,
    StepResult,
)
from pagedkv.executor.v1 import executor_pb2 as pb


def sampling_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=msg.temperature,
        top_p=msg.top_p if msg.top_p != 0.0 else 1.0,  # the contract reads 0 as 1
        top_k=msg.top_k,
        seed=msg.seed if msg.HasField("seed") else None,
        min_p=msg.min_p,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        # 0 (unset) is read as 1 (off)
        repetition_penalty=msg.repetition_penalty if msg.repetition_penalty != 0.0 else 1.0,
        logit_bias=tuple(sorted(msg.logit_bias.items())),
        min_tokens=msg.min_tokens,
        stop_token_ids=tuple(msg.stop_token_ids),
        num_prompt_tokens=msg.num_prompt_tokens,
        top_logprobs=msg.top_logprobs,
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
        structured_output=(from_oneof(msg.structured_output, "sampling.structured_output")
                           if msg.HasField("structured_output") else None),
    )


def _delta(msg: pb.SequenceWork) -> BlockTableDelta | None:
    if not msg.HasField("delta") or not msg.delta.block_ids:
        return None
    return BlockTableDelta(start_index=msg.delta.start_index, block_ids=tuple(msg.delta.block_ids))


def sequence_from_proto(msg: pb.SequenceWork) -> SequenceWork:
    return SequenceWork(
        request_id=msg.request_id,
        token_ids=tuple(msg.token_ids),
        start_position=msg.start_position,
        delta=_delta(msg),
        sampling=sampling_from_proto(msg.sampling) if msg.HasField("sampling") else None,
        sample=msg.sample,
        use_sampled_token=msg.use_sampled_token,
        history_token_ids=tuple(msg.history_token_ids),
        prompt_token_ids=tuple(msg.prompt_token_ids),
        num_draft_tokens=msg.num_draft_tokens,
        lora_adapter=msg.lora_adapter,
        lora_adapter_digest=msg.lora_adapter_digest,
    )


def _copies(msgs: object) -> tuple[BlockCopy, ...]:
    return tuple(BlockCopy(m.src_block_id, m.dst_block_id) for m in msgs)  # type: ignore[attr-defined]


def compact_decodes(msg: pb.ExecuteRequest) -> list[SequenceWork]:
    """The compact decode columns as the SequenceWork they abbreviate."""
    ids, tokens, positions = msg.decode_request_ids, msg.decode_token_ids, msg.decode_positions
    if not len(ids) == len(tokens) == len(positions):
        raise InvalidArgument(
            f"decode_request_ids, decode_token_ids and decode_positions must have equal "
            f"lengths, got {len(ids)}, {len(tokens)} and {len(positions)}"
        )
    use_sampled = msg.decode_use_sampled_token or [False] * len(ids)
    if len(use_sampled) != len(ids):
        raise InvalidArgument(
            f"decode_use_sampled_token must be empty or have one entry per compact decode, "
            f"got {len(use_sampled)} for {len(ids)}"
        )
    return [
        SequenceWork(rid, (token,), position, None, None, True, chained)
        for rid, token, position, chained in zip(ids, tokens, positions, use_sampled, strict=True)
    ]


def step_from_proto(msg: pb.ExecuteRequest) -> StepRequest:
    columns = (
        msg.decode_request_ids or msg.decode_token_ids or msg.decode_positions
        or msg.decode_use_sampled_token
    )
    decodes = compact_decodes(msg) if columns else []
    return StepRequest(
        seqs=(*decodes, *(sequence_from_proto(s) for s in msg.seqs)),
        release_request_ids=tuple(msg.release_request_ids),
        swap_out=_copies(msg.swap_out),
        swap_in=_copies(msg.swap_in),
        copies=_copies(msg.copies),
    )


def _top(token: SampledToken) -> list[pb.TopLogprob]:
    return [pb.TopLogprob(token_id=t, logprob=lp) for t, lp in token.top_logprobs]


def result_to_proto(result: StepResult, num_compact_decodes: int = 0) -> pb.ExecuteResponse:
    """`num_compact_decodes`: the request's compact decodes, which sampled first, in order."""
    compact, rest = result.tokens[:num_compact_decodes], result.tokens[num_compact_decodes:]
    # The compact decodes' top logprobs as columns, only when one of them has any.
    tops = [t.top_logprobs for t in compact if t.top_logprobs]
    return pb.ExecuteResponse(
        tokens=[
            pb.SampledToken(request_id=t.request_id, token_id=t.token_id, logprob=t.logprob,
                            top_logprobs=_top(t),
                            num_accepted_draft_tokens=t.num_accepted_draft_tokens)
            for t in rest
        ],
        decode_sampled_token_ids=[t.token_id for t in compact],
        decode_logprobs=[t.logprob for t in compact],
        decode_num_top_logprobs=[len(t.top_logprobs) for t in compact] if tops else [],
        decode_top_token_ids=[token_id for top in tops for token_id, _ in top],
        decode_top_logprobs=[logprob for top in tops for _, logprob in top],
        timings=pb.Timings(
            forward_ms=result.timings.forward_ms,
            sample_ms=result.timings.sample_ms,
            total_ms=result.timings.total_ms,
        ),
        num_tokens=result.num_tokens,
        prompt_logprobs=[_prompt_logprobs(p) for p in result.prompt_logprobs],
    )


def _prompt_logprobs(run: PromptLogprobs) -> pb.PromptLogprobs:
    k = len(run.top_logprobs[0]) if run.top_logprobs else 0
    return pb.PromptLogprobs(
        request_id=run.request_id, first_position=run.first_position, logprobs=run.logprobs,
        ranks=run.ranks, num_top_logprobs=k,
        top_token_ids=[t for top in run.top_logprobs for t, _ in top],
        top_logprobs=[lp for top in run.top_logprobs for _, lp in top])
