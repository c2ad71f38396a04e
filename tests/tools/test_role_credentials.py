"""Handing out the per-role credentials: `tools.make_secret --roles` (compose, Kubernetes)
writes each role's token in its own directory and the servers' digests, keeping tokens on a
second run; the launcher gives each child only its own role's token, never an inherited one."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from common.credentials import (
    CALLER_DIGESTS_ENV,
    LEGACY_TOKEN_ENV,
    ROLE_TOKEN_ENV,
    ROLES,
    CredentialsError,
    digest_lines,
    load_internal_auth,
    new_role_token,
    parse_caller_digests,
    token_digest,
)
from tools.launch import Stack, StackSpec
from tools.make_secret import main as make_secret_main


def test_make_secret_roles_writes_one_private_token_per_role_and_the_servers_digests(
    tmp_path: Path,
) -> None:
    # Gateway: its token only; allocator and executor: theirs and every role's digest. A
    # second run keeps the tokens (a restarted compose keeps its credentials).
    assert make_secret_main(["--roles", str(tmp_path)]) == 0
    tokens = {role: (tmp_path / role / "role-token").read_text().strip() for role in ROLES}
    assert len(set(tokens.values())) == 3
    assert sorted(p.name for p in (tmp_path / "gateway").iterdir()) == ["role-token"]
    for role in ROLES:
        mode = stat.S_IMODE((tmp_path / role / "role-token").stat().st_mode)
        assert mode == 0o600, (role, oct(mode))
    for role in ("allocator", "executor"):
        auth = load_internal_auth(str(tmp_path / role / "role-token"), "", "", "", False,
                                  str(tmp_path / role / "caller-digests"))
        assert auth.token == tokens[role]
        assert sorted(auth.callers) == sorted((token_digest(t), r) for r, t in tokens.items())
    assert make_secret_main(["--roles", str(tmp_path)]) == 0
    assert {r: (tmp_path / r / "role-token").read_text().strip() for r in ROLES} == tokens
    assert make_secret_main(["--roles"]) == 2


def test_the_launcher_hands_each_child_only_its_own_roles_token(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # A token in the launcher's own environment (the old shared one, or a role's) never
    # reaches a child: each gets its role's and the digests of all three.
    monkeypatch.setenv(LEGACY_TOKEN_ENV, "an-old-shared-token-0123456789")
    monkeypatch.setenv(ROLE_TOKEN_ENV, "someone-elses-token-0123456789")
    stack = Stack(StackSpec(), run_dir=str(tmp_path))
    assert stack.role_tokens is not None
    for role in ROLES:
        env = stack._child_env(role, [])
        assert LEGACY_TOKEN_ENV not in env
        assert env[ROLE_TOKEN_ENV] == stack.role_tokens.token(role)
        digests = parse_caller_digests(env[CALLER_DIGESTS_ENV], "env")
        assert sorted(r for _, r in digests) == sorted(ROLES)
    assert stack.internal_auth.token == stack.role_tokens.token("gateway")
    folder = stack.write_credentials()
    assert folder is not None
    assert (folder / "gateway-token").read_text().strip() == stack.role_tokens.token("gateway")
    assert stat.S_IMODE((folder / "executor-token").stat().st_mode) == 0o600


@pytest.mark.parametrize(("text", "words"), [
    ("", "no digests in it"),
    ("# only a comment\n", "no digests in it"),
    ("root " + "a" * 64, "a role among gateway, allocator, executor"),
    ("gateway", "expected '<role> <sha256 hex>'"),
    ("gateway " + "a" * 63, "not 64 hex digits"),
    ("gateway " + "g" * 64, "not 64 hex digits"),
    ("gateway " + "a" * 64 + " extra", "expected '<role> <sha256 hex>'"),
])
def test_a_malformed_caller_digests_file_is_refused_naming_the_problem(
    tmp_path: Path, text: str, words: str
) -> None:
    path = tmp_path / "caller-digests"
    path.write_text(text)
    with pytest.raises(CredentialsError) as info:
        load_internal_auth("", "", "", "", False, caller_digests_file=str(path))
    assert words in str(info.value) and str(path) in str(info.value)


def test_digest_lines_read_back_as_their_roles() -> None:
    tokens = {role: new_role_token(role) for role in ROLES}
    pairs = parse_caller_digests(digest_lines(tokens), "test")
    assert dict(pairs) == {token_digest(t): role for role, t in tokens.items()}
