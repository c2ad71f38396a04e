"""pagedkv_client: a typed client of pagedkv's gateway (gRPC), blocking and asyncio.

    from pagedkv_client import Client

    with Client("localhost:50051") as client:
        print(client.complete("The capital of France is", max_tokens=8, temperature=0).text)
        for delta in client.chat([{"role": "user", "content": "Hi"}], stream=True):
            print(delta.text, end="", flush=True)

Every failed call raises PagedkvError (`.code`, a grpc.StatusCode, and `.details`). Calls
that fail with UNAVAILABLE are retried with exponential backoff and jitter (RetryPolicy):
unary calls, and streams that failed before their first delta; never a stream that has
yielded. The generated messages are in `pagedkv.gateway.v1.gateway_pb2`.
"""

from pagedkv_client.aio import AsyncClient
from pagedkv_client.client import Client
from pagedkv_client.convert import ChatMessage, Prompt
from pagedkv_client.errors import PagedkvError
from pagedkv_client.results import Completion, Delta, ExecutorInfo, ModelInfo, Result, Usage
from pagedkv_client.retry import NO_RETRY, RetryPolicy

__all__ = [
    "NO_RETRY",
    "AsyncClient",
    "ChatMessage",
    "Client",
    "Completion",
    "Delta",
    "ExecutorInfo",
    "ModelInfo",
    "PagedkvError",
    "Prompt",
    "Result",
    "RetryPolicy",
    "Usage",
]
