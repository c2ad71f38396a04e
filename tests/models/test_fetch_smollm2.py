"""models/fetch_smollm2.py: a conversion that fails leaves nothing a later run would trust.

The download and the dequantization are replaced by stand-ins here (no network in tests);
what is under test is the staging: build in a temporary sibling, mark complete, rename.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from common.model_dirs import PRESETS_DIR


def _module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fetch_smollm2", PRESETS_DIR / "fetch_smollm2.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _fake_download(work: Path) -> Path:
    path = work / "model.gguf"
    path.write_bytes(b"gguf")
    return path


def test_fetch_interrupted_conversion_leaves_no_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The conversion writes half its files, then fails: no output directory, no staging left.
    fetch = _module()

    def half_then_fail(gguf: Path, out: Path) -> None:
        out.mkdir()
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(fetch, "download_gguf", _fake_download)
    monkeypatch.setattr(fetch, "convert", half_then_fail)
    out = tmp_path / "smollm2"
    with pytest.raises(KeyboardInterrupt):
        fetch.build(out)
    assert list(tmp_path.iterdir()) == []


def test_fetch_replaces_an_incomplete_directory_and_keeps_a_complete_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A directory without the completion marker is rebuilt; once complete, never touched again.
    fetch = _module()
    calls: list[Path] = []

    def convert(gguf: Path, out: Path) -> None:
        calls.append(out)
        out.mkdir()
        (out / "config.json").write_text('{"ok": true}')

    monkeypatch.setattr(fetch, "download_gguf", _fake_download)
    monkeypatch.setattr(fetch, "convert", convert)
    out = tmp_path / "smollm2"
    out.mkdir()
    (out / "stale.safetensors").write_bytes(b"half")
    fetch.build(out)
    assert sorted(p.name for p in out.iterdir()) == [".complete", "config.json"]
    fetch.build(out)
    assert len(calls) == 1
