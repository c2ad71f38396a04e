"""Who may call a service: the server side of authentication (the credentials themselves
are loaded in common.credentials).

Internal services (allocator, executor) accept only authenticated callers:
- mutual TLS: the server presents its certificate and requires one signed by the same CA
  from the caller (the TLS handshake itself refuses a stranger);
- role tokens (common.credentials): a caller sends `authorization: Bearer <its role's
  token>`; the server knows only the tokens' SHA-256 digests, each naming a role, and takes
  the caller's role from the one that matches; usable alone (plaintext, a private network) or
  on top of TLS (both are then checked).

The public gateway authenticates API keys the same way (one key per tenant): `Authenticator`
is what the guarded handlers (common.interceptor) ask, once per call, with the caller's
`authorization` value; its answer, the caller's principal, is readable in the handler as
`caller()` (each gRPC call runs in its own task, so a context variable cannot leak).

Under mutual TLS a certificate's subject name is its role (`make certs` names them allocator,
executor, gateway; a service's --tls-*-names map more names to a role). Either way one table
per service (`Access`: method -> roles) decides what a caller may do: only gateways step,
free, abort, read events or execute, the allocator besides them asks an executor's Describe,
executors only export KV to each other. A method the table does not name is refused to all.
"""

from __future__ import annotations

import contextvars
import hmac
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from common.credentials import InternalAuth, token_digest
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
    """The server side of the role tokens (None: no digests; TLS alone, or --insecure)."""
    return RoleTokenAuthenticator(auth.callers) if auth.callers else None


def bearer(authorization: str | None) -> str | None:
    """The credential of an `authorization: Bearer <credential>` value; the scheme's name is
    case-insensitive (RFC 7235: `bearer`, `BEARER` too)."""
    if authorization is None:
        return None
    scheme, _, credential = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not credential.strip():
        return None
    return credential.strip()


@dataclass(frozen=True, slots=True)
class RoleTokenAuthenticator:
    """Role tokens, known by their digests: the caller's principal is its token's role."""

    callers: tuple[tuple[str, str], ...]  # (sha256 hex of a token, its role)

    def authenticate(self, authorization: str | None) -> str:
        sent = bearer(authorization)
        if sent is None:
            raise Unauthenticated(
                "this internal service requires a credential: send metadata "
                "'authorization: Bearer <your role's token>' (or use mutual TLS)"
            )
        digest = token_digest(sent).encode()
        role = ""
        for known, name in self.callers:  # every one compared: no early exit
            if hmac.compare_digest(digest, known.encode()):
                role = name
        if not role:
            raise Unauthenticated("the role token is not valid here (not among the service's "
                                  "--caller-digests-file)")
        return role


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


@dataclass(frozen=True, slots=True)
class Access:
    """Who may call what, one table for both kinds of principal: the role of a caller's token
    and, under mutual TLS, the role its certificate's name maps to."""

    roles: Mapping[str, AbstractSet[str]]  # method -> roles allowed (absent: nobody)
    certificate_roles: Mapping[str, str] | None = None  # under mutual TLS: name -> role

    def check(self, method: str, token_role: str | None, context: Any) -> None:
        """Raises PermissionDenied unless every principal the call shows may call `method`
        (`token_role`: None when the service takes no tokens)."""
        allowed = self.roles.get(method, frozenset())
        only = ", ".join(sorted(allowed)) or "no role"
        if token_role is not None and token_role not in allowed:
            raise PermissionDenied(
                f"the {token_role} role's token may not call {method}: only {only} may")
        if self.certificate_roles is not None:
            name = certificate_name(context)
            role = self.certificate_roles.get(name)
            if role not in allowed:
                raise PermissionDenied(
                    f"a certificate for {name[:64]!r} (role {role or 'none'}) may not call "
                    f"{method}: only {only} may (the service's --tls-*-names map names to "
                    "roles)")


def certificate_roles(**names_by_role: AbstractSet[str]) -> dict[str, str]:
    """name -> role, from each role's certificate names."""
    roles: dict[str, str] = {}
    for role, names in names_by_role.items():
        roles.update(dict.fromkeys(names, role))
    return roles
