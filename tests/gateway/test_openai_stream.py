"""The HTTP API's SSE event stream on its own: the bytes on the wire, framing order, usage,
errors mid-stream, and the cut of a client that reads slower than the engine produces
(--max-sse-buffer)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest

from common.errors import Unavailable
from gateway.api.openai.app import Completions, _events, stream_response
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
                            lora=None, sampling=SimpleNamespace(n=1), outputs=asyncio.Queue())

    async def frontend_deltas(request: Any) -> AsyncIterator[CompletionDelta]:
        for delta in deltas:
            if isinstance(delta, Exception):
                raise delta
            for _ in range(backlog):
                state.outputs.put_nowait(delta)
            yield delta

    api = SimpleNamespace(frontend=SimpleNamespace(deltas=frontend_deltas, tokenizer=Tokenizer(),
                                                   abandon=lambda request: None),
                          served_model_name="m", max_sse_buffer=max_sse_buffer)
    body = CompletionRequest(model="m", prompt="x", stream=True)
    return api, state, Completions(api, body)  # type: ignore[arg-type]


async def collect_raw(events: AsyncIterator[bytes]) -> list[bytes]:
    return [e async for e in events]


async def collect(events: AsyncIterator[bytes]) -> list[str]:
    """The events' payloads (what follows `data: `)."""
    out = []
    for event in await collect_raw(events):
        assert event.startswith(b"data: ") and event.endswith(b"\n\n"), event
        out.append(event[len(b"data: "):-2].decode())
    return out


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


def test_every_event_is_one_data_line_of_compact_json_and_a_blank_line():
    # Byte for byte as OpenAI and vLLM frame them: `data: <json>\n\n`, no `\r`, no
    # comment, no space in the JSON's own separators; the last event `data: [DONE]\n\n`.
    api, state, shape = fixture(tokens(3))
    raw = asyncio.run(collect_raw(_events(api, state, shape, include_usage=True)))
    assert raw[-1] == b"data: [DONE]\n\n"
    for event in raw[:-1]:
        payload = json.loads(event.removeprefix(b"data: "))
        assert event == b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"
    assert raw[0] == (b'data: {"id":"cmpl-r1","object":"text_completion","created":'
                      + str(shape.created).encode() + b',"model":"m","choices":[{"index":0,'
                      b'"text":"t0","logprobs":null,"finish_reason":null}],"usage":null}\n\n')


def strip_and_split_reader(reads: list[bytes]) -> list[str]:
    """What a client that strips each read and splits on blank lines keeps (vLLM's
    `bench serve` reads streams this way): whole messages, and a trailing `data: ` message
    once it parses as JSON; messages starting with `:` are comments, skipped."""
    buffer, kept = "", []
    for read in reads:
        buffer += read.strip().decode()
        messages = []
        while "\n\n" in buffer:
            message, buffer = buffer.split("\n\n", 1)
            messages.append(message.strip())
        tail = buffer.removeprefix("data: ").strip()
        if buffer.startswith("data: ") and tail:
            try:
                if tail != "[DONE]":
                    json.loads(tail)
                messages.append(buffer.strip())
                buffer = ""
            except json.JSONDecodeError:
                pass
        kept += [m.removeprefix("data: ") for m in messages if m and not m.startswith(":")]
    return kept


def asgi_body_messages(response: Any) -> list[dict[str, Any]]:
    """Every http.response.body message the response sends, run as an ASGI app."""
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        await asyncio.Event().wait()  # the client never goes away
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
    asyncio.run(response(scope, receive, send))
    assert sent[0]["type"] == "http.response.start"
    return sent[1:]


@pytest.mark.parametrize("packing", [1, 2, 3, 100])
def test_the_response_sends_each_event_whole_and_a_strip_and_split_reader_gets_all(
        packing: int, monkeypatch: pytest.MonkeyPatch):
    # The real response object, run as an ASGI app over a stream slower than sse-starlette's
    # default keep-alive (shortened here to 10 ms): one body message per event, nothing
    # else between them, and read one, two, three or all at a time by vLLM's kind of
    # reader, every event arrives.
    from sse_starlette import EventSourceResponse

    monkeypatch.setattr(EventSourceResponse, "DEFAULT_PING_INTERVAL", 0.01)
    api, state, shape = fixture(tokens(6))
    inner = api.frontend.deltas

    async def slow(request: Any) -> AsyncIterator[CompletionDelta]:
        async for delta in inner(request):
            await asyncio.sleep(0.03)
            yield delta

    api.frontend.deltas = slow
    response = stream_response(api, state, shape, True, {})
    assert response.ping_interval == 0  # any interval: a longer stream would get comments
    messages = asgi_body_messages(response)
    assert messages[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    bodies = [m["body"] for m in messages[:-1]]
    expected = asyncio.run(collect_raw(_events(*fixture(tokens(6))[:3], include_usage=True)))
    assert len(bodies) == len(expected) == 8  # 6 tokens, usage, [DONE]
    assert all(b.startswith(b"data: ") and b.endswith(b"\n\n") and b.count(b"\n") == 2
               for b in bodies)
    reads = [b"".join(bodies[i:i + packing]) for i in range(0, len(bodies), packing)]
    kept = strip_and_split_reader(reads)
    assert kept[-1] == "[DONE]" and len(kept) == 8
    assert [json.loads(k)["choices"][0]["text"] for k in kept[:6]] == [
        "t0", "t1", "t2", "t3", "t4", "end"]
    assert json.loads(kept[6])["usage"]["completion_tokens"] == 6


def test_a_keep_alive_comment_in_a_read_of_its_own_loses_the_events_after_it():
    # Why the stream sends no `: ping` (issue 30): the stripped comment keeps no blank line,
    # the next events glue onto it and leave with it as one comment; a stream whose first
    # event comes after a ping shows no token at all ("never received a valid chunk").
    events = [b'data: {"n":%d}\n\n' % i for i in range(4)]
    reads = [events[0], b": ping - 2026-12-04 02:50:00\n\n", events[1], events[2] + events[3]]
    assert strip_and_split_reader(reads) == ['{"n":0}', '{"n":3}']
    assert strip_and_split_reader([events[0], *events[1:]]) == [
        '{"n":0}', '{"n":1}', '{"n":2}', '{"n":3}']


def test_continuous_usage_puts_the_usage_so_far_in_every_chunk():
    # stream_options.continuous_usage_stats (vLLM's; GuideLLM sends it): completion tokens
    # counted up chunk by chunk, then the usage chunk as without it.
    api, state, shape = fixture(tokens(3))
    events = asyncio.run(collect(_events(api, state, shape, include_usage=True,
                                         continuous_usage=True)))
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["usage"]["completion_tokens"] for c in chunks] == [1, 2, 3, 3]
    assert all(c["usage"]["prompt_tokens"] == 3 for c in chunks)
    assert chunks[-1]["choices"] == [] and events[-1] == "[DONE]"


def test_stream_options_take_vllms_continuous_usage_stats():
    body = CompletionRequest.model_validate(
        {"model": "m", "prompt": "x", "stream": True,
         "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    assert body.include_usage and body.continuous_usage
    plain = CompletionRequest(model="m", prompt="x", stream=True)
    assert not plain.include_usage and not plain.continuous_usage


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
