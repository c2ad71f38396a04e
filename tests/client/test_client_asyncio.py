"""pagedkv_client.AsyncClient against a real stack: the blocking client's checks, awaited,
plus concurrent streams on one channel and a cancelled task."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest
from client_stack import chat_prompt_ids
from tcp_relay import Relay, free_port

from pagedkv_client import AsyncClient, PagedkvError, RetryPolicy
from tests.e2e.e2e_stack import Clients, prompts, reference_greedy, tokenizer

T = TypeVar("T")
FAST_RETRY = RetryPolicy(max_attempts=12, initial_backoff_s=0.05, max_backoff_s=0.4)


def run(address: str, body: Callable[[AsyncClient], Awaitable[T]], **options: object) -> T:
    """body(client) on a fresh event loop, with a client on that loop."""
    async def main() -> T:
        async with AsyncClient(address, **options) as client:  # type: ignore[arg-type]
            return await body(client)
    return asyncio.run(main())


async def stream_ids(client: AsyncClient, prompt: str | list[int], **sampling: Any
                     ) -> list[int]:
    return [t async for d in client.generate(prompt, **sampling) for t in d.token_ids]


def test_async_client_concurrent_streams_and_unary_equal_transformers(clients: Clients):
    # Four concurrent streams on one channel, and the unary call: transformers' greedy tokens.
    batch = [list(p) for p in prompts(4, 16, seed=31)]

    async def body(client: AsyncClient) -> tuple[list[list[int]], tuple[int, ...]]:
        streamed = await asyncio.gather(*(stream_ids(client, p, max_tokens=10, temperature=0)
                                          for p in batch))
        result = await client.complete(batch[0], max_tokens=10, temperature=0)
        return list(streamed), result.token_ids

    streamed, unary = run(clients.stack.gateway_addr, body)
    for prompt, token_ids in zip(batch, streamed, strict=True):
        assert tuple(token_ids) == reference_greedy(tuple(prompt), 10)
    assert unary == reference_greedy(tuple(batch[0]), 10)


def test_async_client_chat_tokenize_and_model_info(clients: Clients):
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    expected = reference_greedy(
        tuple(chat_prompt_ids(Path(clients.stack.spec.model), messages)), 8)

    async def body(client: AsyncClient) -> None:
        assert (await client.chat(messages, max_tokens=8, temperature=0)).token_ids == expected
        streamed = [t async for d in client.chat(messages, stream=True, max_tokens=8,
                                                 temperature=0) for t in d.token_ids]
        assert tuple(streamed) == expected
        assert await client.tokenize("Hello") == tokenizer().encode("Hello")
        info = await client.model_info()
        assert info.executors[0].block_size == 16 and info.max_model_len > 0

    run(clients.stack.gateway_addr, body)


def test_async_client_deadline_and_bad_input_are_typed(clients: Clients):
    prompt = next(prompts(1, 30, seed=37))

    async def body(client: AsyncClient) -> list[PagedkvError]:
        errors = []
        for call in (stream_ids(client, prompt, max_tokens=1500, ignore_eos=True, timeout=0.5),
                     client.complete(prompt, max_tokens=4, temperature=-1.0)):
            with pytest.raises(PagedkvError) as err:
                await call
            errors.append(err.value)
        return errors

    deadline, invalid = run(clients.stack.gateway_addr, body)
    assert deadline.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert invalid.code == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in invalid.details
    clients.wait_all_blocks_back()


def test_async_client_cancelled_task_and_closed_stream_cancel_the_request(clients: Clients):
    # One request's task is cancelled mid-stream; another's iterator is closed after its
    # first delta: both are freed at the gateway, and their ids can be used again.
    prompt = next(prompts(1, 40, seed=41))

    async def body(client: AsyncClient) -> None:
        first = asyncio.Event()

        async def consume() -> None:
            async for _ in client.generate(prompt, max_tokens=1500, ignore_eos=True,
                                           request_id="task-1"):
                first.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(first.wait(), 30)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        async with contextlib.aclosing(client.generate(
                prompt, max_tokens=1500, ignore_eos=True, request_id="task-2")) as stream:
            await anext(stream)

    run(clients.stack.gateway_addr, body)
    clients.wait_all_blocks_back()

    async def reuse(client: AsyncClient) -> list[str]:
        return [(await client.complete(prompt, max_tokens=2, request_id=r)).request_id
                for r in ("task-1", "task-2")]

    assert run(clients.stack.gateway_addr, reuse) == ["task-1", "task-2"]


def test_async_client_retries_until_the_port_comes_up_then_gives_up(clients: Clients):
    relay = Relay(clients.stack.gateway_addr)

    async def late(client: AsyncClient) -> list[int]:
        asyncio.get_running_loop().call_later(0.5, relay.open)
        return await stream_ids(client, "hello", max_tokens=3, temperature=0)

    started = time.monotonic()
    try:
        assert run(relay.address, late, retry=FAST_RETRY, timeout=30)
    finally:
        relay.cut()
    assert time.monotonic() - started >= 0.4

    async def never(client: AsyncClient) -> None:
        await client.tokenize("hello")

    policy = RetryPolicy(max_attempts=3, initial_backoff_s=0.05, max_backoff_s=0.1)
    with pytest.raises(PagedkvError) as err:
        run(f"127.0.0.1:{free_port()}", never, retry=policy)
    assert err.value.code == grpc.StatusCode.UNAVAILABLE and err.value.attempts == 3
