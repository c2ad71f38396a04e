"""API keys files and tenant salts (gateway/api/tenants.py): a file that cannot work stops the
gateway with a message naming the line; salts separate tenants and keep the caller's."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.credentials import CredentialsError
from gateway.api.tenants import Tenancy, load_api_keys, load_tenancy

GOOD = "key-0123456789abcdef"


@pytest.mark.parametrize(("text", "message"), [
    (f"{GOOD}\n", ":1: expected '<key> <tenant>'"),
    (f"{GOOD} a extra\n", ":1: expected '<key> <tenant>'"),
    ("short a\n", ":1: a key needs at least 16 characters"),
    (f"# header\n{GOOD} a\n{GOOD} b\n", ":3: this key is listed twice"),
    ("k\u00e9y-0123456789abcdef a\n", ":1: a key must be printable ASCII"),
    ("# nothing but comments\n\n", "no keys in it"),
])
def test_a_bad_keys_file_names_the_line(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "keys"
    path.write_text(text)
    with pytest.raises(CredentialsError, match=message):
        load_api_keys(str(path))


def test_keys_may_hold_a_hash_and_comments_are_whole_lines(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(f"# key tenant\n\n{GOOD}#x acme\n  {GOOD} beta  \n")
    assert load_api_keys(str(path)) == {f"{GOOD}#x": "acme", GOOD: "beta"}
    with pytest.raises(CredentialsError, match="cannot read it"):
        load_api_keys(str(tmp_path / "absent"))


def test_salts_separate_tenants_keep_the_callers_and_follow_the_shared_secret(
    tmp_path: Path,
) -> None:
    secret = tmp_path / "secret"
    secret.write_text("a-shared-secret-of-some-length\n")
    keys = tmp_path / "keys"
    keys.write_text(f"{GOOD} acme\n")
    one = load_tenancy(str(keys), str(secret), "")
    two = load_tenancy(str(keys), str(secret), "another-internal-token")
    assert one.multi_tenant and one.salt_secret == two.salt_secret  # the file wins
    assert one.cache_salt("acme", "s") == two.cache_salt("acme", "s")
    assert one.cache_salt("acme", "s") != one.cache_salt("beta", "s")
    assert one.cache_salt("acme", "s") != one.cache_salt("acme", "t")
    assert one.cache_salt("acme", "s").endswith(":s")
    single = Tenancy({}, b"")
    assert not single.multi_tenant and single.cache_salt("", "s") == "s"
    (tmp_path / "empty").write_text("")
    with pytest.raises(CredentialsError, match="--salt-secret-file .*the file is empty"):
        load_tenancy(str(keys), str(tmp_path / "empty"), "")
