"""The OpenAI-compatible HTTP API (FastAPI), on the gateway's own frontend and engines.

    GET  /v1/models            the served model and its loaded LoRA adapters
    POST /v1/completions       text or token-id prompt; streaming (SSE) or not
    POST /v1/chat/completions  the model's own chat template; streaming (SSE) or not
    POST /v1/load_lora_adapter, /v1/unload_lora_adapter
                               vLLM's, with --allow-runtime-lora-updating (engine/adapters.py)
    GET  /health               200 while an executor is reachable, else 503
    GET  /live                 200 while the gateway's engine loop answers (a liveness probe)
    GET  /metrics              Prometheus text format (gateway/metrics.py); with API keys on,
                               only for a caller with a valid key

Every request runs through `Frontend.submit` and `Frontend.deltas`, exactly as a gRPC call:
the same validation, tenants, quotas and request ids. A client that goes away (mid-stream or
while waiting for a whole completion) cancels its request, which frees its blocks; a stream
whose client reads too slowly (more than --max-sse-buffer events queued) is cut.

Streams are framed byte for byte as OpenAI's and vLLM's servers frame them: every event is
`data: <compact json>\n\n`, written in one piece, the last `data: [DONE]\n\n`, and nothing
else: no `\r\n`, no keep-alive comments. NOTE: vLLM's load generator (`vllm bench serve`)
strips every read and then splits on blank lines; a `: ping` comment that arrives in a read of
its own loses its blank line, and every event after it is glued onto it and dropped as part
of that comment (issue 30: 48 of 192 streams with no token, a third of the tokens lost).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import structlog
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ValidationError
from sse_starlette import EventSourceResponse
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from common.errors import NotFound, ServiceError
from common.executor_description import LoraAdapterInfo
from gateway.api.frontend import Frontend
from gateway.api.openai.errors import error_body, error_response, message_of, status_of
from gateway.api.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoraAdapterRequest,
    TokenizeRequest,
    UnloadLoraAdapterRequest,
)
from gateway.api.openai.tools import (
    NamedToolChoice,
    StreamedToolCalls,
    ToolCall,
    parse_tool_calls,
)
from gateway.api.sampling import MAX_REQUEST_ID_CHARS
from gateway.api.tenants import Tenancy
from gateway.core.request_state import CompletionDelta, FinishReason, PromptLogprob, TokenLogprob
from gateway.core.request_state import Request as EngineRequest
from gateway.metrics import EngineSnapshot, GatewayMetrics

log = structlog.get_logger(__name__)
Body = TypeVar("Body", bound=BaseModel)
REQUEST_ID_HEADER = "x-request-id"
SSE_SEND_TIMEOUT_S = 30.0  # a client that takes a whole event for this long is gone
FINISH_REASONS = {None: None, FinishReason.STOP: "stop", FinishReason.LENGTH: "length",
                  FinishReason.ABORT: "abort"}


class HttpError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


@dataclass(slots=True)
class HttpApi:
    """What the routes need from the gateway."""

    frontend: Frontend
    tenancy: Tenancy
    metrics: GatewayMetrics
    served_model_name: str
    max_body_bytes: int
    max_sse_buffer: int
    is_healthy: Callable[[], bool]
    # Taken on the engine loop: every engine's snapshot, and the leases acquired so far.
    engine_state: Callable[[], Awaitable[tuple[list[EngineSnapshot], int]]]
    created: int = field(default_factory=lambda: int(time.time()))

    def tenant(self, request: Request) -> str:
        authenticator = self.tenancy.authenticator()
        if authenticator is None:
            return ""
        return authenticator.authenticate(request.headers.get("authorization"))

    def check_model(self, model: str) -> None:
        """The base model's name or a loaded adapter's (404 otherwise)."""
        try:
            self.frontend.resolve_model(model)
        except NotFound as exc:
            raise HttpError(404, str(exc), "model") from None

    async def body(self, request: Request, model: type[Body]) -> Body:
        """The JSON body, size-checked before it is read whole, validated by name."""
        content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if content_type != "application/json":
            raise HttpError(400, f"Content-Type must be application/json, not "
                            f"{content_type[:64] or 'missing'}")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            raise HttpError(413, f"the body is {declared} bytes; at most "
                            f"{self.max_body_bytes} (--max-prompt-bytes)")
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > self.max_body_bytes:
                raise HttpError(413, f"the body is over {self.max_body_bytes} bytes "
                                "(--max-prompt-bytes)")
        try:
            return model.model_validate_json(bytes(raw))
        except ValidationError as exc:
            raise HttpError(400, *_describe(exc)) from None


def _describe(exc: ValidationError) -> tuple[str, str | None]:
    """The first problem, named by its field: an OpenAI client shows only the message."""
    error = exc.errors()[0]
    param = ".".join(str(p) for p in error["loc"]) or None
    kind = error["type"]
    if kind == "json_invalid":
        return f"the body is not valid JSON: {error['msg']}", None
    if kind == "extra_forbidden":
        return f"unsupported parameter: {param}", param
    if kind == "missing":
        return f"{param} is required", param
    return f"{param}: {error['msg']}", param


class RequestIdMiddleware:
    """The caller's x-request-id (when valid) names the request in every log line; a handler's
    unexpected error before its response starts is logged and answered 500.

    Plain ASGI rather than `@app.middleware("http")`: starlette's BaseHTTPMiddleware hands
    each chunk of a streamed response through a stream of its own, per token of every SSE
    response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        structlog.contextvars.clear_contextvars()
        sent = Headers(scope=scope).get(REQUEST_ID_HEADER, "")
        valid = (bool(sent) and len(sent) <= MAX_REQUEST_ID_CHARS and sent.isascii()
                 and sent.isprintable())
        if valid:
            structlog.contextvars.bind_contextvars(request_id=sent)
        started = False

        async def send_noting_start(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_noting_start)
        except Exception:
            if started:  # a stream cut short (a client gone or stalled): the server closes it
                raise
            log.exception("http_handler_failed", path=scope.get("path", ""))
            response = error_response(500, "internal error: see the gateway's log",
                                      headers={REQUEST_ID_HEADER: sent} if valid else None)
            await response(scope, receive, send)


def create_app(api: HttpApi) -> FastAPI:
    app = FastAPI(title="pagedkv", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(HttpError)
    async def _http_error(request: Request, exc: HttpError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, _id_header(request))

    @app.exception_handler(ServiceError)
    async def _service_error(request: Request, exc: ServiceError) -> JSONResponse:
        return error_response(status_of(exc), message_of(exc), headers=_id_header(request))

    app.add_middleware(RequestIdMiddleware)

    @app.get("/health")
    async def health() -> Response:
        if api.is_healthy():
            return JSONResponse({"status": "ok"})
        return error_response(503, "no executor is reachable")

    @app.get("/live")
    async def live() -> Response:
        # Alive is not healthy: no executor is no reason to restart the gateway, but an
        # engine loop that no longer answers is.
        await api.engine_state()
        return JSONResponse({"status": "alive"})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        # With API keys on, the fleet's load, tenants' traffic and error rates are not for
        # strangers: any valid key (give the scraper a line of its own in the keys file).
        api.tenant(request)
        engines, leases = await api.engine_state()
        return Response(api.metrics.render(engines, leases),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        api.tenant(request)
        adapters = api.frontend.adapters.available() if api.frontend.adapters else {}
        cards = [_model_card(api), *(_model_card(api, a) for a in adapters.values())]
        return JSONResponse({"object": "list", "data": cards})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> JSONResponse:
        api.tenant(request)
        api.check_model(model_id)
        return JSONResponse(_model_card(api, api.frontend.resolve_model(model_id)))

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        api.tenant(request)
        body = await api.body(request, LoadLoraAdapterRequest)
        await api.frontend.lora_admin().load(body.lora_name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        api.tenant(request)
        body = await api.body(request, UnloadLoraAdapterRequest)
        await api.frontend.lora_admin().unload(body.lora_name)
        return PlainTextResponse(
            f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        tenant = api.tenant(request)
        body = await api.body(request, CompletionRequest)
        api.check_model(body.model)
        return await _serve(api, request, body, tenant, Completions(api, body))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        tenant = api.tenant(request)
        body = await api.body(request, ChatCompletionRequest)
        api.check_model(body.model)
        return await _serve(api, request, body, tenant, ChatCompletions(api, body))

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        tenant = api.tenant(request)
        body = await api.body(request, TokenizeRequest)
        if body.model is not None:
            api.check_model(body.model)
        prompt = body.prompt_input()
        add_special = body.add_special_tokens
        ids = await api.frontend.tokenize_input(
            prompt, tenant, add_special_tokens=True if add_special is None else add_special,
            add_generation_prompt=body.add_generation_prompt)
        strs = await api.frontend.token_strs(ids) if body.return_token_strs else None
        return JSONResponse({"count": len(ids), "max_model_len": api.frontend.info.max_model_len,
                             "tokens": ids, "token_strs": strs})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        api.tenant(request)
        body = await api.body(request, DetokenizeRequest)
        if body.model is not None:
            api.check_model(body.model)
        return JSONResponse({"prompt": await api.frontend.detokenize(body.tokens)})

    return app


def _model_card(api: HttpApi, adapter: LoraAdapterInfo | None = None) -> dict[str, Any]:
    """The base model's card, or an adapter's (vLLM's: its path as root, the base as parent)."""
    card = {"id": api.served_model_name, "object": "model", "created": api.created,
            "owned_by": "pagedkv", "root": api.served_model_name,
            "max_model_len": api.frontend.info.max_model_len}
    if adapter is not None:
        card.update(id=adapter.name, root=adapter.path, parent=api.served_model_name)
    return card


def _id_header(request: Request) -> dict[str, str]:
    bound = structlog.contextvars.get_contextvars().get("request_id")
    return {REQUEST_ID_HEADER: str(bound)} if bound else {}


async def _serve(api: HttpApi, request: Request, body: CompletionRequest | ChatCompletionRequest,
                 tenant: str, shape: Shape) -> Response:
    if body.user:
        structlog.contextvars.bind_contextvars(user=body.user)
    state = await api.frontend.submit(body.prompt_input(), body.sampling(), body.cache_salt,
                                      body.request_id, tenant=tenant, model=body.model)
    headers = {REQUEST_ID_HEADER: state.request_id}
    if body.stream:
        return stream_response(api, state, shape, body.include_usage, headers,
                               continuous_usage=body.continuous_usage)
    try:
        collected = await _until_disconnected(request, _collect(api, state))
    finally:
        api.frontend.abandon(state)  # cancelled or failed before it finished: free it
    return JSONResponse(shape.whole(state, collected), headers=headers)


def stream_response(api: HttpApi, state: EngineRequest, shape: Shape, include_usage: bool,
                    headers: dict[str, str], continuous_usage: bool = False) -> Response:
    # ping=0: no keep-alive comments (see the module's docstring); sep only frames what
    # sse-starlette would frame itself, and our events arrive framed.
    return _Stream(_events(api, state, shape, include_usage, continuous_usage),
                   on_close=lambda: api.frontend.abandon(state), headers=headers, sep="\n",
                   ping=0, send_timeout=SSE_SEND_TIMEOUT_S)


async def _until_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """The work's result, or cancelled when the client goes away first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            log.info("http_client_gone")
    return await task


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class _Stream(EventSourceResponse):
    """An SSE response that releases its request however it ends (even unstarted)."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None],
                 **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


# What a log-probability of -inf (a token the model rules out) is sent as: JSON has no
# infinity, and vLLM sends this.
LOGPROB_FLOOR = -9999.0


def finite(logprob: float) -> float:
    return logprob if logprob > LOGPROB_FLOOR else LOGPROB_FLOOR


# A completion logprobs entry: token id, its logprob (None: the echoed prompt's first), top.
LogprobEntry = tuple[int, float | None, dict[str, float] | None]


@dataclass(slots=True)
class Choice:
    """One completion as it accumulates (whole responses) or streams (chunks)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    text_offset: int = 0  # completions' logprobs: where the next token's text starts
    # sampling.prompt_logprobs: one per prompt token (None first), from the first delta.
    prompt_logprobs: tuple[PromptLogprob | None, ...] | None = None
    echoed: bool = False  # completions' echo: the prompt went out (stream) or was added


async def _collect(api: HttpApi, state: EngineRequest) -> list[Choice]:
    choices = [Choice() for _ in range(state.sampling.n)]
    async for delta in api.frontend.deltas(state):
        choice = choices[delta.index]
        choice.text += delta.text
        choice.token_ids.extend(delta.token_ids)
        choice.logprobs.extend(delta.logprobs)
        if delta.prompt_logprobs is not None:
            choice.prompt_logprobs = delta.prompt_logprobs
        if delta.finish_reason is not None:
            choice.finish_reason = delta.finish_reason
    return choices


def sse_event(payload: object) -> bytes:
    """One server-sent event as OpenAI sends it: `data: <compact json>` and a blank line."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


async def _events(api: HttpApi, state: EngineRequest, shape: Shape, include_usage: bool,
                  continuous_usage: bool = False) -> AsyncIterator[bytes]:
    """The stream's events, each framed whole (sse-starlette sends bytes as they are). With
    usage on, every token chunk has a `usage` too: null, or (continuous) the usage so far."""
    choices = [Choice() for _ in range(state.sampling.n)]
    # Each choice's opening chunk (chat: the role) goes out with its first token, as OpenAI's
    # and vLLM's do: a client that times the first chunk times the first token.
    openings = {chunk["choices"][0]["index"]: chunk for chunk in shape.opening(state)}
    try:
        async with contextlib.aclosing(api.frontend.deltas(state)) as deltas:
            async for delta in deltas:
                opening = openings.pop(delta.index, None)
                if opening is not None:
                    yield sse_event(opening)
                choice = choices[delta.index]
                choice.token_ids.extend(delta.token_ids)
                chunk = shape.chunk(state, choice, delta)
                if include_usage:
                    chunk["usage"] = usage(state, choices) if continuous_usage else None
                yield sse_event(chunk)
                if state.outputs.qsize() > api.max_sse_buffer:
                    log.warning("http_stream_cut", reason="the client reads too slowly",
                                queued=state.outputs.qsize())
                    return  # (closing `deltas` cancels the request)
        if include_usage:
            yield sse_event(shape.usage_chunk(state, choices))
    except ServiceError as exc:
        yield sse_event(error_body(status_of(exc), message_of(exc)))
    yield SSE_DONE


def usage(state: EngineRequest, choices: list[Choice]) -> dict[str, Any]:
    prompt = len(state.prompt_token_ids)
    completion = sum(len(c.token_ids) for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": state.num_cached_tokens or 0}}


class Shape:
    """How one endpoint's responses look."""

    def __init__(self, api: HttpApi, body: Any) -> None:
        self.api, self.body = api, body
        self.created = int(time.time())
        self.decode = api.frontend.tokenizer.decode
        self._texts: dict[int, str] = {}

    def token_text(self, token_id: int) -> str:
        """One token's text, decoded once per response (a prompt's logprobs name each id up
        to k + 1 times)."""
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.decode([token_id], skip_special_tokens=False)
        return text

    def prompt_logprobs_field(self, choice: Choice) -> dict[str, Any]:
        """`prompt_logprobs` in a response, only when the request asked."""
        if self.body.prompt_logprobs is None:
            return {}
        return {"prompt_logprobs": self.prompt_logprobs(choice)}

    def prompt_logprobs(self, choice: Choice) -> list[dict[str, Any] | None] | None:
        """vLLM's `prompt_logprobs`: per prompt token (None first), the token's own entry and
        the most likely tokens', by token id."""
        if self.body.prompt_logprobs is None or choice.prompt_logprobs is None:
            return None
        out: list[dict[str, Any] | None] = []
        for lp in choice.prompt_logprobs:
            if lp is None:
                out.append(None)
                continue
            top = lp.top[: self.body.prompt_logprobs]  # (echo's logprobs may have asked more)
            entries = {str(t): {"logprob": finite(p), "rank": rank,
                                "decoded_token": self.token_text(t)}
                       for rank, (t, p) in enumerate(top, 1)}
            entries[str(lp.token_id)] = {"logprob": finite(lp.logprob), "rank": lp.rank,
                                         "decoded_token": self.token_text(lp.token_id)}
            out.append(entries)
        return out

    def opening(self, state: EngineRequest) -> list[dict[str, Any]]:
        return []

    def head(self, state: EngineRequest, kind: str) -> dict[str, Any]:
        return {"id": f"{self.prefix}{state.request_id}", "object": kind,
                "created": self.created,
                "model": self.api.served_model_name if state.lora is None else state.lora.name}

    prefix = ""

    def whole(self, state: EngineRequest, choices: list[Choice]) -> dict[str, Any]:
        raise NotImplementedError

    def chunk(self, state: EngineRequest, choice: Choice, delta: CompletionDelta
              ) -> dict[str, Any]:
        raise NotImplementedError

    def usage_chunk(self, state: EngineRequest, choices: list[Choice]) -> dict[str, Any]:
        raise NotImplementedError


class Completions(Shape):
    prefix = "cmpl-"

    def _logprobs(self, choice: Choice, logprobs: list[TokenLogprob],
                  echoed: Sequence[LogprobEntry] = ()) -> dict[str, Any] | None:
        """OpenAI's completion logprobs, the echoed prompt's entries first."""
        if self.body.logprobs is None:
            return None
        entries = [*echoed, *((lp.token_id, finite(lp.logprob),
                               {self.token_text(t): finite(p) for t, p in lp.top})
                              for lp in logprobs)]
        tokens, offsets = [], []
        for token_id, _, _ in entries:
            text = self.token_text(token_id)
            tokens.append(text)
            offsets.append(choice.text_offset)
            choice.text_offset += len(text)
        return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in entries],
                "top_logprobs": [top for _, _, top in entries], "text_offset": offsets}

    def _echo(self, state: EngineRequest, choice: Choice) -> tuple[str, list[LogprobEntry]]:
        """With echo, once per choice: the prompt's text and, with logprobs, its entries as
        OpenAI gives them (the first token with none; each one's own among its top)."""
        if not self.body.echo or choice.echoed:
            return "", []
        choice.echoed = True
        prompt = self.body.prompt
        while isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # one prompt in a list (prompt_input checked that)
        ids = state.prompt_token_ids
        text = prompt if isinstance(prompt, str) else self.decode(ids, skip_special_tokens=False)
        if self.body.logprobs is None:
            return text, []
        entries: list[LogprobEntry] = [(ids[0], None, None)]
        for plp in (choice.prompt_logprobs or ())[1:]:
            assert plp is not None, "a completion's first delta carries every prompt logprob"
            top = {self.token_text(t): finite(p) for t, p in plp.top[: self.body.logprobs]}
            top[self.token_text(plp.token_id)] = finite(plp.logprob)
            entries.append((plp.token_id, finite(plp.logprob), top))
        return text, entries

    def whole(self, state: EngineRequest, choices: list[Choice]) -> dict[str, Any]:
        out = []
        for i, c in enumerate(choices):
            prompt_text, echoed = self._echo(state, c)
            out.append({"index": i, "text": prompt_text + c.text,
                        "logprobs": self._logprobs(c, c.logprobs, echoed),
                        "finish_reason": FINISH_REASONS[c.finish_reason],
                        **self.prompt_logprobs_field(c)})
        return {**self.head(state, "text_completion"), "choices": out,
                "usage": usage(state, choices)}

    def chunk(self, state: EngineRequest, choice: Choice, delta: CompletionDelta
              ) -> dict[str, Any]:
        if delta.prompt_logprobs is not None:
            choice.prompt_logprobs = delta.prompt_logprobs
        prompt_text, echoed = self._echo(state, choice)
        return {**self.head(state, "text_completion"),
                "choices": [{"index": delta.index, "text": prompt_text + delta.text,
                             "logprobs": self._logprobs(choice, list(delta.logprobs), echoed),
                             "finish_reason": FINISH_REASONS[delta.finish_reason]}]}

    def usage_chunk(self, state: EngineRequest, choices: list[Choice]) -> dict[str, Any]:
        return {**self.head(state, "text_completion"), "choices": [],
                "usage": usage(state, choices)}


class ChatCompletions(Shape):
    prefix = "chatcmpl-"

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token_text(token_id)
        return {"token": text, "logprob": finite(logprob), "bytes": list(text.encode())}

    def _logprobs(self, logprobs: list[TokenLogprob] | tuple[TokenLogprob, ...]
                  ) -> dict[str, Any] | None:
        if not self.body.logprobs:
            return None
        return {"content": [{**self._entry(lp.token_id, lp.logprob),
                             "top_logprobs": [self._entry(t, p) for t, p in lp.top]}
                            for lp in logprobs]}

    def opening(self, state: EngineRequest) -> list[dict[str, Any]]:
        """The assistant's role first, for every choice (as OpenAI streams it)."""
        return [{**self.head(state, "chat.completion.chunk"),
                 "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}]}
                for i in range(state.sampling.n)]

    def __init__(self, api: HttpApi, body: Any) -> None:
        super().__init__(api, body)
        self.tools = bool(body.active_tools)  # parse the replies' tool calls (tools.py)
        # OpenAI's finish reason for calls: tool_calls, but stop when the request named the
        # function to call.
        self.calls_reason = "stop" if isinstance(body.tool_choice, NamedToolChoice) \
            else "tool_calls"
        self._streamed: dict[int, StreamedToolCalls] = {}

    def _message(self, choice: Choice) -> tuple[dict[str, Any], str | None]:
        """The reply, its tool calls parsed out, and its finish reason."""
        reason = FINISH_REASONS[choice.finish_reason]
        if not self.tools:
            return {"role": "assistant", "content": choice.text}, reason
        content, calls = parse_tool_calls(choice.text)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [call.to_openai() for call in calls]
        return message, self.calls_reason if calls and reason == "stop" else reason

    def whole(self, state: EngineRequest, choices: list[Choice]) -> dict[str, Any]:
        replies = [self._message(c) for c in choices]
        return {**self.head(state, "chat.completion"),
                "choices": [{"index": i, "message": message,
                             "logprobs": self._logprobs(c.logprobs), "finish_reason": reason}
                            for i, (c, (message, reason)) in enumerate(zip(choices, replies,
                                                                           strict=True))],
                **self.prompt_logprobs_field(choices[0]),
                "usage": usage(state, choices)}

    def chunk(self, state: EngineRequest, choice: Choice, delta: CompletionDelta
              ) -> dict[str, Any]:
        text, reason = delta.text, FINISH_REASONS[delta.finish_reason]
        calls: list[ToolCall] = []
        if self.tools:  # content goes out at once, tool calls once the choice ends
            stream = self._streamed.setdefault(delta.index, StreamedToolCalls())
            text = stream.feed(text)
            if delta.finish_reason is not None:
                rest, calls = stream.finish()
                text += rest
                reason = self.calls_reason if calls and reason == "stop" else reason
        content: dict[str, Any] = {"content": text} if text or delta.finish_reason is None \
            else {}
        if calls:
            content["tool_calls"] = [call.to_openai(i) for i, call in enumerate(calls)]
        return {**self.head(state, "chat.completion.chunk"),
                "choices": [{"index": delta.index, "delta": content,
                             "logprobs": self._logprobs(delta.logprobs),
                             "finish_reason": reason}]}

    def usage_chunk(self, state: EngineRequest, choices: list[Choice]) -> dict[str, Any]:
        return {**self.head(state, "chat.completion.chunk"), "choices": [],
                "usage": usage(state, choices)}

