"""The HTTP API's SSE event stream on its own: framing order, usage, errors mid-stream, and
the cut of a client that reads slower than the engine produces (--max-sse-buffer)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

from common.errors import Unavailable
from gateway.api.openai.app import Completions, _events
from gateway.api.openai.protocol import CompletionRequest
from gateway.core.request_state import CompletionDelta, FinishReason, Usage


class Tokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(f"<{i}>" for i in ids)


def fixture(deltas: list[CompletionDelta | Exception], max_sse_buffer: int = 8,
            backlog: int = 0) -> tuple[Any, Any, Completions]:
    """An api whose frontend yields `deltas`; `backlog` more wait in the request's queue
    after each (a producer ahead of its reader)."""
    state = SimpleNamespace(request_id="r1", prompt_token_ids=[1, 2, 3], num_cached_tokens=0,
                            sampling=SimpleNamespace(n=1), outputs=asyncio.Queue())

    async def frontend_deltas(request: Any) -> AsyncIterator[CompletionDelta]:
        for delta in deltas:
            if isinstance(delta, Exception):
                raise delta
            for _ in range(backlog):
                state.outputs.put_nowait(delta)
            yield delta

    api = SimpleNamespace(frontend=SimpleNamespace(deltas=frontend_deltas, tokenizer=Tokenizer()),
                          served_model_name="m", max_sse_buffer=max_sse_buffer)
    body = CompletionRequest(model="m", prompt="x", stream=True)
    return api, state, Completions(api, body)  # type: ignore[arg-type]


async def collect(events: AsyncIterator[str]) -> list[str]:
    return [e async for e in events]


def tokens(n: int) -> list[CompletionDelta | Exception]:
    out: list[CompletionDelta | Exception] = [
        CompletionDelta(index=0, token_ids=(i,), text=f"t{i}") for i in range(n - 1)]
    out.append(CompletionDelta(index=0, token_ids=(n - 1,), text="end",
                               finish_reason=FinishReason.LENGTH,
                               usage=Usage(3, n, 0)))
    return out


def test_events_end_with_usage_then_done():
    api, state, shape = fixture(tokens(3))
    events = asyncio.run(collect(_events(api, state, shape, include_usage=True)))
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["choices"][0]["text"] for c in chunks[:-1]] == ["t0", "t1", "end"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    assert all(c["usage"] is None for c in chunks[:-1])


def test_an_error_mid_stream_is_an_error_event_then_done():
    api, state, shape = fixture([*tokens(3)[:2], Unavailable("executor went away")])
    events = asyncio.run(collect(_events(api, state, shape, include_usage=False)))
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == 503 and "executor went away" in error["message"]


def test_a_reader_that_falls_behind_is_cut():
    # More than max_sse_buffer deltas queued behind the one being sent: the stream ends
    # there, without [DONE] (the client sees a cut stream), and the request is released.
    api, state, shape = fixture(tokens(50), max_sse_buffer=4, backlog=1)
    events = asyncio.run(collect(_events(api, state, shape, include_usage=False)))
    assert len(events) == 5  # the 5th delta leaves 5 queued: cut after sending it
    assert "[DONE]" not in events


def test_a_reader_that_keeps_up_is_never_cut():
    api, state, shape = fixture(tokens(50), max_sse_buffer=4, backlog=0)
    events = asyncio.run(collect(_events(api, state, shape, include_usage=False)))
    assert len(events) == 51 and events[-1] == "[DONE]"


def test_every_error_code_has_its_http_status():
    # The error taxonomy shared with gRPC, as OpenAI-shaped HTTP statuses.
    from common.auth import Unauthenticated
    from common.errors import (
        AlreadyExists,
        FailedPrecondition,
        Internal,
        InvalidArgument,
        NotFound,
        PermissionDenied,
        ResourceExhausted,
    )
    from gateway.api.openai.errors import error_body, status_of
    from gateway.api.sampling import ExceedsCapacity

    expected = {InvalidArgument: 400, FailedPrecondition: 400, Unauthenticated: 401,
                PermissionDenied: 403, NotFound: 404, AlreadyExists: 409,
                ResourceExhausted: 429, ExceedsCapacity: 400, Unavailable: 503, Internal: 500}
    for cls, status in expected.items():
        assert status_of(cls("x")) == status, cls
    assert error_body(503, "no executor") == {"error": {
        "message": "no executor", "type": "service_unavailable", "param": None, "code": 503}}
