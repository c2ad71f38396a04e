"""bench.load's checks of what another checkout's gateway takes."""

from __future__ import annotations

from bench.load import _gateway_flag, _has_step_log
from common.model_dirs import REPO_ROOT


def test_a_gateway_flag_is_found_in_settings_declared_once() -> None:
    # This tree declares settings as fields (`http_port: ...`), older trees named the flag as a
    # string; both count, and a flag the gateway lacks does not.
    tree = str(REPO_ROOT)
    assert _gateway_flag(tree, "--http-port") and _has_step_log(tree)
    assert not _gateway_flag(tree, "--no-such-flag")


def test_an_older_tree_naming_its_flags_as_strings_is_read_too(tmp_path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "gateway").mkdir()
    (tmp_path / "gateway" / "settings.py").write_text('p.add_argument("--step-log")\n')
    assert _has_step_log(str(tmp_path)) and not _gateway_flag(str(tmp_path), "--http-port")
