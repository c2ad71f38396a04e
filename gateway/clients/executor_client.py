"""One executor, seen from the gateway: typed calls over the generated stub.

A failed call raises its call_failures.CallFailed; an answer that breaks the contract (tokens
missing or out of order) is Rejected, as a refused step is."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from common.channel import InternalChannel
from common.credentials import InternalAuth
from common.executor_description import ExecutorDescription, LoraAdapterInfo
from common.step_records import BlockCopy
from common.structured_output import to_oneof
from gateway.clients.call_failures import Rejected, translated
from gateway.core.step import (
    ExecSampling,
    ExecuteCall,
    ExecuteResult,
    PromptLogprobRun,
    Sampled,
    SeqWork,
)
from pagedkv.executor.v1 import executor_pb2 as pb
from pagedkv.executor.v1 import executor_pb2_grpc as pb_grpc


@dataclass(frozen=True, slots=True)
class KVImport:
    """What an ImportKV moved."""

    num_blocks: int
    num_bytes: int
    elapsed_ms: float


def _copies(copies: Sequence[BlockCopy]) -> list[pb.BlockCopy]:
    return [pb.BlockCopy(src_block_id=c.src_block_id, dst_block_id=c.dst_block_id)
            for c in copies]


def _sampling(s: ExecSampling, eos_token_ids: tuple[int, ...]) -> pb.SamplingParams:
    msg = pb.SamplingParams(
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p,
        presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty, logit_bias=dict(s.logit_bias),
        min_tokens=s.min_tokens, num_prompt_tokens=s.num_prompt_tokens,
        top_logprobs=s.top_logprobs,
    )
    if s.seed is not None:
        msg.seed = s.seed
    if s.prompt_logprobs is not None:
        msg.prompt_logprobs = s.prompt_logprobs
    if s.structured_output is not None:
        to_oneof(s.structured_output, msg.structured_output)
    if s.min_tokens:  # what min_tokens masks: the request's stop ids and (vLLM) EOS
        eos = () if s.ignore_eos else eos_token_ids
        msg.stop_token_ids.extend(sorted({*s.stop_token_ids, *eos}))
    return msg


def _seq(work: SeqWork, eos_token_ids: tuple[int, ...]) -> pb.SequenceWork:
    seq = pb.SequenceWork(
        request_id=work.request_id,
        token_ids=work.token_ids,
        start_position=work.start_position,
        sample=work.sample,
        use_sampled_token=work.use_sampled_token,
        num_draft_tokens=work.num_draft_tokens,
    )
    if work.delta is not None:
        seq.delta.start_index = work.delta.start_index
        seq.delta.block_ids.extend(work.delta.block_ids)
    if work.sampling is not None:
        seq.sampling.CopyFrom(_sampling(work.sampling, eos_token_ids))
        seq.history_token_ids.extend(work.sampling.history_token_ids)
        seq.prompt_token_ids.extend(work.sampling.prompt_token_ids)
        seq.lora_adapter = work.sampling.lora_adapter
        seq.lora_adapter_digest = work.sampling.lora_adapter_digest
    return seq


def _top(entries: Sequence[pb.TopLogprob]) -> tuple[tuple[int, float], ...]:
    return tuple((e.token_id, e.logprob) for e in entries)


def _decode_tops(
    response: pb.ExecuteResponse, num_decodes: int
) -> tuple[tuple[tuple[int, float], ...], ...]:
    """The compact decodes' top logprobs, row by row, from their columns (empty: none)."""
    counts = response.decode_num_top_logprobs
    if not counts:
        return ()
    ids, logprobs = response.decode_top_token_ids, response.decode_top_logprobs
    if len(counts) != num_decodes or not sum(counts) == len(ids) == len(logprobs):
        raise Rejected(
            "INTERNAL",
            f"the executor returned {len(counts)} top-logprob counts (sum {sum(counts)}) for "
            f"{num_decodes} compact decodes with {len(ids)} ids and {len(logprobs)} logprobs "
            "(pagedkv.executor.v1; see tests/conformance)",
        )
    rows: list[tuple[tuple[int, float], ...]] = []
    start = 0
    for count in counts:
        rows.append(tuple(zip(ids[start : start + count], logprobs[start : start + count],
                              strict=True)))
        start += count
    return tuple(rows)


def _prompt_runs(response: pb.ExecuteResponse, call: ExecuteCall
                 ) -> tuple[PromptLogprobRun, ...]:
    """The prompt logprobs, checked against what the call asked for."""
    asked = {w.request_id for w in call.seqs}  # (a chunk after the first asks by state)
    runs = []
    for run in response.prompt_logprobs:
        k, n = run.num_top_logprobs, len(run.logprobs)
        if (run.request_id not in asked or len(run.ranks) != n or run.first_position < 1
                or not len(run.top_token_ids) == len(run.top_logprobs) == k * n):
            raise Rejected(
                "INTERNAL",
                f"the executor returned malformed prompt logprobs for {run.request_id!r} "
                "(pagedkv.executor.v1 PromptLogprobs; see tests/conformance)")
        ids, values = run.top_token_ids, run.top_logprobs
        tops = tuple(tuple(zip(ids[i * k:(i + 1) * k], values[i * k:(i + 1) * k], strict=True))
                     for i in range(n))
        runs.append(PromptLogprobRun(run.request_id, run.first_position, tuple(run.logprobs),
                                     tuple(run.ranks), tops))
    return tuple(runs)


class ExecutorClient(InternalChannel):
    def __init__(self, address: str, auth: InternalAuth | None = None) -> None:
        super().__init__(address, auth)
        self.stub = pb_grpc.ExecutorServiceStub(self.channel)
        # Its model's EOS ids (from describe()): min_tokens masks them too, unless ignore_eos.
        self.eos_token_ids: tuple[int, ...] = ()

    async def describe(self, timeout: float | None = None) -> ExecutorDescription:
        with translated():
            r = await self.stub.Describe(pb.DescribeRequest(), metadata=self.auth_metadata,
                                       timeout=timeout)
        self.eos_token_ids = tuple(r.eos_token_ids)
        return ExecutorDescription.from_proto(r)

    async def load_lora_adapter(self, name: str, path: str,
                                timeout: float | None = None) -> LoraAdapterInfo:
        with translated():
            r = await self.stub.LoadLoraAdapter(pb.LoadLoraAdapterRequest(name=name, path=path),
                                              metadata=self.auth_metadata, timeout=timeout)
        return LoraAdapterInfo.from_proto(r)

    async def unload_lora_adapter(self, name: str, timeout: float | None = None) -> None:
        with translated():
            await self.stub.UnloadLoraAdapter(pb.UnloadLoraAdapterRequest(name=name),
                                              metadata=self.auth_metadata, timeout=timeout)

    async def execute(
        self, call: ExecuteCall, timeout: float | None = None, step_id: int = 0,
        previous_step_id: int = 0,
    ) -> ExecuteResult:
        """`step_id` / `previous_step_id`: the ordering of calls launched ahead (the proto)."""
        # Plain decodes travel in the compact columns (a message per sequence costs ~4 us).
        request = pb.ExecuteRequest(
            release_request_ids=call.release_request_ids,
            swap_out=_copies(call.swap_out),
            swap_in=_copies(call.swap_in),
            copies=_copies(call.copies),
            seqs=[_seq(w, self.eos_token_ids) for w in call.seqs],
            decode_request_ids=call.decode_request_ids,
            decode_token_ids=call.decode_token_ids,
            decode_positions=call.decode_positions,
            decode_use_sampled_token=call.decode_use_sampled_token,
            step_id=step_id,
            previous_step_id=previous_step_id,
        )
        with translated():
            response = await self.stub.Execute(request, metadata=self.auth_metadata,
                                                timeout=timeout)
        num_decodes = len(call.decode_request_ids)
        if len(response.decode_sampled_token_ids) != num_decodes:
            # An executor that predates the compact columns ignored them: a rejected step.
            raise Rejected(
                "UNIMPLEMENTED",
                f"the executor returned {len(response.decode_sampled_token_ids)} tokens for "
                f"{num_decodes} compact decodes: it must implement decode_request_ids "
                "(pagedkv.executor.v1; see tests/conformance)",
            )
        sampling = [w.request_id for w in call.seqs if w.sample]
        if [t.request_id for t in response.tokens] != sampling:
            raise Rejected(
                "INTERNAL",
                f"the executor returned sampled tokens for {len(response.tokens)} sequences, "
                f"not one for each of the {len(sampling)} that sample, in their order "
                "(pagedkv.executor.v1; see tests/conformance)",
            )
        if len(response.decode_logprobs) != num_decodes:
            raise Rejected(
                "INTERNAL",
                f"the executor returned {len(response.decode_logprobs)} logprobs for "
                f"{num_decodes} compact decodes (pagedkv.executor.v1; see tests/conformance)",
            )
        drafts = {w.request_id: w.num_draft_tokens for w in call.seqs if w.num_draft_tokens}
        for t in response.tokens:
            if t.num_accepted_draft_tokens > drafts.get(t.request_id, 0):
                raise Rejected(
                    "INTERNAL",
                    f"the executor accepted {t.num_accepted_draft_tokens} draft tokens of "
                    f"{t.request_id!r}, which was sent {drafts.get(t.request_id, 0)} "
                    "(pagedkv.executor.v1; see tests/conformance)",
                )
        timings = response.timings
        return ExecuteResult(
            tokens=tuple(
                Sampled(t.request_id, t.token_id, t.logprob, _top(t.top_logprobs),
                        t.num_accepted_draft_tokens)
                for t in response.tokens
            ),
            compute_ms=timings.forward_ms + timings.sample_ms,
            decode_token_ids=tuple(response.decode_sampled_token_ids),
            decode_logprobs=tuple(response.decode_logprobs),
            decode_top_logprobs=_decode_tops(response, num_decodes),
            forward_ms=timings.forward_ms,
            sample_ms=timings.sample_ms,
            executor_ms=timings.total_ms,
            num_tokens=response.num_tokens,
            prompt_logprobs=_prompt_runs(response, call),
        )

    async def import_kv(
        self, source_address: str, request_id: str, first_block_index: int,
        block_ids: Sequence[int], num_tokens: int, timeout: float | None = None,
        previous_step_id: int = 0,
    ) -> KVImport:
        """Have this executor pull `request_id`'s KV from the executor at `source_address`:
        table indices `first_block_index` on (those before are here already) into
        `block_ids`, the blocks of its first `num_tokens` tokens. On failure the blocks may
        hold partial data (the proto's ImportKVResponse)."""
        request = pb.ImportKVRequest(
            source_address=source_address, request_id=request_id,
            first_block_index=first_block_index, block_ids=block_ids, num_tokens=num_tokens,
            previous_step_id=previous_step_id,
        )
        with translated():
            r = await self.stub.ImportKV(request, metadata=self._about([request_id]),
                                         timeout=timeout)
        return KVImport(num_blocks=r.num_blocks, num_bytes=r.num_bytes, elapsed_ms=r.elapsed_ms)

    async def release(self, request_ids: Sequence[str], timeout: float | None = None) -> None:
        with translated():
            await self.stub.Release(
                pb.ReleaseRequest(request_ids=request_ids),
                metadata=self._about(request_ids),
                timeout=timeout,
            )
