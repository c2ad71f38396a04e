"""A client's channel to an internal service (the gateway's to the allocator and executors,
an executor's to another executor's ExportKV): its options, the credential every call
carries, and the request id a call about one request names."""

from __future__ import annotations

from collections.abc import Sequence

from common.credentials import InternalAuth
from common.interceptor import REQUEST_ID_KEY

CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    # A peer that went away is dialled again at most a second apart: with gRPC's default
    # backoff (up to 120 s) an allocator back after a 15 s outage stayed unreachable for up
    # to 12 s more, each call failing at once meanwhile.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


Metadata = tuple[tuple[str, str], ...]


def call_metadata(auth: Metadata, request_id: str | None) -> Metadata:
    """The credential every call carries, and the request id when the call is about one (and
    it can be a header value: gRPC refuses the whole call otherwise)."""
    if request_id and request_id.isascii() and request_id.isprintable():
        return (*auth, (REQUEST_ID_KEY, request_id))
    return auth


class InternalChannel:
    """The channel and credential the allocator's and executors' clients share."""

    def __init__(self, address: str, auth: InternalAuth | None = None) -> None:
        self.address = address
        auth = auth or InternalAuth()
        self.auth_metadata = auth.call_metadata()
        self.channel = auth.aio_channel(address, options=CHANNEL_OPTIONS)

    async def close(self) -> None:
        await self.channel.close()

    def _about(self, request_ids: Sequence[str]) -> Metadata:
        """A call about one request carries its id (the services' logs name it)."""
        return call_metadata(self.auth_metadata, request_ids[0] if len(request_ids) == 1 else None)
