"""What the calls return: plain frozen records, each keeping its proto message as `raw`
(fields the gateway adds later, e.g. logprobs, are there before this module knows them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedkv.gateway.v1 import gateway_pb2 as pb


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int  # prompt tokens served from the prefix cache


@dataclass(frozen=True, slots=True)
class Delta:
    """One streamed step of one completion: the tokens and text new since the last delta.
    The last delta of each completion has `finish_reason` and `usage`."""

    request_id: str
    index: int  # which completion (n > 1)
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None  # "stop", "length", "abort"; None while it runs
    usage: Usage | None
    raw: pb.GenerateResponse = field(repr=False, compare=False)


@dataclass(frozen=True, slots=True)
class Completion:
    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    usage: Usage | None
    raw: pb.Completion = field(repr=False, compare=False)


@dataclass(frozen=True, slots=True)
class Result:
    """A whole request's answer: one completion per n. `text`, `token_ids` and
    `finish_reason` are the first completion's (the only one when n is 1)."""

    request_id: str
    completions: tuple[Completion, ...]

    @property
    def text(self) -> str:
        return self.completions[0].text

    @property
    def token_ids(self) -> tuple[int, ...]:
        return self.completions[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.completions[0].finish_reason


@dataclass(frozen=True, slots=True)
class ExecutorInfo:
    address: str
    pool_id: str
    num_blocks: int
    block_size: int
    backend: str
    device: str
    healthy: bool
    role: str = "both"  # "prefill", "decode" or "both" (a gateway that says none: both)


@dataclass(frozen=True, slots=True)
class ModelInfo:
    model_name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    executors: tuple[ExecutorInfo, ...]
    lora_adapters: tuple[str, ...] = ()  # loaded adapters' names: pass one as model=
