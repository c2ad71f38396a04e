"""Proto at the edge: keyword arguments -> request messages, response messages -> results.

Sampling keywords are set on `SamplingParams` by field name, so a field the gateway's proto
gains (min_p, logit_bias, ...) works here without a change; a keyword that names a field of
the request itself instead (e.g. priority) is set there. None means "unset" (the gateway's
default). Anything else is a TypeError naming the fields there are.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeAlias, TypeVar

from google.protobuf.message import Message

from pagedkv.gateway.v1 import gateway_pb2 as pb
from pagedkv_client.results import Completion, Delta, ExecutorInfo, ModelInfo, Result, Usage

# A prompt: text, or token ids (no template, no BOS added).
Prompt: TypeAlias = str | Sequence[int]
# A chat message: {"role": ..., "content": ...} or (role, content); roles: system, user,
# assistant.
ChatMessage: TypeAlias = Mapping[str, str] | tuple[str, str]

# Fields of the request that have keywords of their own (or are the prompt).
_REQUEST_OWN = frozenset({"text", "token_ids", "chat", "sampling", "cache_salt", "request_id"})

RequestT = TypeVar("RequestT", pb.GenerateRequest, pb.CompleteRequest)


def build_request(kind: type[RequestT], prompt: Prompt | None = None,
                  messages: Sequence[ChatMessage] | None = None, *, cache_salt: str = "",
                  request_id: str = "", sampling: Mapping[str, Any]) -> RequestT:
    """A GenerateRequest or CompleteRequest: `prompt` (text or token ids) or chat `messages`."""
    request: RequestT = kind(cache_salt=cache_salt, request_id=request_id)
    if messages is not None:
        request.chat.CopyFrom(pb.ChatMessages(messages=[_chat_message(m) for m in messages]))
    elif isinstance(prompt, str):
        request.text = prompt
    elif prompt is not None:
        request.token_ids.CopyFrom(pb.TokenIds(ids=list(prompt)))
    for name, value in sampling.items():
        if value is None:
            continue
        if name in pb.SamplingParams.DESCRIPTOR.fields_by_name:
            _set_field(request.sampling, name, value)
        elif name in request.DESCRIPTOR.fields_by_name and name not in _REQUEST_OWN:
            _set_field(request, name, value)
        else:
            known = sorted({*pb.SamplingParams.DESCRIPTOR.fields_by_name,
                            *(set(request.DESCRIPTOR.fields_by_name) - _REQUEST_OWN)})
            raise TypeError(f"unknown sampling parameter {name!r}; the gateway takes "
                            f"{', '.join(known)}")
    return request


def _chat_message(message: ChatMessage) -> pb.ChatMessage:
    if isinstance(message, tuple):
        role, content = message
        return pb.ChatMessage(role=role, content=content)
    return pb.ChatMessage(role=message["role"], content=message["content"])


def _set_field(message: Message, name: str, value: Any) -> None:
    """message.name = value, for scalars, repeated fields (a lone string is one item), maps
    and sub-messages alike."""
    descriptor = message.DESCRIPTOR.fields_by_name[name]
    target = getattr(message, name)
    entry = descriptor.message_type
    if entry is not None and entry.GetOptions().map_entry:
        target.update(value)
    elif _is_repeated(descriptor):
        target.extend([value] if isinstance(value, str) else value)
    elif entry is not None:
        target.CopyFrom(value)
    else:
        setattr(message, name, value)


def _is_repeated(descriptor: Any) -> bool:
    if hasattr(descriptor, "is_repeated"):  # protobuf >= 5.28; `label` went in 6
        return bool(descriptor.is_repeated)
    return bool(descriptor.label == descriptor.LABEL_REPEATED)


def finish_reason(value: int) -> str | None:
    """FINISH_REASON_STOP -> "stop"; unspecified (still running) -> None."""
    if value == pb.FINISH_REASON_UNSPECIFIED:
        return None
    return pb.FinishReason.Name(value).removeprefix("FINISH_REASON_").lower()


def _usage(message: Any) -> Usage | None:
    if not message.HasField("usage"):
        return None
    u = message.usage
    return Usage(u.prompt_tokens, u.completion_tokens, u.cached_prompt_tokens)


def delta(response: pb.GenerateResponse) -> Delta:
    return Delta(request_id=response.request_id, index=response.index, text=response.text,
                 token_ids=tuple(response.token_ids),
                 finish_reason=finish_reason(response.finish_reason), usage=_usage(response),
                 raw=response)


def result(response: pb.CompleteResponse) -> Result:
    return Result(request_id=response.request_id, completions=tuple(
        Completion(index=c.index, text=c.text, token_ids=tuple(c.token_ids),
                   finish_reason=finish_reason(c.finish_reason), usage=_usage(c), raw=c)
        for c in response.completions))


def model_info(response: pb.GetModelInfoResponse) -> ModelInfo:
    return ModelInfo(
        model_name=response.model_name, max_model_len=response.max_model_len,
        vocab_size=response.vocab_size, eos_token_ids=tuple(response.eos_token_ids),
        executors=tuple(ExecutorInfo(e.address, e.pool_id, e.num_blocks, e.block_size,
                                     e.backend, e.device, e.healthy, e.role or "both")
                        for e in response.executors),
        lora_adapters=tuple(a.name for a in response.lora_adapters))
