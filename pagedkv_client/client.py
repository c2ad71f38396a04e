"""The blocking client: one channel, thread-safe, every call typed and retried (retry.py)."""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Sequence
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


class Client:
    """The gateway's gRPC API, blocking.

        with Client("localhost:50051") as client:
            for delta in client.generate("The quick brown fox", max_tokens=16):
                print(delta.text, end="")

    `api_key` is sent as `authorization: Bearer <key>`; `tls_ca` (a PEM file) or `tls=True`
    (the system's roots) for a gateway that serves TLS, plaintext otherwise. `timeout` is
    every call's default deadline in seconds (None: none; a call's own `timeout=` wins), one
    deadline across its retries. Calls that fail raise PagedkvError.

    Sampling keywords are SamplingParams' fields by name: max_tokens, temperature (0:
    greedy), top_p, top_k, seed, stop (a string or a list), stop_token_ids, n, ignore_eos,
    and whatever the gateway's proto adds (min_p, logit_bias, ...); None leaves one unset.
    A keyword that names a field of the request instead (priority) is set there.
    """

    def __init__(self, address: str = DEFAULT_ADDRESS, *, api_key: str | None = None,
                 tls_ca: str | Path | None = None, tls: bool = False,
                 timeout: float | None = None, retry: RetryPolicy = DEFAULT_RETRY,
                 options: Sequence[tuple[str, Any]] = ()) -> None:
        self._connection = Connection.create(address, api_key=api_key, tls=tls,
                                             tls_ca=tls_ca, retry=retry, options=options)
        self._channel = self._connection.channel()
        self._stub = pb_grpc.GatewayServiceStub(self._channel)
        self.timeout = timeout
        self.retry = retry

    def close(self) -> None:
        """Close the channel (calls in flight are cancelled)."""
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def generate(self, prompt: Prompt, *, cache_salt: str = "", request_id: str = "",
                 timeout: float | None = None, **sampling: Any) -> Generator[Delta, None, None]:
        """Stream a completion of `prompt` (text, or token ids) as deltas.

        Leaving the loop early, or closing the generator, cancels the request at the gateway
        (hold it in `contextlib.closing(...)` to do so at once when you keep a reference).
        Retried on UNAVAILABLE only before the first delta, never after."""
        request = convert.build_request(pb.GenerateRequest, prompt, cache_salt=cache_salt,
                                        request_id=request_id, sampling=sampling)
        return self._stream(request, timeout)

    def complete(self, prompt: Prompt, *, cache_salt: str = "", request_id: str = "",
                 timeout: float | None = None, **sampling: Any) -> Result:
        """The whole completion(s) of `prompt` in one response."""
        request = convert.build_request(pb.CompleteRequest, prompt, cache_salt=cache_salt,
                                        request_id=request_id, sampling=sampling)
        return convert.result(self._unary(self._stub.Complete, request, timeout))

    @overload
    def chat(self, messages: Sequence[ChatMessage], *, stream: Literal[False] = False,
             cache_salt: str = "", request_id: str = "", timeout: float | None = None,
             **sampling: Any) -> Result: ...

    @overload
    def chat(self, messages: Sequence[ChatMessage], *, stream: Literal[True],
             cache_salt: str = "", request_id: str = "", timeout: float | None = None,
             **sampling: Any) -> Generator[Delta, None, None]: ...

    def chat(self, messages: Sequence[ChatMessage], *, stream: bool = False,
             cache_salt: str = "", request_id: str = "", timeout: float | None = None,
             **sampling: Any) -> Result | Generator[Delta, None, None]:
        """The model's answer to `messages` ({"role": ..., "content": ...} or (role, content)),
        rendered with its chat template: a Result, or with `stream=True` deltas as generate's.
        """
        if stream:
            return self._stream(convert.build_request(
                pb.GenerateRequest, messages=messages, cache_salt=cache_salt,
                request_id=request_id, sampling=sampling), timeout)
        request = convert.build_request(pb.CompleteRequest, messages=messages,
                                        cache_salt=cache_salt, request_id=request_id,
                                        sampling=sampling)
        return convert.result(self._unary(self._stub.Complete, request, timeout))

    def tokenize(self, text: str, *, timeout: float | None = None) -> list[int]:
        """The token ids the gateway's tokenizer gives `text` (as a prompt would get them)."""
        response = self._unary(self._stub.Tokenize, pb.TokenizeRequest(text=text), timeout)
        return list(response.token_ids)

    def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        """The served model's name and limits, and every executor behind the gateway."""
        response = self._unary(self._stub.GetModelInfo, pb.GetModelInfoRequest(), timeout)
        return convert.model_info(response)

    def load_lora_adapter(self, name: str, path: str, *, timeout: float | None = None) -> None:
        """Load a PEFT adapter directory (on the executors' disks) as model `name`; the
        gateway must allow it (--allow-runtime-lora-updating)."""
        self._unary(self._stub.LoadLoraAdapter,
                    pb.LoadLoraAdapterRequest(lora_name=name, lora_path=path), timeout)

    def unload_lora_adapter(self, name: str, *, timeout: float | None = None) -> None:
        """Unload it once its requests have ended (the gateway waits up to 30 s)."""
        self._unary(self._stub.UnloadLoraAdapter, pb.UnloadLoraAdapterRequest(lora_name=name),
                    timeout)

    def _attempts(self, timeout: float | None) -> Attempts:
        return Attempts.start(self.retry, timeout if timeout is not None else self.timeout)

    def _unary(self, method: Callable[..., T], request: Any, timeout: float | None) -> T:
        attempts = self._attempts(timeout)
        while True:
            try:
                return method(request, timeout=attempts.next_timeout(),
                              metadata=self._connection.metadata)
            except grpc.RpcError as exc:
                delay = attempts.backoff_after(exc)
                if delay is None:
                    raise from_rpc_error(exc, attempts.made) from exc
            time.sleep(delay)

    def _stream(self, request: pb.GenerateRequest,
                timeout: float | None) -> Generator[Delta, None, None]:
        attempts = self._attempts(timeout)
        while True:
            call = self._stub.Generate(request, timeout=attempts.next_timeout(),
                                       metadata=self._connection.metadata)
            try:
                first = next(call)
                break
            except StopIteration:
                return
            except grpc.RpcError as exc:
                delay = attempts.backoff_after(exc)
                if delay is None:
                    raise from_rpc_error(exc, attempts.made) from exc
            except BaseException:  # KeyboardInterrupt, or closed while waiting
                call.cancel()
                raise
            time.sleep(delay)
        try:
            yield convert.delta(first)
            for response in call:
                yield convert.delta(response)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, attempts.made) from exc
        finally:
            call.cancel()  # nothing when the stream ended; else the gateway frees the request
