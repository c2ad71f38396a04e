"""`python -m tools.make_secret PATH`: write a random secret to PATH (mode 0600) unless one is
there already. docker compose runs it once to create the internal token every service shares."""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path


def make_secret(path: Path) -> bool:
    """True when a new secret was written."""
    if path.exists() and path.read_text().strip():
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # private from the start
    with os.fdopen(fd, "w") as out:
        out.write(secrets.token_urlsafe(32) + "\n")
    tmp.replace(path)
    return True


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m tools.make_secret PATH", file=sys.stderr)
        return 2
    written = make_secret(Path(argv[0]))
    print(f"{'wrote a new' if written else 'kept the'} secret in {argv[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
