"""Who may call a service: the server side of authentication (the credentials themselves
are loaded in common.credentials).

Internal services (allocator, executor) accept only authenticated callers:
- mutual TLS: the server presents its certificate and requires one signed by the same CA
  from the caller (the TLS handshake itself refuses a stranger);
- a shared internal token: callers send `authorization: Bearer <token>`, compared in
  constant time; usable alone (plaintext, a private network) or on top of TLS.

The public gateway authenticates API keys the same way (one key per tenant): `Authenticator`
is what the guarded handlers (common.interceptor) ask, once per call, with the caller's
`authorization` value; its answer, the caller's principal, is readable in the handler as
`caller()` (each gRPC call runs in its own task, so a context variable cannot leak).

Under mutual TLS a certificate's subject name is its role (`make certs` names them allocator,
executor, gateway): a service may limit each method to some names (`check_certificate_name`),
so that only gateways execute steps on an executor, and only the allocator besides them asks
an executor's Describe. With the token alone, every holder is any internal caller.
"""

from __future__ import annotations

import contextvars
import hmac
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from common.credentials import BEARER, InternalAuth
from common.errors import PermissionDenied, ServiceError

_caller: contextvars.ContextVar[str] = contextvars.ContextVar("pagedkv_caller", default="")


class Unauthenticated(ServiceError):
    code = grpc.StatusCode.UNAUTHENTICATED


def caller() -> str:
    """The principal the current call was authenticated as ('' when the server is open)."""
    return _caller.get()


def set_caller(principal: str) -> None:
    _caller.set(principal)


class Authenticator(Protocol):
    def authenticate(self, authorization: str | None) -> str:
        """The caller's principal, from its `authorization` metadata (None: absent);
        raises Unauthenticated with a message that says what to send."""
        ...


def internal_authenticator(auth: InternalAuth) -> Authenticator | None:
    """The server side of the internal token (None: no token; TLS alone, or --insecure)."""
    return TokenAuthenticator(auth.token) if auth.token else None


def bearer(authorization: str | None) -> str | None:
    if authorization is None or not authorization.startswith(BEARER):
        return None
    return authorization[len(BEARER):].strip()


@dataclass(frozen=True, slots=True)
class TokenAuthenticator:
    """The internal token: one shared secret, one principal ('internal')."""

    token: str

    def authenticate(self, authorization: str | None) -> str:
        sent = bearer(authorization)
        if sent is None:
            raise Unauthenticated(
                "this internal service requires a credential: send metadata "
                "'authorization: Bearer <internal token>' (or use mutual TLS)"
            )
        if not hmac.compare_digest(sent.encode(), self.token.encode()):
            raise Unauthenticated("the internal token is not valid")
        return "internal"


@dataclass(frozen=True, slots=True)
class ApiKeyAuthenticator:
    """Public API keys, each mapped to its tenant."""

    tenants_by_key: Mapping[str, str]

    def authenticate(self, authorization: str | None) -> str:
        sent = bearer(authorization)
        if sent is None:
            raise Unauthenticated("an API key is required: send 'authorization: Bearer <key>'")
        # Every key compared (constant time each): no early exit reveals a near match.
        tenant = ""
        for key, name in self.tenants_by_key.items():
            if hmac.compare_digest(sent.encode(), key.encode()):
                tenant = name
        if not tenant:
            raise Unauthenticated("the API key is not valid")
        return tenant


def certificate_name(context: Any) -> str:
    """The subject common name of the caller's TLS certificate ('' without one)."""
    names = (context.auth_context() or {}).get("x509_common_name") or []
    return names[0].decode("utf-8", "replace") if names else ""


def check_certificate_name(context: Any, method: str, allowed: AbstractSet[str]) -> None:
    """Under mutual TLS, who may call what: the caller's certificate must name one of
    `allowed` (every certificate of the CA is an internal caller; its name is its role)."""
    name = certificate_name(context)
    if name not in allowed:
        raise PermissionDenied(
            f"a certificate for {name[:64]!r} may not call {method}: only "
            f"{', '.join(sorted(allowed))} (the service's --tls-*-names)"
        )


def split_names(value: str) -> frozenset[str]:
    return frozenset(n.strip() for n in value.split(",") if n.strip())
