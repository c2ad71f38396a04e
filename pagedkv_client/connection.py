"""Where and how to reach the gateway: address, TLS, API key and channel options, shared by
the blocking and the asyncio client."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from pagedkv_client.retry import RetryPolicy

DEFAULT_ADDRESS = "localhost:50051"


@dataclass(frozen=True, slots=True)
class Connection:
    address: str
    metadata: tuple[tuple[str, str], ...]  # sent with every call (the API key)
    root_certificates: bytes | None        # TLS with this CA
    tls: bool                              # TLS (the system's roots when no CA is given)
    options: tuple[tuple[str, Any], ...]

    @classmethod
    def create(cls, address: str, *, api_key: str | None, tls: bool,
               tls_ca: str | Path | None, retry: RetryPolicy,
               options: Sequence[tuple[str, Any]]) -> Connection:
        """`tls_ca`: a PEM file, read now (a missing file fails here, not at the first call)."""
        metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        roots = Path(tls_ca).read_bytes() if tls_ca else None
        return cls(address, metadata, roots, tls or roots is not None,
                   (*retry.channel_options(), *options))

    def _credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.root_certificates)

    def channel(self) -> grpc.Channel:
        if self.tls:
            return grpc.secure_channel(self.address, self._credentials(), self.options)
        return grpc.insecure_channel(self.address, self.options)

    def aio_channel(self) -> grpc.aio.Channel:
        if self.tls:
            return grpc.aio.secure_channel(self.address, self._credentials(), self.options)
        return grpc.aio.insecure_channel(self.address, self.options)
