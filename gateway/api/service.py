"""The public gRPC servicer: decode the proto, call the frontend, encode the answer."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc

from common.auth import caller
from common.errors import InvalidArgument
from common.executor_description import LoraAdapterInfo
from common.structured_output import from_oneof
from gateway.api.frontend import Frontend, PromptInput
from gateway.api.sampling import RawSampling
from gateway.core.beam_search import EarlyStopping
from gateway.core.request_state import CompletionDelta, FinishReason, Usage
from gateway.engine.loop import Engine
from gateway.text.tokenizer import ChatTurn
from pagedkv.gateway.v1 import gateway_pb2 as pb
from pagedkv.gateway.v1 import gateway_pb2_grpc as pb_grpc

EARLY_STOPPING = {
    pb.EARLY_STOPPING_UNSPECIFIED: None,
    pb.EARLY_STOPPING_HEURISTIC: EarlyStopping.HEURISTIC,
    pb.EARLY_STOPPING_WHEN_FULL: EarlyStopping.WHEN_FULL,
    pb.EARLY_STOPPING_NEVER: EarlyStopping.NEVER,
}
FINISH_REASONS = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
}


def raw_sampling(params: pb.SamplingParams, priority: int = 0) -> RawSampling:
    return RawSampling(
        max_tokens=params.max_tokens if params.HasField("max_tokens") else None,
        temperature=params.temperature if params.HasField("temperature") else None,
        top_p=params.top_p if params.HasField("top_p") else None,
        top_k=params.top_k,
        seed=params.seed if params.HasField("seed") else None,
        stop=tuple(params.stop),
        stop_token_ids=tuple(params.stop_token_ids),
        n=params.n,
        ignore_eos=params.ignore_eos,
        min_p=params.min_p,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=(params.repetition_penalty
                            if params.HasField("repetition_penalty") else None),
        logit_bias=tuple(sorted(params.logit_bias.items())),
        min_tokens=params.min_tokens,
        logprobs=params.logprobs if params.HasField("logprobs") else None,
        prompt_logprobs=params.prompt_logprobs if params.HasField("prompt_logprobs") else None,
        include_stop_str_in_output=params.include_stop_str_in_output,
        skip_special_tokens=(params.skip_special_tokens
                             if params.HasField("skip_special_tokens") else None),
        priority=priority,
        use_beam_search=params.use_beam_search,
        beam_width=params.beam_width if params.HasField("beam_width") else None,
        length_penalty=(params.length_penalty
                        if params.HasField("length_penalty") else None),
        early_stopping=_early_stopping(params.early_stopping),
        structured_output=(
            from_oneof(params.structured_output, "sampling.structured_output")
            if params.HasField("structured_output") else None),
    )


def _early_stopping(value: int) -> EarlyStopping | None:
    if value not in EARLY_STOPPING:
        raise InvalidArgument(f"sampling.early_stopping is {value}, not an EarlyStopping value")
    return EARLY_STOPPING[pb.EarlyStopping.ValueType(value)]


def _prompt(request: Any) -> PromptInput:
    kind = request.WhichOneof("prompt")
    if kind == "text":
        return PromptInput(text=request.text)
    if kind == "token_ids":
        return PromptInput(token_ids=list(request.token_ids.ids))
    if kind == "chat":
        return PromptInput(chat=[ChatTurn(m.role, m.content) for m in request.chat.messages])
    return PromptInput()


def _usage(usage: Usage | None) -> pb.Usage | None:
    if usage is None:
        return None
    return pb.Usage(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                    cached_prompt_tokens=usage.cached_prompt_tokens)


def _logprobs(delta: CompletionDelta) -> list[pb.TokenLogprob]:
    return [pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob,
                            top_logprobs=[pb.TopLogprob(token_id=t, logprob=p) for t, p in lp.top])
            for lp in delta.logprobs]


def _prompt_logprobs(delta: CompletionDelta) -> list[pb.PromptLogprob] | None:
    if delta.prompt_logprobs is None:
        return None
    return [pb.PromptLogprob(token_id=lp.token_id, logprob=lp.logprob, rank=lp.rank,
                             top_logprobs=[pb.TopLogprob(token_id=t, logprob=p)
                                           for t, p in lp.top])
            for lp in delta.prompt_logprobs[1:] if lp is not None]


def _adapter(adapter: LoraAdapterInfo) -> pb.LoraAdapter:
    return pb.LoraAdapter(name=adapter.name, path=adapter.path, rank=adapter.rank,
                          digest=adapter.digest)


def _executor_info(engine: Engine) -> pb.ExecutorInfo:
    d = engine.description
    return pb.ExecutorInfo(address=engine.link.executor.address, pool_id=engine.pool_id,
                           num_blocks=d.num_blocks, block_size=d.block_size, backend=d.backend,
                           device=d.device, healthy=engine.healthy, role=d.role)


class GatewayServicer(pb_grpc.GatewayServiceServicer):
    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend

    async def _submit(self, request: Any) -> Any:
        return await self.frontend.submit(
            _prompt(request), raw_sampling(request.sampling, request.priority), request.cache_salt,
            request.request_id, tenant=caller(), model=request.model,
        )

    async def Generate(  # noqa: N802 - gRPC method name
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        state = await self._submit(request)
        async for delta in self.frontend.deltas(state):
            yield pb.GenerateResponse(
                request_id=state.request_id,
                index=delta.index,
                token_ids=delta.token_ids,
                text=delta.text,
                finish_reason=FINISH_REASONS[delta.finish_reason],
                usage=_usage(delta.usage),
                logprobs=_logprobs(delta) if delta.logprobs else None,
                prompt_logprobs=_prompt_logprobs(delta),
            )

    async def Complete(  # noqa: N802
        self, request: pb.CompleteRequest, context: grpc.aio.ServicerContext
    ) -> pb.CompleteResponse:
        state = await self._submit(request)
        completions = [pb.Completion(index=i) for i in range(state.sampling.n)]
        async for delta in self.frontend.deltas(state):
            _collect(completions[delta.index], delta)
        return pb.CompleteResponse(request_id=state.request_id, completions=completions)

    async def Tokenize(  # noqa: N802
        self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        return pb.TokenizeResponse(
            token_ids=await self.frontend.tokenize(request.text, tenant=caller()))

    async def GetModelInfo(  # noqa: N802
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetModelInfoResponse:
        info, adapters = self.frontend.info, self.frontend.adapters
        return pb.GetModelInfoResponse(
            model_name=info.model_name,
            max_model_len=info.max_model_len,
            vocab_size=info.vocab_size,
            eos_token_ids=info.eos_token_ids,
            executors=[_executor_info(e) for e in self.frontend.engines.engines],
            lora_adapters=[_adapter(a) for a in adapters.available().values()]
            if adapters else [],
        )

    async def LoadLoraAdapter(  # noqa: N802
        self, request: pb.LoadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.LoraAdapter:
        return _adapter(await self.frontend.lora_admin().load(request.lora_name,
                                                              request.lora_path))

    async def UnloadLoraAdapter(  # noqa: N802
        self, request: pb.UnloadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.UnloadLoraAdapterResponse:
        await self.frontend.lora_admin().unload(request.lora_name)
        return pb.UnloadLoraAdapterResponse()


def _collect(completion: pb.Completion, delta: CompletionDelta) -> None:
    completion.token_ids.extend(delta.token_ids)
    completion.text += delta.text
    if delta.logprobs:
        completion.logprobs.extend(_logprobs(delta))
    if delta.prompt_logprobs is not None:
        completion.prompt_logprobs.extend(_prompt_logprobs(delta) or ())
    if delta.finish_reason is not None:
        completion.finish_reason = FINISH_REASONS[delta.finish_reason]
        usage = _usage(delta.usage)
        if usage is not None:
            completion.usage.CopyFrom(usage)


SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GatewayService"].full_name
