"""The OpenAI-compatible request bodies, and their conversion to the gateway's own inputs.

Every field OpenAI (or vLLM, as an extension) defines that we serve is declared here; any other
field is refused by name (`extra="forbid"`), never ignored. Fields OpenAI has whose other
values we do not serve (`suffix`, ...) accept only their no-op value. Range checks are
the gateway's own (gateway/api/sampling.py), shared with the gRPC API.

Beam search takes vLLM's extension fields: `use_beam_search`, `best_of` (the beam width; unset:
n), `n` (the hypotheses returned, best first), `length_penalty`, `early_stopping` (false, true
or "never", as transformers'). Without beam search `best_of` may only equal n.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from common.errors import InvalidArgument
from gateway.api.frontend import PromptInput
from gateway.api.openai.structured import ResponseFormat, StructuredOutputs, constraint
from gateway.api.openai.tools import (
    AssistantToolCall,
    ToolChoice,
    ToolDef,
    forced_constraint,
    tools_in_use,
)
from gateway.api.sampling import MAX_TOP_LOGPROBS, RawSampling
from gateway.core.beam_search import EarlyStopping
from gateway.text.tokenizer import ChatTurn

# OpenAI's newer "developer" role is its system role.
CHAT_ROLE_ALIASES = {"developer": "system"}
MAX_USER_CHARS = 256


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    # vLLM's: every chunk carries the usage so far (GuideLLM asks for it), not only the last.
    continuous_usage_stats: bool = False


class _Common(BaseModel):
    """Fields both endpoints take."""

    model_config = ConfigDict(extra="forbid")

    model: str
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM: -1 or 0 is off
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    min_tokens: int = 0
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    user: str | None = Field(default=None, max_length=MAX_USER_CHARS)
    priority: int = 0
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str = ""
    request_id: str = ""
    best_of: int | None = None
    use_beam_search: bool = False
    length_penalty: float | None = None
    early_stopping: bool | Literal["never"] | None = None
    # vLLM's: each prompt token's logprob, rank and this many most likely (whole responses).
    prompt_logprobs: int | None = None
    # The output's constraint: OpenAI's or vLLM's spelling (structured.py).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None

    def raw_sampling(self, max_tokens: int | None, logprobs: int | None,
                     fill_context: bool, prompt_logprobs: int | None = None) -> RawSampling:
        if self.stream_options is not None and not self.stream:
            raise InvalidArgument("stream_options is only allowed with stream: true")
        if self.prompt_logprobs is not None and self.stream:
            raise InvalidArgument("prompt_logprobs is not available with stream: true")
        if self.n < 1:
            raise InvalidArgument(f"n is {self.n}; it must be >= 1")
        top_k = self.top_k or 0
        if top_k < -1:
            raise InvalidArgument(f"top_k is {top_k}; it must be >= 0 (-1 or 0: off)")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise InvalidArgument(f"seed is {self.seed}; it must be in [0, 2^64)")
        if any(t < 0 for t in self.stop_token_ids or ()):
            raise InvalidArgument("stop_token_ids must be >= 0")
        if self.min_tokens < 0:
            raise InvalidArgument(f"min_tokens is {self.min_tokens}; it must be >= 0")
        if max_tokens is not None and max_tokens < 1:
            raise InvalidArgument(
                f"max_tokens is {max_tokens}; it must be >= 1 (to score a prompt with echo, ask "
                "for 1 token and leave it out)")
        if self.best_of is not None and self.best_of != self.n and not self.use_beam_search:
            raise InvalidArgument(
                f"best_of ({self.best_of}) other than n is only supported with "
                "use_beam_search (as the beam width)")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return RawSampling(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=max(top_k, 0),
            seed=self.seed,
            stop=stop,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            n=self.n,
            ignore_eos=self.ignore_eos,
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=_logit_bias(self.logit_bias),
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs if prompt_logprobs is not None
            else self.prompt_logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            priority=self.priority,
            fill_context=fill_context,
            use_beam_search=self.use_beam_search,
            beam_width=self.best_of if self.use_beam_search else None,
            length_penalty=self.length_penalty,
            early_stopping=_early_stopping(self.early_stopping),
            structured_output=constraint(self.response_format, self.structured_outputs),
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options
                                           and self.stream_options.continuous_usage_stats)


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = None  # unset: 16, as OpenAI
    logprobs: int | None = None
    # The prompt before the completion, in `text` and (with logprobs) in `logprobs`: its
    # first token without a logprob, the others' given the tokens before them.
    echo: bool = False
    suffix: None = None

    def prompt_input(self) -> PromptInput:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise InvalidArgument(
                    f"prompt holds {len(prompt)} prompts; send one prompt per request")
            prompt = prompt[0]
        if isinstance(prompt, str):
            return PromptInput(text=prompt)
        ids = list(prompt)
        if any(not isinstance(t, int) or t < 0 for t in ids):
            raise InvalidArgument("prompt token ids must be integers >= 0")
        return PromptInput(token_ids=ids)  # type: ignore[arg-type]

    def sampling(self) -> RawSampling:
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None:  # the echoed prompt's logprobs
            if prompt_logprobs is not None and not 0 <= prompt_logprobs <= MAX_TOP_LOGPROBS:
                raise InvalidArgument(f"prompt_logprobs is {prompt_logprobs}; it must be in "
                                      f"[0, {MAX_TOP_LOGPROBS}]")
            prompt_logprobs = max(prompt_logprobs or 0, self.logprobs)
        return self.raw_sampling(self.max_tokens, self.logprobs, fill_context=False,
                                 prompt_logprobs=prompt_logprobs)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None  # None: an assistant turn of tool calls
    tool_calls: list[AssistantToolCall] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_tokens: int | None = None  # deprecated by OpenAI; unset: up to max_model_len
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None  # unset: auto with tools
    parallel_tool_calls: bool = True

    @property
    def active_tools(self) -> list[ToolDef]:
        """The tools the model is shown and whose calls are parsed (tools.py)."""
        return tools_in_use(self.tools, self.tool_choice)

    def prompt_input(self) -> PromptInput:
        tools = [t.model_dump(exclude_none=True) for t in self.active_tools]
        return PromptInput(chat=chat_turns(self.messages), tools=tools or None)

    def sampling(self) -> RawSampling:
        raw = self._sampling()
        forced = forced_constraint(self.active_tools, self.tool_choice, self.parallel_tool_calls)
        if forced is None:
            return raw
        if raw.structured_output is not None:
            raise InvalidArgument(
                "tool_choice required or a named function constrains the output already: "
                "leave response_format / structured_outputs out")
        return dataclasses.replace(raw, structured_output=forced)

    def _sampling(self) -> RawSampling:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidArgument("top_logprobs needs logprobs: true")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise InvalidArgument("send max_completion_tokens or max_tokens, not both")
        max_tokens = self.max_completion_tokens or self.max_tokens
        if self.max_completion_tokens == 0 or self.max_tokens == 0:
            max_tokens = 0  # refused by name below, not taken as unset
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.raw_sampling(max_tokens, logprobs, fill_context=max_tokens is None)


def chat_turns(messages: list[ChatMessage]) -> list[ChatTurn]:
    turns = []
    for index, message in enumerate(messages):
        content = message.content
        if content is None and not message.tool_calls:
            raise InvalidArgument(f"messages[{index}]: content is missing")
        if message.tool_calls and message.role != "assistant":
            raise InvalidArgument(f"messages[{index}]: only an assistant turn has tool_calls")
        if (message.role == "tool") != (message.tool_call_id is not None):
            raise InvalidArgument(
                f"messages[{index}]: a tool turn, and only a tool turn, has tool_call_id")
        text = content if isinstance(content, str) else "".join(p.text for p in content or ())
        calls = tuple(_template_call(call, index) for call in message.tool_calls or ())
        turns.append(ChatTurn(CHAT_ROLE_ALIASES.get(message.role, message.role), text,
                              tool_calls=calls, tool_call_id=message.tool_call_id))
    return turns


def _template_call(call: AssistantToolCall, index: int) -> dict[str, Any]:
    """A call as chat templates read it: its arguments parsed (they print them as JSON)."""
    try:
        arguments = json.loads(call.function.arguments)
    except ValueError:
        raise InvalidArgument(
            f"messages[{index}]: tool call {call.id!r} has arguments that are not JSON"
        ) from None
    return {"id": call.id, "type": "function",
            "function": {"name": call.function.name, "arguments": arguments}}


def _early_stopping(value: bool | str | None) -> EarlyStopping | None:
    if value is None:
        return None
    if value == "never":
        return EarlyStopping.NEVER
    return EarlyStopping.WHEN_FULL if value else EarlyStopping.HEURISTIC


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """JSON object keys are strings: each must be a token id."""
    items = []
    for key, value in (bias or {}).items():
        try:
            token_id = int(key)
        except ValueError:
            raise InvalidArgument(f"logit_bias key {key[:32]!r} is not a token id") from None
        items.append((token_id, value))
    return tuple(sorted(items))


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a text (`prompt`) or a conversation (`messages`), one of the two."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # unset: true for a text, false for a chat
    add_generation_prompt: bool = True  # a chat: end with the assistant's turn opening
    return_token_strs: bool = False
    tools: list[ToolDef] | None = None  # a chat's tools, rendered as a chat completion's

    def prompt_input(self) -> PromptInput:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidArgument("send prompt (a text) or messages (a chat), one of the two")
        if self.messages is not None:
            if self.add_special_tokens:
                raise InvalidArgument("add_special_tokens: a chat's template writes its own "
                                      "special tokens; leave it unset or false")
            tools = [t.model_dump(exclude_none=True) for t in tools_in_use(self.tools, None)]
            return PromptInput(chat=chat_turns(self.messages), tools=tools or None)
        if self.tools is not None:
            raise InvalidArgument("tools go with messages (a chat), not with prompt")
        return PromptInput(text=self.prompt)


class DetokenizeRequest(BaseModel):
    """vLLM's /detokenize: token ids back to text, special tokens included."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]


class LoadLoraAdapterRequest(BaseModel):
    """vLLM's /v1/load_lora_adapter: a PEFT directory on the executors' filesystem."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoraAdapterRequest(BaseModel):
    """vLLM's /v1/unload_lora_adapter (its lora_int_id is accepted and unused)."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None
