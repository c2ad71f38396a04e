"""Model directories at start: real weights, presets, and every directory that cannot serve."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import structlog
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from common.model_dirs import DEFAULT_MODEL, PRESETS_DIR
from executor_svc import model_loader
from executor_svc.model_loader import ModelLoadError, dummy_model, load_model, resolve_dtype

from .oracle import MODELS

ROOT = MODELS.parent
TINY = MODELS / "tiny-llama"


def _load(path: Path, load_format: str = "auto") -> object:
    return load_model(str(path), load_format, "float32", "cpu", seed=0)


def _config_only(tmp_path: Path, source: Path = TINY) -> Path:
    """A copy of a preset outside models/: a user's directory, not a shipped preset."""
    target = tmp_path / "model"
    shutil.copytree(source, target)
    return target


def test_loader_names_a_matmul_library_it_does_not_know(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDKV_MATMUL_LIBRARY", "openblas")
    with pytest.raises(ModelLoadError, match="PAGEDKV_MATMUL_LIBRARY='openblas': choose one of "
                                             "mkl, onednn"):
        _load(TINY, "dummy")


def test_loader_serves_a_config_only_preset_with_dummy_weights_and_a_warning() -> None:
    # tiny-llama ships no weights: auto gives seeded random ones and says so at WARNING.
    with structlog.testing.capture_logs() as logs:
        loaded = _load(TINY)
    assert loaded.fingerprint  # type: ignore[attr-defined]
    warnings = [e for e in logs if e["event"] == "dummy_weights"]
    assert warnings and warnings[0]["log_level"] == "warning"


def test_loader_refuses_a_user_directory_without_weights(tmp_path: Path) -> None:
    # Outside models/, no safetensors under auto is an error that names --load-format dummy.
    needle = r"no \*\.safetensors weights in .*--load-format dummy"
    with pytest.raises(ModelLoadError, match=needle):
        _load(_config_only(tmp_path))


def test_loader_dummy_on_request_even_without_weights(tmp_path: Path) -> None:
    # --load-format dummy is a request: the same directory loads, random weights.
    assert _load(_config_only(tmp_path), "dummy") is not None


@pytest.mark.parametrize(
    ("name", "needle"),
    [("model.gguf", "GGUF checkpoint"), ("pytorch_model.bin", "only safetensors are loaded")],
)
def test_loader_names_a_checkpoint_format_it_does_not_load(
    tmp_path: Path, name: str, needle: str
) -> None:
    # A GGUF or pickled checkpoint: refused, naming the file and how to convert it.
    directory = _config_only(tmp_path)
    (directory / name).write_bytes(b"\0" * 16)
    with pytest.raises(ModelLoadError, match=needle) as info:
        _load(directory)
    assert name in str(info.value)


def test_loader_refuses_an_architecture_that_is_not_a_decoder(tmp_path: Path) -> None:
    # An encoder-decoder config (T5) cannot be served: the message says what can.
    directory = tmp_path / "t5"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"model_type": "t5", "d_model": 64}))
    with pytest.raises(ModelLoadError, match="decoder-only"):
        _load(directory)


def test_loader_refuses_an_unknown_model_type(tmp_path: Path) -> None:
    # A model_type transformers does not know: the config cannot be read; said in one message.
    directory = tmp_path / "odd"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"model_type": "no-such-model"}))
    with pytest.raises(ModelLoadError, match="cannot read a transformers config"):
        _load(directory)


def test_loader_names_a_missing_config(tmp_path: Path) -> None:
    # An empty directory: the message names config.json, not a key inside it.
    with pytest.raises(ModelLoadError, match="no config.json in .*point --model at a model"):
        _load(tmp_path)


def test_loader_refuses_weights_without_a_tokenizer(tmp_path: Path) -> None:
    # Real weights whose tokenizer is missing: refused at start, not at the first request.
    directory = tmp_path / "no-tokenizer"
    directory.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        (directory / name).symlink_to(DEFAULT_MODEL / name)
    with pytest.raises(ModelLoadError, match="no tokenizer in"):
        _load(directory)


def test_loader_reads_eos_from_config_and_generation_config(tmp_path: Path) -> None:
    # An end-of-turn token named only by generation_config.json is an EOS too.
    directory = _config_only(tmp_path)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    loaded = _load(directory, "dummy")
    assert loaded.eos_token_ids == (2, 7)  # type: ignore[attr-defined]


def test_loader_embedded_model_loads_real_weights() -> None:
    # The embedded default: weights from safetensors, EOS 2 (<|im_end|>), 30 layers.
    with structlog.testing.capture_logs() as logs:
        loaded = _load(DEFAULT_MODEL)
    assert loaded.config.num_hidden_layers == 30  # type: ignore[attr-defined]
    assert loaded.eos_token_ids == (2,)  # type: ignore[attr-defined]
    assert not [e for e in logs if e["event"] == "dummy_weights"]
    assert DEFAULT_MODEL.parent == PRESETS_DIR
    # Mapped file pages are dropped under memory pressure and read from disk again by the
    # next step: every parameter must live in the executor's own memory, where transformers'
    # own load leaves them on the checkpoint's map (read from /proc/self/maps: Linux, where
    # the executor runs).
    weights = DEFAULT_MODEL / "model.safetensors"
    params = list(loaded.model.parameters())  # type: ignore[attr-defined]
    assert params and not _on_map(params, weights)
    plain = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, local_files_only=True)
    assert _on_map(list(plain.parameters()), weights)


def _on_map(params: list[torch.nn.Parameter], path: Path) -> list[torch.nn.Parameter]:
    """The parameters whose data lies in this process's memory mappings of `path`."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and Path(fields[5]) == path.resolve():
            ranges.append(tuple(int(x, 16) for x in fields[0].split("-")))
    return [p for p in params if any(lo <= p.data_ptr() < hi for lo, hi in ranges)]


@pytest.mark.e2e  # (a Python subprocess)
def test_main_exits_with_one_line_for_a_directory_that_cannot_serve(tmp_path: Path) -> None:
    # The executor process: exit 2, one error line naming the problem and the remedy.
    directory = _config_only(tmp_path)
    result = subprocess.run(
        [sys.executable, "-m", "executor_svc", "--model", str(directory), "--port", "0",
         "--insecure"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if "executor_failed_to_start" in line]
    assert len(errors) == 1 and "--load-format dummy" in errors[0]
    assert "Traceback" not in result.stderr


def test_dummy_weights_are_drawn_on_the_cpu_whatever_the_default_device() -> None:
    # A CUDA executor builds its dummy weights under its device; CUDA's generator would draw
    # other numbers from the same seed. Under another default device (meta here, where no
    # number is drawn at all) the weights are the CPU's, equal to a plain CPU draw.
    config = AutoConfig.from_pretrained(TINY)
    with torch.device("meta"):
        elsewhere = dummy_model(config, torch.float32, seed=3)
    here = dummy_model(config, torch.float32, seed=3)
    pairs = list(zip(elsewhere.state_dict().items(), here.state_dict().items(), strict=True))
    assert all(a.device.type == "cpu" and a.equal(b) for (_, a), (_, b) in pairs)
    other_seed = dummy_model(config, torch.float32, seed=4)
    assert not other_seed.lm_head.weight.equal(here.lm_head.weight)


def test_fingerprint_names_weights_and_dtype_never_the_device() -> None:
    # Two executors' KV is interchangeable only with the same weights in the same dtype.
    def fp(seed: int, dtype: str) -> str:
        return load_model(str(TINY), "dummy", dtype, "cpu", seed).fingerprint

    assert fp(0, "float32") == fp(0, "float32")
    assert len({fp(0, "float32"), fp(0, "bfloat16"), fp(1, "float32")}) == 3
    config = AutoConfig.from_pretrained(TINY)
    assert "cuda" not in json.dumps(config.to_dict(), default=str)  # nothing device-bound in it


@pytest.mark.parametrize(("avx512_bf16", "amx", "onednn", "expected"), [
    (True, False, True, torch.bfloat16),  # e.g. Cooper Lake, Zen 4
    (False, True, True, torch.bfloat16),  # Sapphire Rapids and later
    (False, False, True, torch.float32),  # AVX-512 or AVX2 alone: bf16 converted in software
    (True, True, False, torch.float32),  # a torch without oneDNN
])
def test_auto_dtype_is_bfloat16_where_the_cpu_computes_it_in_hardware(
    monkeypatch: pytest.MonkeyPatch, avx512_bf16: bool, amx: bool, onednn: bool,
    expected: torch.dtype,
) -> None:
    # bench.auto_dtype measured bfloat16 1.25x (one sequence) to 5x (a 2,048-token prefill)
    # faster on an AMX Xeon; without the hardware the conversions cost more than they save.
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(model_loader, "onednn_packs_bfloat16", lambda: onednn)
    assert resolve_dtype("auto", torch.device("cpu")) == expected
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("float32", torch.device("cpu")) == torch.float32
