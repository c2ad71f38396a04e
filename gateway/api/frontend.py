"""The gateway's core behind the servicer: tokenize, validate, submit, collect deltas.

Tokenizing (and rendering a chat template) runs on tokenizer threads, never on the event loop
that serves every stream, and only after the text's size is checked: a prompt over
--max-prompt-bytes is refused at once, and so is one longer than max_model_len tokens could
ever spell (text/token_bound.py), so the tokenizer never sees more than that bound. Short
prompts have a thread of their own: they never queue behind long ones, and the long ones
share a few threads (the fast tokenizers release the GIL while they work). Detokenizing and
stop strings run on this loop, as the engine's deltas arrive (text/output.py), never on the
engine's.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import secrets
import threading
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import structlog

from common.errors import (
    AlreadyExists,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
)
from common.executor_description import LoraAdapterInfo
from common.structured_output import Grammars, StructuredOutput, load_tokenizer
from gateway.api.sampling import (
    MAX_CHAT_MESSAGES,
    MAX_REQUEST_ID_CHARS,
    ModelLimits,
    RawSampling,
    check_ids,
    check_prompt_bytes,
    check_prompt_fits,
    validate,
    validate_prompt,
)
from gateway.api.tenants import SINGLE_TENANT, Tenancy
from gateway.core.request_state import CompletionDelta, FinishReason, Request
from gateway.core.seq_ids import sequence_ids
from gateway.engine.adapters import LoraAdapters, adapter_salt
from gateway.engine.host import EngineHost
from gateway.metrics import GatewayMetrics
from gateway.text.output import RequestOutput
from gateway.text.tokenizer import ChatTurn, Tokenizer

T = TypeVar("T")
# A prompt of at most this many bytes tokenizes on the short lane (well under a millisecond).
SHORT_PROMPT_BYTES = 16 << 10
LONG_LANE_THREADS = 3

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class ModelInfo:
    model_name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class PromptInput:
    """A prompt as the caller sent it: exactly one of the three (none: an empty prompt)."""

    text: str | None = None
    token_ids: list[int] | None = None
    chat: list[ChatTurn] | None = None
    tools: list[dict[str, Any]] | None = None  # a chat's tools, shown by its template


@dataclass(slots=True)
class Frontend:
    tokenizer: Tokenizer
    limits: ModelLimits
    engines: EngineHost
    info: ModelInfo
    tenancy: Tenancy = field(default_factory=lambda: Tenancy({}, b""))
    max_prompt_bytes: int = 1 << 20
    # A tenant's sequences in flight at once (--tenant-max-requests): a request counts its
    # n, or its beam width (0: no limit; one tenant: none).
    max_seqs_per_tenant: int = 0
    tenant_seqs: collections.Counter[str] = field(default_factory=collections.Counter)
    # The active requests by (tenant, request id), and their sequence ids (seq_ids.py) by
    # (tenant, sequence id), each with its request's id.
    active: dict[tuple[str, str], Request] = field(default_factory=dict)
    seq_owners: dict[tuple[str, str], str] = field(default_factory=dict)
    short_lane: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="tokenizer-short"))
    long_lane: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(
        LONG_LANE_THREADS, thread_name_prefix="tokenizer-long"))
    # This gateway run's sequence-id namespace (seq_ids.py): unique per start.
    id_namespace: str = field(default_factory=lambda: f"{secrets.token_hex(4)}/")
    metrics: GatewayMetrics | None = None
    draining: bool = False  # shutting down (Gateway.stop): new requests are refused
    # Structured output's compiled constraints, made at the first constrained request.
    grammars: Grammars | None = None
    grammars_lock: threading.Lock = field(default_factory=threading.Lock)
    # LoRA adapters by model name, and their loads and unloads (None: only the base model).
    adapters: LoraAdapters | None = None
    runtime_lora_updating: bool = False  # --allow-runtime-lora-updating

    def lora_admin(self) -> LoraAdapters:
        """Loads and unloads, where --allow-runtime-lora-updating allows them."""
        if self.adapters is None or not self.runtime_lora_updating:
            raise PermissionDenied("loading and unloading LoRA adapters at run time is off: "
                                   "start the gateway with --allow-runtime-lora-updating")
        return self.adapters

    def resolve_model(self, model: str) -> LoraAdapterInfo | None:
        """The adapter `model` names, None for the base model; NotFound for neither."""
        if self.adapters is not None:
            return self.adapters.resolve(model)
        if model and model != self.info.model_name:
            raise NotFound(f"The model `{model[:128]}` does not exist; this server serves "
                           f"`{self.info.model_name}`")
        return None

    def _check_open(self) -> None:
        if self.draining:
            raise Unavailable("the gateway is shutting down: send the request to another "
                              "gateway, or again once this one is back")

    def cut_off(self, why: str) -> int:
        """End every active request's stream with UNAVAILABLE (`why`): the drain's grace is
        over. Each stream's end cancels its request in the engine. Returns how many."""
        requests = list(self.active.values())
        for request in requests:
            for index in range(request.sampling.n):  # the first still open raises
                request.outputs.put_nowait(CompletionDelta(index=index, error=Unavailable(why)))
        return len(requests)

    async def tokenize(self, text: str, tenant: str = SINGLE_TENANT) -> list[int]:
        """The Tokenize RPC: one of the tenant's in-flight sequences while it runs."""
        with self._one_seq(tenant):
            return await self._encode(text)

    @contextmanager
    def _one_seq(self, tenant: str) -> Iterator[None]:
        """One of the tenant's in-flight sequences, held while a tokenizer call runs."""
        self._check_open()
        self._take_seqs(tenant, 1)
        try:
            yield
        finally:
            self.tenant_seqs[tenant] -= 1

    async def _encode(self, text: str) -> list[int]:
        num_bytes = _utf8_len(text)
        check_prompt_bytes(num_bytes, self.max_prompt_bytes)
        self._check_can_fit(text, num_bytes)
        return await self._off_loop(num_bytes, self.tokenizer.encode, text)

    def _check_can_fit(self, text: str, num_bytes: int) -> None:
        """Refuse a text too long for max_model_len tokens, before tokenizing it."""
        bound = self.tokenizer.bound
        if bound is None or num_bytes < (self.limits.max_model_len - 1) * bound.max_token_bytes:
            return  # it may fit (the usual case): no need to look closer
        check_prompt_fits(bound.min_num_tokens(text), self.limits, at_least=True)

    def _chat_ids(self, turns: list[ChatTurn],
                  tools: list[dict[str, Any]] | None = None) -> list[int]:
        """On a tokenizer thread: render, refuse what cannot fit, then tokenize."""
        text = self.tokenizer.chat_text(turns, tools=tools)
        self._check_can_fit(text, _utf8_len(text))
        return self.tokenizer.encode_rendered(text)

    def _chat_bytes(self, chat: list[ChatTurn],
                    tools: list[dict[str, Any]] | None = None) -> int:
        """A chat's size in bytes (its tools and tool calls included), once its message
        count and size are within the limits."""
        if len(chat) > MAX_CHAT_MESSAGES:
            raise InvalidArgument(f"chat has {len(chat)} messages; at most {MAX_CHAT_MESSAGES}")
        size = sum(_utf8_len(t.content) + _utf8_len(t.role) for t in chat)
        size += sum(_utf8_len(json.dumps(t.tool_calls)) for t in chat if t.tool_calls)
        size += _utf8_len(json.dumps(tools)) if tools else 0
        check_prompt_bytes(size, self.max_prompt_bytes, "chat content")
        return size

    async def prompt_token_ids(self, prompt: PromptInput) -> list[int]:
        if prompt.chat is not None:
            size = self._chat_bytes(prompt.chat, prompt.tools)
            return await self._off_loop(size, self._chat_ids, prompt.chat, prompt.tools)
        if prompt.text:  # empty text is an empty prompt, not a lone BOS token
            return await self._encode(prompt.text)
        return list(prompt.token_ids or [])

    async def tokenize_input(self, prompt: PromptInput, tenant: str = SINGLE_TENANT,
                             add_special_tokens: bool = True,
                             add_generation_prompt: bool = True) -> list[int]:
        """HTTP /tokenize: a text's or a chat's token ids as the tokenizer gives them (with the
        defaults, a chat's are the ones a chat completion computes), one of the tenant's
        in-flight sequences while it runs. Unlike a request's, a text longer than
        max_model_len tokens is counted, not refused: the caller asks how long it is (the
        byte limit bounds the work)."""
        with self._one_seq(tenant):
            return await self._tokens_of(prompt, add_special_tokens, add_generation_prompt)

    async def detokenize(self, token_ids: list[int]) -> str:
        """HTTP /detokenize: the ids' text, special tokens included, off the event loop (a
        body's worth of ids takes a while to decode)."""
        vocab = self.limits.vocab_size  # the model's, as for a prompt's ids (may be padded)
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidArgument(f"token id {bad} is outside the vocabulary [0, {vocab})")
        return await self._off_loop(4 * len(token_ids), self.tokenizer.decode, token_ids, False)

    async def token_strs(self, token_ids: list[int]) -> list[str]:
        """Each id's token as the tokenizer spells it (/tokenize's return_token_strs)."""
        return await self._off_loop(4 * len(token_ids),
                                    self.tokenizer.hf.convert_ids_to_tokens, token_ids)

    async def _tokens_of(self, prompt: PromptInput, add_special_tokens: bool,
                         add_generation_prompt: bool) -> list[int]:
        if prompt.chat is not None:
            size = self._chat_bytes(prompt.chat, prompt.tools)
            return await self._off_loop(size, self._rendered_ids, prompt.chat,
                                        add_generation_prompt, prompt.tools)
        text = prompt.text or ""
        num_bytes = _utf8_len(text)
        check_prompt_bytes(num_bytes, self.max_prompt_bytes)
        return await self._off_loop(num_bytes, self.tokenizer.encode, text, add_special_tokens)

    def _rendered_ids(self, turns: list[ChatTurn], add_generation_prompt: bool,
                      tools: list[dict[str, Any]] | None = None) -> list[int]:
        """On a tokenizer thread: render and tokenize, however long (/tokenize counts)."""
        return self.tokenizer.encode_rendered(
            self.tokenizer.chat_text(turns, add_generation_prompt, tools))

    async def _off_loop(self, num_bytes: int, fn: Callable[..., T], *args: object) -> T:
        lane = self.short_lane if num_bytes <= SHORT_PROMPT_BYTES else self.long_lane
        return await asyncio.get_running_loop().run_in_executor(lane, fn, *args)

    def close(self) -> None:
        for lane in (self.short_lane, self.long_lane):
            lane.shutdown(wait=False, cancel_futures=True)

    async def submit(
        self, prompt_input: PromptInput, raw: RawSampling, cache_salt: str, request_id: str,
        tenant: str = SINGLE_TENANT, model: str = "",
    ) -> Request:
        """Validate and queue a request (`model`: the base model's name, an adapter's, or
        empty for the base model); raises the domain error to send back."""
        self._check_open()
        check_ids(request_id, cache_salt)
        lora = self.resolve_model(model)
        num_seqs = _num_seqs(raw)
        self._take_seqs(tenant, num_seqs)  # before any await: concurrent calls cannot all pass
        if self.adapters is not None:
            self.adapters.hold(lora)  # an unload waits for it from now on
        arrival_time = time.monotonic()  # before tokenizing: time to first token includes it
        request: Request | None = None
        try:
            prompt = await self.prompt_token_ids(prompt_input)
            validate_prompt(prompt, self.limits)
            sampling = validate(raw, len(prompt), self.limits)
            if sampling.structured_output is not None:
                await self._off_loop(len(sampling.structured_output.spec), self._compile,
                                     sampling.structured_output)
            assert (sampling.beam.beam_width if sampling.beam else sampling.n) == num_seqs, (
                "the quota counted other sequences than the request runs")
            width = sampling.beam.beam_width if sampling.beam is not None else 0
            request_id = self._unique_id(tenant, request_id, sampling.n, len(prompt), width)
            seq_ids = sequence_ids(request_id, sampling.n, len(prompt), width)
            self._check_seq_ids_free(tenant, request_id, seq_ids)
            # Every event of this call, and the allocator calls about it, carry this id.
            structlog.contextvars.bind_contextvars(request_id=request_id)
            request = Request(
                request_id=request_id, prompt_token_ids=prompt, sampling=sampling,
                cache_salt=adapter_salt(lora, self.tenancy.cache_salt(tenant, cache_salt)),
                id_namespace=self.id_namespace + _tenant_tag(tenant), tenant=tenant,
                arrival_time=arrival_time, lora=lora)
            self.active[(tenant, request_id)] = request
            self.seq_owners.update(dict.fromkeys(((tenant, s) for s in seq_ids), request_id))
            engine = await self.engines.submit(request)
        except BaseException:
            if request is None:
                self.tenant_seqs[tenant] -= num_seqs
                if self.adapters is not None:
                    self.adapters.release(lora)
            else:
                # Refused, or this call was cancelled (client gone, deadline) while the
                # engine loop ran the submission: it may have queued the request already.
                self.engines.cancel(request)
                self._forget(request)
            raise
        log.info("request_queued", pool_id=engine.pool_id,
                 num_prompt_tokens=len(prompt), n=sampling.n, max_tokens=sampling.max_tokens)
        return request

    def _compile(self, constraint: StructuredOutput) -> None:
        """On a tokenizer thread: the constraint compiles for this model (cached), or
        InvalidArgument with the compiler's words; nothing is held yet."""
        with self.grammars_lock:
            if self.grammars is None:
                self.grammars = Grammars(load_tokenizer(
                    self.tokenizer.hf.name_or_path, self.limits.vocab_size,
                    self.limits.eos_token_ids))
        self.grammars.check(constraint, "sampling.structured_output")

    def _take_seqs(self, tenant: str, num_seqs: int) -> None:
        """`num_seqs` of the tenant's in-flight sequences (--tenant-max-requests), or
        RESOURCE_EXHAUSTED; INVALID_ARGUMENT for a request wider than a whole quota, which
        waiting cannot cure."""
        limit, used = self.max_seqs_per_tenant, self.tenant_seqs[tenant]
        if limit and tenant and num_seqs > limit:
            raise InvalidArgument(
                f"this request runs {num_seqs} sequences (sampling.n, or beam_width with beam "
                f"search); tenant {tenant!r} may have at most {limit} in flight at once "
                f"(--tenant-max-requests {limit}): lower n or the beam width"
            )
        if limit and tenant and used + num_seqs > limit:
            raise ResourceExhausted(
                f"tenant {tenant!r} has {used} sequences in flight and this request needs "
                f"{num_seqs} more (n, or the beam width), over its quota "
                f"(--tenant-max-requests {limit}): wait for one to finish"
            )
        self.tenant_seqs[tenant] += num_seqs

    async def deltas(self, request: Request) -> AsyncGenerator[CompletionDelta, None]:
        """Every completion delta of the request until all n are finished; errors raise.
        Leaving early (client gone, deadline) cancels the request."""
        open_completions = request.sampling.n
        engine_open = set(range(request.sampling.n))  # completions the engine still runs
        num_tokens = 0
        reason: FinishReason | None = None
        observer = self.metrics.observer(request) if self.metrics is not None else None
        output = RequestOutput(self.tokenizer, request)
        try:
            while open_completions:
                engine_delta = await request.outputs.get()
                if engine_delta.error is not None or engine_delta.finish_reason is not None:
                    engine_open.discard(engine_delta.index)
                if engine_delta.error is not None:
                    if output.ended(engine_delta.index):
                        continue  # it failed after its stop string, which the client has
                    raise engine_delta.error
                delta, finished = output.process(engine_delta)
                if delta is None:
                    continue  # sampled after its completion's stop string
                if finished is not None:
                    open_completions -= 1
                    reason = delta.finish_reason
                num_tokens += len(delta.token_ids)
                if observer is not None:
                    observer.on_delta(delta)
                yield delta
        finally:
            if observer is not None:
                observer.on_end(None if open_completions else reason)
            self._forget(request)
            if open_completions:
                self.engines.cancel(request)
                log.info("request_cancelled", num_completion_tokens=num_tokens)
            elif engine_open:
                # The text ended a completion the engine did not (its stop-string search
                # failed, or the two disagree): it is cancelled rather than run to its end.
                self.engines.cancel(request)
                log.warning("request_outlived_its_text", num_open=len(engine_open))
            else:
                log.info("request_finished", num_completion_tokens=num_tokens,
                         num_cached_tokens=request.num_cached_tokens or 0)

    def abandon(self, request: Request) -> None:
        """Its caller is gone (or never read it): cancel it if it is still active. A no-op
        once `deltas` has run to its end."""
        if self.active.get((request.tenant, request.request_id)) is request:
            self._forget(request)
            self.engines.cancel(request)
            log.info("request_abandoned")

    def _unique_id(self, tenant: str, request_id: str, n: int, num_prompt_tokens: int,
                   beam_width: int) -> str:
        """Request ids are the tenant's own: another tenant's never collide with them."""
        if not request_id:
            # The caller's x-request-id when it is a valid id and free, sequence ids
            # included; else a new id.
            bound = str(structlog.contextvars.get_contextvars().get("request_id") or "")
            if (bound and len(bound) <= MAX_REQUEST_ID_CHARS
                    and (tenant, bound) not in self.active
                    and self._taken(tenant, sequence_ids(bound, n, num_prompt_tokens,
                                                         beam_width)) is None):
                return bound
            return uuid.uuid4().hex[:16]
        if (tenant, request_id) in self.active:
            raise AlreadyExists(f"request_id {request_id!r} is already in flight: use a new one")
        return request_id

    def _check_seq_ids_free(self, tenant: str, request_id: str, seq_ids: list[str]) -> None:
        """Another active request's sequence already has one of these ids (n > 1 names its
        sequences `<id>-prefill` and `<id>-<i>`): refused here, not by the allocator, which
        would fail the step."""
        seq_id = self._taken(tenant, seq_ids)
        if seq_id is not None:
            raise AlreadyExists(
                f"request_id {request_id!r} needs sequence id {seq_id!r}, which request "
                f"{self.seq_owners[(tenant, seq_id)]!r} is using (n > 1 names its sequences "
                "<id>-prefill and <id>-<i>, beam search <id>-beam-<j>): use another id"
            )

    def _taken(self, tenant: str, seq_ids: list[str]) -> str | None:
        """The first of these ids an active request of the tenant has, if any."""
        return next((s for s in seq_ids if (tenant, s) in self.seq_owners), None)

    def _forget(self, request: Request) -> None:
        """The request is no longer active: its id and its sequence ids are free again."""
        key = (request.tenant, request.request_id)
        if self.active.get(key) is not request:
            return
        del self.active[key]
        self.tenant_seqs[request.tenant] -= request.num_seqs
        if self.adapters is not None:
            self.adapters.release(request.lora)
        beam = request.sampling.beam
        for seq_id in sequence_ids(request.request_id, request.sampling.n,
                                   len(request.prompt_token_ids),
                                   beam.beam_width if beam is not None else 0):
            self.seq_owners.pop((request.tenant, seq_id), None)


def _num_seqs(raw: RawSampling) -> int:
    """The sequences a request runs at most at once, from its fields before validation
    (the same as Request.num_seqs once validated)."""
    n = raw.n or 1
    if raw.use_beam_search:
        return n if raw.beam_width is None else raw.beam_width
    return n


def _tenant_tag(tenant: str) -> str:
    """A tenant's part of its sequence ids on the wire (ids are per tenant); none for one."""
    return hashlib.sha256(tenant.encode()).hexdigest()[:8] + "/" if tenant else ""


def _utf8_len(text: str) -> int:
    """UTF-8 size without encoding a copy: 1 byte a character for ASCII (the common case)."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
