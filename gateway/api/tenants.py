"""Tenants at the public door: API keys, each mapped to a tenant, and per-tenant cache salts.

With keys on, a request's cache salt is derived here, from its tenant: an HMAC of the tenant
under a server secret, joined with whatever salt the caller sent. Blocks hash with their salt,
so two tenants' prefixes never share a block and `cached_prompt_tokens` cannot reveal another
tenant's prompt (the prompt-cache timing side channel). Without keys the gateway is one
tenant: the caller's salt is used as sent, and it says so at start.

The keys file: one `<key> <tenant>` per line; blank lines and lines starting with `#` are
ignored (a key may itself contain `#`).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from common.auth import ApiKeyAuthenticator
from common.credentials import MIN_TOKEN_CHARS, CredentialsError, read_token

SINGLE_TENANT = ""


@dataclass(frozen=True, slots=True)
class Tenancy:
    tenants_by_key: Mapping[str, str]
    salt_secret: bytes

    @property
    def multi_tenant(self) -> bool:
        return bool(self.tenants_by_key)

    def authenticator(self) -> ApiKeyAuthenticator | None:
        return ApiKeyAuthenticator(self.tenants_by_key) if self.tenants_by_key else None

    def cache_salt(self, tenant: str, caller_salt: str) -> str:
        """The salt the allocator hashes this request's blocks with."""
        if not self.multi_tenant:
            return caller_salt
        digest = hmac.new(self.salt_secret, tenant.encode(), hashlib.sha256).hexdigest()[:32]
        return f"t:{digest}:{caller_salt}"


def load_api_keys(path: str) -> dict[str, str]:
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise CredentialsError(f"--api-keys-file {path}: cannot read it ({exc.strerror})") from exc
    keys: dict[str, str] = {}
    for number, line in enumerate(lines, 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        parts = text.split()
        if len(parts) != 2:
            raise CredentialsError(f"--api-keys-file {path}:{number}: expected '<key> <tenant>'")
        key, tenant = parts
        if not (key.isascii() and key.isprintable()):
            raise CredentialsError(
                f"--api-keys-file {path}:{number}: a key must be printable ASCII (a header)")
        if len(key) < MIN_TOKEN_CHARS:
            raise CredentialsError(
                f"--api-keys-file {path}:{number}: a key needs at least {MIN_TOKEN_CHARS} "
                "characters"
            )
        if key in keys:
            raise CredentialsError(f"--api-keys-file {path}:{number}: this key is listed twice")
        keys[key] = tenant
    if not keys:
        raise CredentialsError(f"--api-keys-file {path}: no keys in it")
    return keys


def load_tenancy(api_keys_file: str, salt_secret_file: str, gateway_token: str) -> Tenancy:
    """Every gateway on one allocator must derive the same salts (else a tenant's prefix
    cached through one gateway misses through another): the secret is a file they share,
    else the gateways' role token (which no executor or allocator holds: they know only its
    SHA-256, and the salt secret is not that); a random one only for a lone gateway."""
    keys = load_api_keys(api_keys_file) if api_keys_file else {}
    if salt_secret_file:
        secret = read_token(salt_secret_file, "--salt-secret-file").encode()
    elif gateway_token:
        secret = b"pagedkv-tenant-salt:" + gateway_token.encode()
    else:
        secret = secrets.token_bytes(32)
    return Tenancy(tenants_by_key=keys, salt_secret=secret)
