"""Credentials of the internal services: one token per role, mutual TLS files.

Each process holds only its own role's token (gateway, allocator or executor) and presents it
on every call it makes (`authorization: Bearer <token>`); a server holds only the SHA-256
digests of the tokens it accepts, each naming its caller's role (`--caller-digests-file`), so
it can tell who calls without holding anything that lets it pose as that caller. What each
role may call is the servers' method table (common.auth.Access). `python -m tools.make_secret
--roles DIR` writes a set; the launcher, compose and the Kubernetes manifests hand them out.

Loaded from the flags every service shares (`add_internal_auth_flags`) and checked at start;
free of grpc at import (the executor tunes malloc before grpc and torch start threads), so
grpc is imported where credentials become channels or server credentials.
"""

from __future__ import annotations

import functools
import hashlib
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.config import SettingsError, add_flag

AUTHORIZATION_KEY = "authorization"
BEARER = "Bearer "
ROLES = ("gateway", "allocator", "executor")
# The role token may come from the environment instead of a file (a Kubernetes Secret as an
# env var); it is never a command-line flag (visible to every user in `ps`). The digests are
# not secret: inline in the environment, or a file.
ROLE_TOKEN_ENV = "PAGEDKV_ROLE_TOKEN"
CALLER_DIGESTS_ENV = "PAGEDKV_CALLER_DIGESTS"
# The one shared token every process held before (issue 30): refused at start, see below.
LEGACY_TOKEN_ENV = "PAGEDKV_INTERNAL_TOKEN"
MIN_TOKEN_CHARS = 16
NEW_CREDENTIALS = (
    "give each process its own role token (--role-token-file or PAGEDKV_ROLE_TOKEN) and the "
    "allocator and executors the callers' digests (--caller-digests-file or "
    "PAGEDKV_CALLER_DIGESTS); `python -m tools.make_secret --roles DIR` writes a set")


class CredentialsError(SettingsError):
    """Credentials are configured wrongly: the service cannot start (message says why)."""


def token_digest(token: str) -> str:
    """What a server keeps of a caller's token: its SHA-256 (hex)."""
    return hashlib.sha256(token.encode()).hexdigest()


def new_role_token(role: str) -> str:
    """A fresh token for `role`; the role in its text is for people reading a file: the
    server takes the role from the digest's line, never from the token."""
    assert role in ROLES, role
    return f"{role}.{secrets.token_urlsafe(32)}"


def lease_tag(lease_id: str) -> str:
    """What logs and error messages name a lease by: a lease id is a capability (whoever
    has it may free and abort its requests), its tag only tells two leases apart."""
    return "lease-" + hashlib.sha256(lease_id.encode()).hexdigest()[:12]


def digest_lines(tokens: dict[str, str]) -> str:
    """A --caller-digests-file for `tokens` (role -> token)."""
    return "".join(f"{role} {token_digest(token)}\n" for role, token in tokens.items())


def parse_caller_digests(text: str, where: str) -> tuple[tuple[str, str], ...]:
    """(digest, role) pairs from '<role> <sha256 hex>' entries (lines or comma-separated;
    '#' starts a comment)."""
    pairs = []
    lines = (line.split("#", 1)[0] for line in text.splitlines())
    for entry in (e.strip() for line in lines for e in line.split(",")):
        if not entry:
            continue
        parts = entry.replace("=", " ").replace(":", " ").split()
        if len(parts) != 2 or parts[0] not in ROLES:
            raise CredentialsError(
                f"{where}: expected '<role> <sha256 hex>' with a role among "
                f"{', '.join(ROLES)}, got {entry[:40]!r}")
        role, digest = parts[0], parts[1].lower()
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise CredentialsError(f"{where}: {role}'s digest is not 64 hex digits (SHA-256)")
        pairs.append((digest, role))
    if not pairs:
        raise CredentialsError(f"{where}: no digests in it")
    return tuple(pairs)


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
    """An internal service's credentials: as a client of the others, its own role's token
    (`token`); as a server, the digests of the callers' tokens it accepts (`callers`:
    (digest, role) pairs); mutual TLS, either way."""

    token: str = ""
    tls: TlsFiles | None = None
    callers: tuple[tuple[str, str], ...] = ()

    @property
    def enabled(self) -> bool:
        return bool(self.token) or bool(self.callers) or self.tls is not None

    def describe(self) -> str:
        """What the start-up line says of it."""
        parts = (["mutual-tls"] if self.tls else []) + (["role-tokens"] if self.callers else [])
        return "+".join(parts) or ("client token only" if self.token else "none (--insecure)")

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


def read_token(path: str, flag: str = "--role-token-file") -> str:
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise CredentialsError(f"{flag} {path}: cannot read it ({exc.strerror})") from exc
    if not token:
        raise CredentialsError(f"{flag} {path}: the file is empty")
    return token


def check_token(token: str, what: str = "the role token") -> str:
    if len(token) < MIN_TOKEN_CHARS:
        raise CredentialsError(
            f"{what} has {len(token)} characters; use at least {MIN_TOKEN_CHARS} random ones "
            "(python -m tools.make_secret --roles DIR writes a set)")
    if not (token.isascii() and token.isprintable()) or " " in token:
        raise CredentialsError(
            f"{what} must be printable ASCII without spaces or newlines inside (it travels "
            "as a header value)")
    return token


def _caller_digests(path: str) -> tuple[tuple[str, str], ...]:
    if path:
        try:
            return parse_caller_digests(Path(path).read_text(), f"--caller-digests-file {path}")
        except OSError as exc:
            raise CredentialsError(
                f"--caller-digests-file {path}: cannot read it ({exc.strerror})") from exc
    inline = os.environ.get(CALLER_DIGESTS_ENV, "").strip()
    return parse_caller_digests(inline, CALLER_DIGESTS_ENV) if inline else ()


def load_internal_auth(
    token_file: str, tls_cert: str, tls_key: str, tls_ca: str, insecure: bool,
    caller_digests_file: str = "", serves: bool = True, legacy_token_file: str = "",
) -> InternalAuth:
    """The credentials named by the common flags (and the environment). A server
    (`serves`: the allocator, an executor) needs a way to tell its callers (digests or mutual
    TLS) and its own token or certificate for the calls it makes; a client (the gateway,
    tools) only the latter. None at all is refused unless `insecure` says so explicitly."""
    if legacy_token_file or os.environ.get(LEGACY_TOKEN_ENV):
        # NOTE: refused, not mapped: the one shared token made every holder every role (an
        # executor could step, free and read events as a gateway), and no role can be told
        # from it; mapping it to all three would keep exactly that hole.
        where = "--internal-token-file" if legacy_token_file else LEGACY_TOKEN_ENV
        raise CredentialsError(
            f"{where}: the shared internal token is gone (one secret made every holder every "
            f"role): {NEW_CREDENTIALS}")
    token = read_token(token_file) if token_file else os.environ.get(ROLE_TOKEN_ENV, "").strip()
    if token:
        check_token(token)
    callers = _caller_digests(caller_digests_file) if serves else ()
    tls_parts = (tls_cert, tls_key, tls_ca)
    if any(tls_parts) and not all(tls_parts):
        raise CredentialsError("mutual TLS needs all three of --tls-cert, --tls-key, --tls-ca")
    auth = InternalAuth(token=token, tls=TlsFiles(*tls_parts) if all(tls_parts) else None,
                        callers=callers)
    if auth.tls is not None:
        auth.tls.read()  # refused at start, not at the first call
    if insecure:
        return auth
    if not auth.enabled:
        raise CredentialsError(
            f"no internal credentials: {NEW_CREDENTIALS}; or use --tls-cert/--tls-key/--tls-ca "
            "(make certs); or pass --insecure to let anyone who reaches the port call every RPC")
    if serves and auth.tls is None and not callers:
        raise CredentialsError(
            "this service would accept every caller: give it the callers' digests "
            f"(--caller-digests-file or {CALLER_DIGESTS_ENV}) or mutual TLS (--tls-*)")
    if auth.tls is None and not token:
        raise CredentialsError(
            "no credential to call the other services with: give this process its own role "
            f"token (--role-token-file or {ROLE_TOKEN_ENV}) or mutual TLS (--tls-*)")
    return auth


def add_internal_auth_flags(parser: Any) -> None:
    """The credential flags every internal service and its clients share."""
    add_flag(parser, "--role-token-file", default="",
             help=f"file holding this process's own role token (or set {ROLE_TOKEN_ENV})")
    add_flag(parser, "--caller-digests-file", default="",
             help="servers: the SHA-256 digests of the role tokens to accept, one "
             f"'<role> <hex>' a line (or set {CALLER_DIGESTS_ENV})")
    add_flag(parser, "--internal-token-file", default="",
             help="removed (one shared token made every holder every role): refused at start")
    add_flag(parser, "--tls-cert", default="", help="this process's TLS certificate (PEM)")
    add_flag(parser, "--tls-key", default="", help="its private key (PEM)")
    add_flag(parser, "--tls-ca", default="",
             help="the CA that signs every internal certificate (mutual TLS)")
    add_flag(parser, "--insecure", action="store_true",
             help="run without internal credentials: anyone who reaches the port may call "
             "every RPC (local development only)")


AUTH_FLAG_NAMES = ("role_token_file", "caller_digests_file", "internal_token_file",
                   "tls_cert", "tls_key", "tls_ca", "insecure")


def internal_auth_from_args(args: Any, serves: bool = True) -> InternalAuth:
    return load_internal_auth(args.role_token_file, args.tls_cert, args.tls_key, args.tls_ca,
                              args.insecure, args.caller_digests_file, serves,
                              args.internal_token_file)


@dataclass(frozen=True, slots=True)
class RoleTokens:
    """A set of role tokens (the launcher's, tests'): each process gets its own token and
    every server the digests of all three."""

    tokens: tuple[tuple[str, str], ...]  # (role, token)

    @classmethod
    def new(cls) -> RoleTokens:
        return cls(tuple((role, new_role_token(role)) for role in ROLES))

    def token(self, role: str) -> str:
        return dict(self.tokens)[role]

    @property
    def digests(self) -> str:
        return digest_lines(dict(self.tokens))

    def env(self, role: str) -> dict[str, str]:
        """The environment a process of `role` is started with."""
        return {ROLE_TOKEN_ENV: self.token(role), CALLER_DIGESTS_ENV: self.digests.strip()}

    def auth(self, role: str, tls: TlsFiles | None = None) -> InternalAuth:
        """`role`'s credentials in process (tests, tools, in-process servers)."""
        return InternalAuth(token=self.token(role), tls=tls,
                            callers=parse_caller_digests(self.digests, "role tokens"))


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
