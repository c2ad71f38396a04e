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


def test_fetch_leaves_every_file_readable_by_other_users(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # safetensors writes its files 0600 and the staging folder is 0700; the image converts as
    # root and serves as uid 10001: the built directory must be readable by everyone.
    import torch
    from safetensors.torch import save_file

    fetch = _module()

    def convert(gguf: Path, out: Path) -> None:
        (out / "sub").mkdir(parents=True)
        save_file({"w": torch.zeros(2)}, str(out / "model.safetensors"))  # the real writer
        (out / "sub" / "tokenizer.json").write_text("{}")
        (out / "sub" / "tokenizer.json").chmod(0o600)
        (out / "sub").chmod(0o700)

    monkeypatch.setattr(fetch, "download_gguf", _fake_download)
    monkeypatch.setattr(fetch, "convert", convert)
    out = tmp_path / "smollm2"
    fetch.build(out)
    modes = {p.relative_to(out).as_posix(): p.stat().st_mode & 0o777
             for p in [out, *out.rglob("*")]}
    assert set(modes) == {".", ".complete", "model.safetensors", "sub", "sub/tokenizer.json"}
    unreadable = {name: oct(mode) for name, mode in modes.items()
                  if mode & 0o004 == 0 or (name in {".", "sub"} and mode & 0o001 == 0)}
    assert unreadable == {}
