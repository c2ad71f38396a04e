"""`python -m tools.make_secret PATH`: write a random secret to PATH (mode 0600) unless one is
there already (the gateways' salt secret, for one).

`python -m tools.make_secret --roles DIR`: the internal services' credentials, one token per
role, each in its own directory so that each service is handed only its own:

    DIR/gateway/role-token      DIR/allocator/role-token     DIR/executor/role-token
                                DIR/allocator/caller-digests DIR/executor/caller-digests

Tokens already there are kept; the digests (SHA-256 of each token, not secret: they let a
server tell its callers' roles, never pose as one) are written again from them. docker
compose's `credentials` service runs it once; deploy/k8s/README.md makes Secrets of them.
"""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path

from common.credentials import ROLES, digest_lines, new_role_token

SERVERS = ("allocator", "executor")  # the roles that check callers


def _write_private(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # private from the start
    with os.fdopen(fd, "w") as out:
        out.write(text)
    tmp.replace(path)


def make_secret(path: Path, value: str | None = None) -> bool:
    """True when a new secret was written."""
    if path.exists() and path.read_text().strip():
        return False
    _write_private(path, (value or secrets.token_urlsafe(32)) + "\n")
    return True


def make_role_credentials(folder: Path) -> dict[str, bool]:
    """Each role's token (kept when there) and the servers' digests; role -> newly written."""
    written = {role: make_secret(folder / role / "role-token", new_role_token(role))
               for role in ROLES}
    tokens = {role: (folder / role / "role-token").read_text().strip() for role in ROLES}
    for role in SERVERS:
        path = folder / role / "caller-digests"
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text("# <role> <sha256 of its token>: the callers this service accepts\n"
                       + digest_lines(tokens))
        tmp.replace(path)
    return written


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "--roles":
        written = make_role_credentials(Path(argv[1]))
        for role, new in written.items():
            print(f"{'wrote a new' if new else 'kept the'} {role} token in "
                  f"{Path(argv[1]) / role / 'role-token'}")
        return 0
    if len(argv) != 1 or argv[0].startswith("-"):
        print("usage: python -m tools.make_secret PATH | --roles DIR", file=sys.stderr)
        return 2
    new = make_secret(Path(argv[0]))
    print(f"{'wrote a new' if new else 'kept the'} secret in {argv[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
