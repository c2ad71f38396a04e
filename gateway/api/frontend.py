"""The gateway's core behind the servicer: tokenize, validate, submit, collect deltas.

Tokenizing (and rendering a chat template) runs on a thread of its own, never on the event
loop that serves every stream, and only after the text's size is checked: a prompt over
--max-prompt-bytes is refused at once.
"""

from __future__ import annotations

import asyncio
import collections
import secrets
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

import structlog

from common.errors import AlreadyExists, ResourceExhausted
from gateway.api.sampling import (
    ModelLimits,
    RawSampling,
    check_ids,
    check_prompt_bytes,
    validate,
    validate_prompt,
)
from gateway.api.tenants import SINGLE_TENANT, Tenancy
from gateway.core.request_state import CompletionDelta, Request
from gateway.core.seq_ids import sequence_ids
from gateway.engine.host import EngineHost
from gateway.text.tokenizer import ChatTurn, Tokenizer

T = TypeVar("T")

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


@dataclass(slots=True)
class Frontend:
    tokenizer: Tokenizer
    limits: ModelLimits
    engines: EngineHost
    info: ModelInfo
    tenancy: Tenancy = field(default_factory=lambda: Tenancy({}, b""))
    max_prompt_bytes: int = 1 << 20
    max_requests_per_tenant: int = 0  # in flight at once (0: no limit; one tenant: none)
    tenant_requests: collections.Counter[str] = field(default_factory=collections.Counter)
    active: dict[str, Request] = field(default_factory=dict)
    # The sequence ids of the active requests (seq_ids.py), each with its request's id.
    seq_owners: dict[str, str] = field(default_factory=dict)
    text_thread: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="tokenizer"))
    # This gateway run's sequence-id namespace (seq_ids.py): unique per start.
    id_namespace: str = field(default_factory=lambda: f"{secrets.token_hex(4)}/")

    async def tokenize(self, text: str) -> list[int]:
        check_prompt_bytes(_utf8_len(text), self.max_prompt_bytes)
        return await self._off_loop(self.tokenizer.encode, text)

    async def prompt_token_ids(self, prompt: PromptInput) -> list[int]:
        if prompt.chat is not None:
            size = sum(_utf8_len(t.content) + _utf8_len(t.role) for t in prompt.chat)
            check_prompt_bytes(size, self.max_prompt_bytes, "chat content")
            return await self._off_loop(self.tokenizer.render_chat, prompt.chat)
        if prompt.text:  # empty text is an empty prompt, not a lone BOS token
            return await self.tokenize(prompt.text)
        return list(prompt.token_ids or [])

    async def _off_loop(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.text_thread, fn, *args)

    def close(self) -> None:
        self.text_thread.shutdown(wait=False, cancel_futures=True)

    async def submit(
        self, prompt_input: PromptInput, raw: RawSampling, cache_salt: str, request_id: str,
        tenant: str = SINGLE_TENANT,
    ) -> Request:
        """Validate and queue a request; raises the domain error to send back."""
        check_ids(request_id, cache_salt)
        limit = self.max_requests_per_tenant
        if limit and tenant and self.tenant_requests[tenant] >= limit:
            raise ResourceExhausted(
                f"tenant {tenant!r} has {self.tenant_requests[tenant]} requests in flight, its "
                f"quota (--tenant-max-requests {limit}): wait for one to finish"
            )
        prompt = await self.prompt_token_ids(prompt_input)
        validate_prompt(prompt, self.limits)
        sampling = validate(raw, len(prompt), self.limits)
        request_id = self._unique_id(request_id, sampling.n, len(prompt))
        seq_ids = sequence_ids(request_id, sampling.n, len(prompt))
        self._check_seq_ids_free(request_id, seq_ids)
        # Every event of this call, and the allocator calls about it, carry this id.
        structlog.contextvars.bind_contextvars(request_id=request_id)
        request = Request(request_id=request_id, prompt_token_ids=prompt, sampling=sampling,
                          cache_salt=self.tenancy.cache_salt(tenant, cache_salt),
                          id_namespace=self.id_namespace, tenant=tenant)
        self.active[request_id] = request
        self.tenant_requests[tenant] += 1
        self.seq_owners.update(dict.fromkeys(seq_ids, request_id))
        try:
            engine = await self.engines.submit(request)
        except BaseException:
            # Refused, or this call was cancelled (client gone, deadline) while the engine
            # loop ran the submission: it may have queued the request already.
            self.engines.cancel(request)
            self._forget(request)
            raise
        log.info("request_queued", pool_id=engine.pool_id,
                 num_prompt_tokens=len(prompt), n=sampling.n, max_tokens=sampling.max_tokens)
        return request

    async def deltas(self, request: Request) -> AsyncIterator[CompletionDelta]:
        """Every completion delta of the request until all n are finished; errors raise.
        Leaving early (client gone, deadline) cancels the request."""
        open_completions = request.sampling.n
        num_tokens = 0
        try:
            while open_completions:
                delta = await request.outputs.get()
                if delta.error is not None:
                    raise delta.error
                if delta.finish_reason is not None:
                    open_completions -= 1
                num_tokens += len(delta.token_ids)
                yield delta
        finally:
            self._forget(request)
            if open_completions:
                self.engines.cancel(request)
                log.info("request_cancelled", num_completion_tokens=num_tokens)
            else:
                log.info("request_finished", num_completion_tokens=num_tokens,
                         num_cached_tokens=request.num_cached_tokens or 0)

    def _unique_id(self, request_id: str, n: int, num_prompt_tokens: int) -> str:
        if not request_id:
            # The caller's x-request-id when it is free, sequence ids included; else a new id.
            bound = structlog.contextvars.get_contextvars().get("request_id")
            if bound and str(bound) not in self.active and self._taken(
                sequence_ids(str(bound), n, num_prompt_tokens)
            ) is None:
                return str(bound)
            return uuid.uuid4().hex[:16]
        if request_id in self.active:
            raise AlreadyExists(f"request_id {request_id!r} is already in flight: use a new one")
        return request_id

    def _check_seq_ids_free(self, request_id: str, seq_ids: list[str]) -> None:
        """Another active request's sequence already has one of these ids (n > 1 names its
        sequences `<id>-prefill` and `<id>-<i>`): refused here, not by the allocator, which
        would fail the step."""
        seq_id = self._taken(seq_ids)
        if seq_id is not None:
            raise AlreadyExists(
                f"request_id {request_id!r} needs sequence id {seq_id!r}, which request "
                f"{self.seq_owners[seq_id]!r} is using (n > 1 names its sequences <id>-prefill "
                "and <id>-<i>): use another id"
            )

    def _taken(self, seq_ids: list[str]) -> str | None:
        """The first of these ids an active request's sequence has, if any."""
        return next((seq_id for seq_id in seq_ids if seq_id in self.seq_owners), None)

    def _forget(self, request: Request) -> None:
        """The request is no longer active: its id and its sequence ids are free again."""
        if self.active.get(request.request_id) is not request:
            return
        del self.active[request.request_id]
        self.tenant_requests[request.tenant] -= 1
        for seq_id in sequence_ids(request.request_id, request.sampling.n,
                                   len(request.prompt_token_ids)):
            self.seq_owners.pop(seq_id, None)


def _utf8_len(text: str) -> int:
    """UTF-8 size without encoding a copy: 1 byte a character for ASCII (the common case)."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
