"""Credentials of the internal services: mutual TLS files and the shared internal token.

Loaded from the flags every service shares (`add_internal_auth_flags`) and checked at start;
free of grpc at import (the executor tunes malloc before grpc and torch start threads), so
grpc is imported where credentials become channels or server credentials.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

AUTHORIZATION_KEY = "authorization"
BEARER = "Bearer "
# The internal token may come from the environment instead of a file (a Kubernetes Secret
# as an env var); it is never a command-line flag (visible to every user in `ps`).
INTERNAL_TOKEN_ENV = "PAGEDKV_INTERNAL_TOKEN"
MIN_TOKEN_CHARS = 16


class CredentialsError(ValueError):
    """Credentials are configured wrongly: the service cannot start (message says why)."""


@dataclass(frozen=True, slots=True)
class TlsFiles:
    cert: str
    key: str
    ca: str

    def read(self) -> tuple[bytes, bytes, bytes]:
        try:
            return (Path(self.cert).read_bytes(), Path(self.key).read_bytes(),
                    Path(self.ca).read_bytes())
        except OSError as exc:
            raise CredentialsError(
                f"cannot read TLS file {exc.filename} ({exc.strerror}): check --tls-cert, "
                "--tls-key and --tls-ca (make certs creates development ones)"
            ) from exc


@dataclass(frozen=True, slots=True)
class InternalAuth:
    """An internal service's credentials, as server and as client of the others."""

    token: str = ""
    tls: TlsFiles | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.token) or self.tls is not None

    def server_credentials(self, require_client_cert: bool = True) -> Any:
        """grpc.ServerCredentials for TLS (None: plaintext)."""
        if self.tls is None:
            return None
        import grpc

        cert, key, ca = self.tls.read()
        return grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=ca, require_client_auth=require_client_cert
        )

    def call_metadata(self) -> tuple[tuple[str, str], ...]:
        """Metadata every call to an internal service carries."""
        return ((AUTHORIZATION_KEY, BEARER + self.token),) if self.token else ()

    def _channel_credentials(self) -> Any:
        import grpc

        assert self.tls is not None
        cert, key, ca = self.tls.read()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key,
                                            certificate_chain=cert)

    def aio_channel(self, address: str, options: Sequence[tuple[str, Any]] = ()) -> Any:
        import grpc

        if self.tls is None:
            return grpc.aio.insecure_channel(address, options=list(options))
        return grpc.aio.secure_channel(address, self._channel_credentials(),
                                       options=list(options))

    def channel(self, address: str, options: Sequence[tuple[str, Any]] = ()) -> Any:
        """A blocking channel whose calls carry the credential (tools, tests)."""
        import grpc

        if self.tls is None:
            channel = grpc.insecure_channel(address, options=list(options))
        else:
            channel = grpc.secure_channel(address, self._channel_credentials(),
                                          options=list(options))
        return with_metadata(channel, self.call_metadata())


def read_token(path: str, flag: str = "--internal-token-file") -> str:
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise CredentialsError(f"{flag} {path}: cannot read it ({exc.strerror})") from exc
    if not token:
        raise CredentialsError(f"{flag} {path}: the file is empty")
    return token


def load_internal_auth(
    token_file: str, tls_cert: str, tls_key: str, tls_ca: str, insecure: bool
) -> InternalAuth:
    """The credentials named by the common flags (and PAGEDKV_INTERNAL_TOKEN); none at all is
    refused unless `insecure` says so explicitly."""
    token = read_token(token_file) if token_file else os.environ.get(INTERNAL_TOKEN_ENV, "")
    token = token.strip()
    if token and len(token) < MIN_TOKEN_CHARS:
        raise CredentialsError(
            f"the internal token has {len(token)} characters; use at least {MIN_TOKEN_CHARS} "
            "random ones (for example: python -c 'import secrets; "
            "print(secrets.token_urlsafe(32))')"
        )
    if token and not (token.isascii() and token.isprintable()):
        raise CredentialsError(
            "the internal token must be printable ASCII without spaces or newlines inside "
            "(it travels as a header value)")
    tls_parts = (tls_cert, tls_key, tls_ca)
    if any(tls_parts) and not all(tls_parts):
        raise CredentialsError("mutual TLS needs all three of --tls-cert, --tls-key, --tls-ca")
    auth = InternalAuth(token=token, tls=TlsFiles(*tls_parts) if all(tls_parts) else None)
    if auth.tls is not None:
        auth.tls.read()  # refused at start, not at the first call
    if not auth.enabled and not insecure:
        raise CredentialsError(
            "no internal credentials: set --internal-token-file (or PAGEDKV_INTERNAL_TOKEN), "
            "or --tls-cert/--tls-key/--tls-ca (make certs), or pass --insecure to let anyone "
            "who reaches the port call every RPC"
        )
    return auth


def add_internal_auth_flags(parser: Any) -> None:
    """The credential flags every internal service and its clients share."""
    from common.config import add_flag

    add_flag(parser, "--internal-token-file", default="",
             help=f"file holding the shared internal token (or set {INTERNAL_TOKEN_ENV})")
    add_flag(parser, "--tls-cert", default="", help="this process's TLS certificate (PEM)")
    add_flag(parser, "--tls-key", default="", help="its private key (PEM)")
    add_flag(parser, "--tls-ca", default="",
             help="the CA that signs every internal certificate (mutual TLS)")
    add_flag(parser, "--insecure", action="store_true",
             help="run without internal credentials: anyone who reaches the port may call "
             "every RPC (local development only)")


def internal_auth_from_args(args: Any) -> InternalAuth:
    return load_internal_auth(args.internal_token_file, args.tls_cert, args.tls_key,
                              args.tls_ca, args.insecure)




def with_metadata(channel: Any, metadata: tuple[tuple[str, str], ...]) -> Any:
    """`channel` (a blocking one), every call of which carries `metadata` (tools and tests;
    the services' own clients pass it per call, which costs nothing on the hot path)."""
    if not metadata:
        return channel
    import grpc

    return grpc.intercept_channel(channel, _metadata_interceptor_class()(metadata))


@functools.cache
def _metadata_interceptor_class() -> Any:
    import grpc

    class MetadataInterceptor(grpc.UnaryUnaryClientInterceptor,
                              grpc.UnaryStreamClientInterceptor):
        def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
            self.metadata = metadata

        def _details(self, details: Any) -> Any:
            return details._replace(metadata=(*(details.metadata or ()), *self.metadata))

        def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
            return continuation(self._details(details), request)

        def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
            return continuation(self._details(details), request)

    return MetadataInterceptor
