"""The asyncio client: the blocking client's calls, awaited; streams are async iterators."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar, overload

import grpc

from pagedkv.gateway.v1 import gateway_pb2 as pb
from pagedkv.gateway.v1 import gateway_pb2_grpc as pb_grpc
from pagedkv_client import convert
from pagedkv_client.connection import DEFAULT_ADDRESS, Connection
from pagedkv_client.convert import ChatMessage, Prompt
from pagedkv_client.errors import from_rpc_error
from pagedkv_client.results import Delta, ModelInfo, Result
from pagedkv_client.retry import DEFAULT_RETRY, Attempts, RetryPolicy

T = TypeVar("T")


class AsyncClient:
    """The gateway's gRPC API for asyncio; the same arguments as Client.

        async with AsyncClient("localhost:50051") as client:
            async for delta in client.generate("The quick brown fox", max_tokens=16):
                print(delta.text, end="")
            result = await client.complete("Hello", max_tokens=8, temperature=0)

    The channel opens on the first call, on the running event loop; use the client on that
    loop only. Cancelling the task that iterates a stream (or leaving `async for` and closing
    the iterator, e.g. with `contextlib.aclosing`) cancels the request at the gateway.
    """

    def __init__(self, address: str = DEFAULT_ADDRESS, *, api_key: str | None = None,
                 tls_ca: str | Path | None = None, tls: bool = False,
                 timeout: float | None = None, retry: RetryPolicy = DEFAULT_RETRY,
                 options: Sequence[tuple[str, Any]] = ()) -> None:
        self._connection = Connection.create(address, api_key=api_key, tls=tls,
                                             tls_ca=tls_ca, retry=retry, options=options)
        self._channel: grpc.aio.Channel | None = None
        self._stub_: pb_grpc.GatewayServiceStub | None = None
        self.timeout = timeout
        self.retry = retry

    @property
    def _stub(self) -> pb_grpc.GatewayServiceStub:
        if self._stub_ is None:
            self._channel = self._connection.aio_channel()
            self._stub_ = pb_grpc.GatewayServiceStub(self._channel)
        return self._stub_

    async def close(self) -> None:
        """Close the channel (calls in flight are cancelled)."""
        if self._channel is not None:
            await self._channel.close()
        self._channel = self._stub_ = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def generate(self, prompt: Prompt, *, cache_salt: str = "", request_id: str = "",
                 timeout: float | None = None, **sampling: Any) -> AsyncGenerator[Delta, None]:
        """Stream a completion of `prompt` as deltas (`async for`, no await). Retried on
        UNAVAILABLE only before the first delta, never after."""
        request = convert.build_request(pb.GenerateRequest, prompt, cache_salt=cache_salt,
                                        request_id=request_id, sampling=sampling)
        return self._stream(request, timeout)

    async def complete(self, prompt: Prompt, *, cache_salt: str = "", request_id: str = "",
                       timeout: float | None = None, **sampling: Any) -> Result:
        """The whole completion(s) of `prompt` in one response."""
        request = convert.build_request(pb.CompleteRequest, prompt, cache_salt=cache_salt,
                                        request_id=request_id, sampling=sampling)
        return await self._complete(request, timeout)

    @overload
    def chat(self, messages: Sequence[ChatMessage], *, stream: Literal[False] = False,
             cache_salt: str = "", request_id: str = "", timeout: float | None = None,
             **sampling: Any) -> Awaitable[Result]: ...

    @overload
    def chat(self, messages: Sequence[ChatMessage], *, stream: Literal[True],
             cache_salt: str = "", request_id: str = "", timeout: float | None = None,
             **sampling: Any) -> AsyncGenerator[Delta, None]: ...

    def chat(self, messages: Sequence[ChatMessage], *, stream: bool = False,
             cache_salt: str = "", request_id: str = "", timeout: float | None = None,
             **sampling: Any) -> Awaitable[Result] | AsyncGenerator[Delta, None]:
        """`await client.chat(messages)` for a Result; `client.chat(messages, stream=True)`
        is an async iterator of deltas (no await)."""
        if stream:
            return self._stream(convert.build_request(
                pb.GenerateRequest, messages=messages, cache_salt=cache_salt,
                request_id=request_id, sampling=sampling), timeout)
        request = convert.build_request(pb.CompleteRequest, messages=messages,
                                        cache_salt=cache_salt, request_id=request_id,
                                        sampling=sampling)
        return self._complete(request, timeout)

    async def _complete(self, request: pb.CompleteRequest, timeout: float | None) -> Result:
        return convert.result(await self._unary(self._stub.Complete, request, timeout))

    async def tokenize(self, text: str, *, timeout: float | None = None) -> list[int]:
        response = await self._unary(self._stub.Tokenize, pb.TokenizeRequest(text=text),
                                     timeout)
        return list(response.token_ids)

    async def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        response = await self._unary(self._stub.GetModelInfo, pb.GetModelInfoRequest(),
                                     timeout)
        return convert.model_info(response)

    async def load_lora_adapter(self, name: str, path: str, *,
                                timeout: float | None = None) -> None:
        """As Client.load_lora_adapter."""
        await self._unary(self._stub.LoadLoraAdapter,
                          pb.LoadLoraAdapterRequest(lora_name=name, lora_path=path), timeout)

    async def unload_lora_adapter(self, name: str, *, timeout: float | None = None) -> None:
        """As Client.unload_lora_adapter."""
        await self._unary(self._stub.UnloadLoraAdapter,
                          pb.UnloadLoraAdapterRequest(lora_name=name), timeout)

    def _attempts(self, timeout: float | None) -> Attempts:
        return Attempts.start(self.retry, timeout if timeout is not None else self.timeout)

    async def _unary(self, method: Callable[..., Awaitable[T]], request: Any,
                     timeout: float | None) -> T:
        attempts = self._attempts(timeout)
        while True:
            try:
                return await method(request, timeout=attempts.next_timeout(),
                                    metadata=self._connection.metadata)
            except grpc.RpcError as exc:
                delay = attempts.backoff_after(exc)
                if delay is None:
                    raise from_rpc_error(exc, attempts.made) from exc
            await asyncio.sleep(delay)

    async def _stream(self, request: pb.GenerateRequest,
                      timeout: float | None) -> AsyncGenerator[Delta, None]:
        attempts = self._attempts(timeout)
        while True:
            call = self._stub.Generate(request, timeout=attempts.next_timeout(),
                                       metadata=self._connection.metadata)
            try:
                first = await call.read()
                break
            except grpc.RpcError as exc:
                delay = attempts.backoff_after(exc)
                if delay is None:
                    raise from_rpc_error(exc, attempts.made) from exc
            except BaseException:  # cancelled while waiting for the first response
                call.cancel()
                raise
            await asyncio.sleep(delay)
        try:
            response = first
            while response is not grpc.aio.EOF:
                yield convert.delta(response)
                response = await call.read()
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, attempts.made) from exc
        finally:
            call.cancel()  # nothing when the stream ended; else the gateway frees the request
