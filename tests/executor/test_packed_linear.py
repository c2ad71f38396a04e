"""Linear layers on weights packed once at load (packed_linear.py, cpu_kernels/csrc/
packed_gemm.cpp) against nn.Linear. Whole-model parity (packed linears inside the executor,
greedy tokens equal to transformers' generate at every batch size) is in test_runner.py,
test_cpu_backend.py and tests/e2e."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from executor_svc import packed_linear
from executor_svc.packed_linear import (
    MATMUL_LIBRARY_ENV,
    MKL_PACKED_MAX_ROWS,
    MKL_PACKED_MIN_ROWS,
    OneDnnWeight,
    PackedLinear,
    matmul_library,
    mkl_pack_weight,
    onednn_packs_bfloat16,
    pack_concatenated,
    pack_linears,
    pack_weight,
)

from .oracle import MODELS

X86 = platform.machine() in ("x86_64", "AMD64")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def mkl_kernel(kernel):  # type: ignore[no-untyped-def]
    """The kernels with MKL's packed GEMM: required on x86-64, where torch's CPU builds carry
    MKL (its absence fails); elsewhere torch has no MKL and float32 layers keep F.linear."""
    if not X86:
        pytest.skip("needs an x86-64 CPU (torch's builds carry MKL only there): run "
                    "`.venv/bin/python -m pytest tests/executor/test_packed_linear.py` on one")
    assert kernel.mkl_packed_gemm_available(), "torch's x86 build exports no MKL CBLAS"
    return kernel


def _model(dtype: torch.dtype = torch.float32, preset: str = "tiny-llama") -> torch.nn.Module:
    config = AutoConfig.from_pretrained(MODELS / preset)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(dtype).eval()
    model.requires_grad_(False)
    return model


def _linears(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    return {name: module for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear)}


def _packed_with_the_same_parameters(
    model: torch.nn.Module, kernels: object
) -> tuple[dict[str, torch.nn.Linear], dict[str, torch.nn.Module]]:
    """pack_linears on `model`: every linear layer replaced, the state_dict unchanged; the
    layers before (by name) and the model's modules after."""
    plain = _linears(model)
    expected_state = {k: v.clone() for k, v in model.state_dict().items()}
    assert pack_linears(model, kernels) == len(plain)  # type: ignore[arg-type]
    packed = dict(model.named_modules())
    assert all(isinstance(packed[n], PackedLinear) for n in plain)
    state = model.state_dict()
    assert list(state) == list(expected_state)
    assert all(torch.equal(state[k], v) for k, v in expected_state.items())
    return plain, packed


@pytest.mark.parametrize("rows", [1, 2, 3, 17, 64, 511, 2048])
@pytest.mark.parametrize(("out_features", "in_features"), [(1536, 576), (192, 576), (576, 1536),
                                                             (7, 5)])
def test_mkl_packed_linear_matches_f_linear_at_any_row_count(mkl_kernel, rows, out_features,  # type: ignore[no-untyped-def]
                                                             in_features) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(out_features, in_features, generator=gen)
    packed = mkl_pack_weight(weight, mkl_kernel)
    assert packed is not None
    x = torch.randn(rows, in_features, generator=gen)
    # Same products, summed in another order: float rounding only.
    torch.testing.assert_close(packed.linear(x, None), torch.nn.functional.linear(x, weight),
                               rtol=1e-5, atol=1e-4)


def test_mkl_packed_linear_refuses_bad_input(mkl_kernel) -> None:  # type: ignore[no-untyped-def]
    kernel = mkl_kernel
    packed = kernel.mkl_pack_weight(torch.randn(64, 32))
    with pytest.raises(RuntimeError, match="2-D float32"):
        kernel.mkl_packed_linear(torch.randn(4, 32, dtype=torch.bfloat16), packed, 64)
    with pytest.raises(RuntimeError, match="too small"):
        kernel.mkl_packed_linear(torch.randn(4, 4096), packed, 4096)
    with pytest.raises(RuntimeError, match="float32 CPU weight"):
        kernel.mkl_pack_weight(torch.randn(64, 32, dtype=torch.float64))


@pytest.mark.parametrize(("vendor", "library"), [
    ("GenuineIntel", "mkl"), ("AuthenticAMD", "onednn"), ("", "onednn")])
def test_mkl_computes_only_on_intel_cpus_unless_told(monkeypatch: pytest.MonkeyPatch,
                                                     vendor: str, library: str) -> None:
    monkeypatch.setattr(packed_linear, "cpu_vendor", lambda: vendor)
    monkeypatch.delenv(MATMUL_LIBRARY_ENV, raising=False)
    assert matmul_library() == library
    for told in ("mkl", "onednn", " OneDNN "):
        monkeypatch.setenv(MATMUL_LIBRARY_ENV, told)
        assert matmul_library() == told.strip().lower()
    monkeypatch.setenv(MATMUL_LIBRARY_ENV, "openblas")
    with pytest.raises(ValueError, match=f"{MATMUL_LIBRARY_ENV}='openblas': choose one of "
                                         "mkl, onednn"):
        matmul_library()


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2"])
def test_float32_linears_are_packed_for_mkl_and_agree_with_linear(
    mkl_kernel, monkeypatch: pytest.MonkeyPatch, preset: str  # type: ignore[no-untyped-def]
) -> None:
    # On Intel CPUs every linear layer (Qwen2's q/k/v with their bias) gets an MKL-packed copy
    # used for MKL_PACKED_MIN_ROWS..MKL_PACKED_MAX_ROWS rows; fewer or more take F.linear
    # itself. Parameters are unchanged.
    monkeypatch.setenv(MATMUL_LIBRARY_ENV, "mkl")
    model = _model(preset=preset)
    plain, packed = _packed_with_the_same_parameters(model, mkl_kernel)
    assert any(linear.bias is not None for linear in plain.values()) == (preset == "tiny-qwen2")
    for name, linear in plain.items():
        for rows in (MKL_PACKED_MIN_ROWS, 16, MKL_PACKED_MAX_ROWS):
            x = torch.randn(1, rows, linear.in_features)  # the model's [1, T, H]
            torch.testing.assert_close(packed[name](x), linear(x), rtol=1e-5, atol=1e-4)
        for rows in (MKL_PACKED_MIN_ROWS - 1, MKL_PACKED_MAX_ROWS + 1):  # F.linear itself
            x = torch.randn(1, rows, linear.in_features)
            assert torch.equal(packed[name](x), linear(x))


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2"])
def test_float32_linears_are_packed_for_onednn_off_intel_and_agree_with_linear(
    kernel, monkeypatch: pytest.MonkeyPatch, preset: str  # type: ignore[no-untyped-def]
) -> None:
    # Elsewhere every linear layer (biases too) gets a oneDNN-packed copy used for any number
    # of rows, one to a prefill chunk's. Parameters are unchanged.
    monkeypatch.setenv(MATMUL_LIBRARY_ENV, "onednn")
    plain, packed = _packed_with_the_same_parameters(_model(preset=preset), kernel)
    for name, linear in plain.items():
        layer = packed[name]
        assert isinstance(layer, PackedLinear) and isinstance(layer.packed, OneDnnWeight)
        assert (layer.min_rows, layer.max_rows) == (1, None)
        for rows in (1, 2, 16, MKL_PACKED_MAX_ROWS + 1, 2048):
            x = torch.randn(1, rows, linear.in_features)
            # Same products, summed in another order: float rounding only.
            torch.testing.assert_close(layer(x), linear(x), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("library", ["mkl", "onednn"])
def test_float32_linears_keep_f_linear_without_the_kernels(
    monkeypatch: pytest.MonkeyPatch, library: str
) -> None:
    # A reference model (no CPU kernels) keeps transformers' layers, whichever library.
    monkeypatch.setenv(MATMUL_LIBRARY_ENV, library)
    model = _model()
    assert pack_linears(model, None) == 0
    assert not any(isinstance(m, PackedLinear) for m in model.modules())


def test_bfloat16_linears_are_packed_for_every_row_count_and_agree_with_linear() -> None:
    # bfloat16: every linear layer (the head included) gets a oneDNN-packed copy used for any
    # number of rows, decode to prefill. Parameters are unchanged.
    # A CPU without oneDNN's bf16 kernels (AVX2 only) keeps every layer as it is.
    model = _model(torch.bfloat16)
    plain = _linears(model)
    expected_state = {k: v.clone() for k, v in model.state_dict().items()}
    replaced = pack_linears(model, None)
    if not onednn_packs_bfloat16():
        assert replaced == 0
        assert not any(isinstance(m, PackedLinear) for m in model.modules())
        return
    packed = dict(model.named_modules())
    assert replaced == len(plain) and all(isinstance(packed[n], PackedLinear) for n in plain)
    state = model.state_dict()
    assert list(state) == list(expected_state)
    assert all(torch.equal(state[k], v) for k, v in expected_state.items())
    for name, linear in plain.items():
        assert packed[name].max_rows is None
        for rows in (1, 16, 129, 700):
            x = torch.randn(1, rows, linear.in_features, dtype=torch.bfloat16)
            got, want = packed[name](x).float(), linear(x).float()
            # Both accumulate in float32 and round once to bf16: one bf16 step apart at most.
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(
    not onednn_packs_bfloat16(),
    reason="needs a CPU with oneDNN's bf16 kernels (AVX-512 BW/VL/DQ or AVX-NE-CONVERT, e.g. an "
    "Intel Xeon with AMX): elsewhere nothing is packed for oneDNN, so nothing is concatenated "
    "(test_only_layers_packed_alike_are_concatenated covers that). There run: .venv/bin/python "
    "-m pytest tests/executor/test_packed_linear.py",
)
def test_linears_side_by_side_become_one_packed_matmul() -> None:
    # q, k and v (with biases, as Qwen2's) as one matmul: its output is theirs side by side;
    # their own packed copies go (they keep F.linear, with the same results).
    gen = torch.Generator().manual_seed(2)
    layers = [torch.nn.Linear(64, out, bias=True).to(torch.bfloat16) for out in (64, 32, 32)]
    for layer in layers:
        layer.weight.data = torch.randn(layer.weight.shape, generator=gen).bfloat16()
        layer.bias.data = torch.randn(layer.bias.shape, generator=gen).bfloat16()
    plain = [layer(torch.zeros(1, 64, dtype=torch.bfloat16)) for layer in layers]  # biases
    packed = [PackedLinear(layer, pack_weight(layer.weight), 1, None) for layer in layers]
    fused = pack_concatenated(list(packed))
    assert fused is not None and all(p.packed is None for p in packed)
    weight, bias = fused
    x = torch.randn(5, 64, generator=gen).bfloat16()
    got = weight.linear(x, bias).split([64, 32, 32], dim=-1)
    for part, layer, linear in zip(got, packed, layers, strict=True):
        torch.testing.assert_close(part.float(), linear(x).float(), rtol=2e-2, atol=2e-2)
        assert torch.equal(layer(x), linear(x))  # F.linear now: the same parameters
    assert all(torch.equal(p[0], layer.bias) for p, layer in zip(plain, layers, strict=True))


def test_only_layers_packed_alike_are_concatenated() -> None:
    # A plain nn.Linear among them, or biases on some but not all: nothing is fused and every
    # layer keeps its own packed copy.
    layers = [torch.nn.Linear(16, 16, bias=b).to(torch.bfloat16) for b in (True, False)]
    packed = [PackedLinear(layer, pack_weight(layer.weight), 1, None) for layer in layers]
    if onednn_packs_bfloat16():
        assert pack_concatenated(list(packed)) is None  # one bias, one not
        assert all(p.packed is not None for p in packed)
    assert pack_concatenated([layers[0], packed[0]]) is None  # a plain nn.Linear


_AVX2_ONLY = """
import sys, torch
sys.path[:0] = sys.argv[1:]
from tests.executor.test_packed_linear import _linears, _model
from executor_svc.packed_linear import onednn_packs_bfloat16, pack_linears
model = _model(torch.bfloat16)
x = torch.randn(1, 4, model.config.hidden_size, dtype=torch.bfloat16)
before = {n: l(x) for n, l in _linears(model).items() if l.in_features == x.shape[-1]}
assert not onednn_packs_bfloat16()
assert pack_linears(model, None) == 0
after = dict(model.named_modules())
assert all(torch.equal(after[n](x), y) for n, y in before.items())
print("kept", len(before))
"""


@pytest.mark.e2e  # (a Python subprocess)
def test_bfloat16_linears_fall_back_on_a_cpu_without_onednn_bf16() -> None:
    # The AVX2-only machines' path, taken on any x86 CPU: oneDNN limited to AVX2 (it reads
    # ONEDNN_MAX_CPU_ISA once, at its first use, hence a fresh interpreter).
    if not X86:
        pytest.skip("needs an x86-64 CPU (ONEDNN_MAX_CPU_ISA=AVX2 names an x86 instruction "
                    "set): run `.venv/bin/python -m pytest tests/executor/test_packed_linear.py` "
                    "on one")
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}
    done = subprocess.run([sys.executable, "-c", _AVX2_ONLY, str(REPO)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    last = done.stdout.splitlines()[-1].split()  # structlog's lines come before it
    assert last[0] == "kept" and int(last[1]) > 0, done.stdout[-2000:]
